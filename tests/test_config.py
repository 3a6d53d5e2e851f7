"""ZeroConfig refuses every malformed knob at construction, with one error naming what is allowed
(instead of accepting it silently, or failing later with a raw conversion error)."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_zero import ZeroConfig, ZeroStrategy

BAD = [
    (dict(stage=2.0), r"Unknown ZeRO stage 2\.0\. Allowed stages: 0, 1, 2, 3 \(an int\)"),
    (dict(stage="2"), r"Allowed stages: 0, 1, 2, 3"),
    (dict(persist_numel=-1), r"persist_numel must be an int >= 0"),
    (dict(persist_numel="x"), r"persist_numel must be an int >= 0 .*got 'x'"),
    (dict(persist_numel=10.5), r"persist_numel must be an int >= 0"),
    (dict(persist_numel=True), r"persist_numel must be an int >= 0"),
    (dict(bucket_mb=float("nan")), r"bucket_mb must be a positive number of MiB \(finite"),
    (dict(bucket_mb=float("inf")), r"bucket_mb must be a positive number of MiB \(finite"),
    (dict(unit_mb=float("nan")), r"unit_mb must be a positive number of MiB \(finite"),
    (dict(unit_mb=float("inf")), r"unit_mb must be a positive number of MiB"),
    (dict(unit_mb=0), r"unit_mb must be a positive number of MiB"),
    (dict(unit_mb="8"), r"unit_mb must be a positive number of MiB"),
    (dict(unit_mb=True), r"unit_mb must be a positive number of MiB"),
    (dict(stage=1, offload_optimizer="yes"), r"offload_optimizer must be True or False, or one of 'none', 'cpu', 'nvme' \(True = 'cpu'\); got 'yes'"),
    (dict(stage=3, offload_params=1), r"offload_params must be True or False, or one of 'none', 'cpu', 'nvme' \(True = 'cpu'\); got 1"),
    (dict(prefetch="false"), r"prefetch must be True \(1 unit ahead\), False \(none\) or an int >= 0"),
    (dict(broadcast_buffers=None), r"broadcast_buffers must be True or False"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_invalid_knob_is_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kwargs)
    with pytest.raises(ValueError, match=match):  # the strategy fails the same way, at construction
        ZeroStrategy(**kwargs)


def test_valid_knobs_still_accepted():
    cfg = ZeroConfig(stage=np.int64(3), bucket_mb=np.float32(0.5), unit_mb=1, persist_numel=np.int32(0),
                     offload_optimizer=True, offload_params=True, prefetch=False)
    assert cfg.stage == 3 and cfg.bucket_bytes == 2**19 and cfg.unit_bytes == 2**20 and cfg.persist_numel == 0
