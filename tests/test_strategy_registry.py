"""ZeroStrategy by constructor and by name: bad constructor values are one error naming what is allowed, valid
combinations land in its ZeroConfig; every preset of the package's table is registered under each launcher
suffix with its whole config; a Trainer resolves a name to the strategy and its ZeroPrecision; the separate
``pytorch_lightning`` distribution gets no names."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero import ZeroPrecision, ZeroStrategy


SUFFIXES = {"": "popen", "_spawn": "spawn", "_fork": "fork"}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(stage=5), r"Allowed stages: 0, 1, 2"),
        (dict(stage=-1), r"Allowed stages: 0, 1, 2"),
        (dict(stage=True), r"Allowed stages: 0, 1, 2"),
        (dict(stage=0, offload_optimizer=True), r"Allowed: offload_optimizer with stage 1, 2"),
        (dict(stage=2, offload_params=True), r"offload_params.*stage 3"),
        (dict(stage=1, offload_params=True), r"offload_params.*stage 3"),
        (dict(bucket_mb=0), r"bucket_mb must be a positive number"),
        (dict(bucket_mb=-4.0), r"bucket_mb must be a positive number"),
        (dict(bucket_mb="25"), r"bucket_mb must be a positive number"),
        (dict(bucket_mb=True), r"bucket_mb must be a positive number"),
        (dict(reduce_dtype="int8"), r"Allowed: None, .*bf16.*fp16.*fp32"),
        (dict(start_method="thread"), r"Allowed: popen, spawn, fork, forkserver"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_constructor_rejects_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


def test_constructor_accepts_valid_combinations():
    s = ZeroStrategy(stage=1, offload_optimizer=True, bucket_mb=0.5, reduce_dtype="fp32", start_method="spawn")
    assert s.stage == 1 and s.zero_config.offload_optimizer
    assert s.zero_config.reduce_dtype is torch.float32
    assert s.zero_config.bucket_bytes == 2**19
    assert ZeroStrategy(stage=0, bucket_mb=3).zero_config.bucket_bytes == 3 * 2**20
    assert ZeroStrategy(stage=3, offload_params=True).zero_config.offload_params


def test_registry_has_every_preset(tmp_path, monkeypatch):
    """Over the package's own table (engine/config.py PRESETS), so a new preset is checked the day it is added."""
    from lightning_zero.engine.config import PRESETS, ZeroConfig

    monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", str(tmp_path))  # where the *_offload_nvme presets' states go

    assert {"zero0", "zero1", "zero2", "zero3", "zero3_offload"} <= set(PRESETS)
    names = set(StrategyRegistry.available_strategies())
    for base, fields in PRESETS.items():
        want = ZeroConfig(**fields)
        for suffix, method in SUFFIXES.items():
            name = base + suffix
            assert name in names, name
            strategy = StrategyRegistry.get(name)
            assert isinstance(strategy, ZeroStrategy), name
            assert strategy.zero_config == want, name  # every field, not only stage and offload
            assert strategy._start_method == method, name


def test_trainer_zero2_fork_resolves_strategy_and_precision():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero2_fork", logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.stage == 2
    assert strategy._start_method == "fork"
    assert isinstance(strategy.precision_plugin, ZeroPrecision)
    assert strategy.precision_plugin.compute_dtype is torch.float32
    assert trainer.precision_plugin is strategy.precision_plugin
    assert strategy.num_processes == 2
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_pytorch_lightning_distribution_gets_no_names():
    """Only the ``lightning`` distribution is supported (README): the separate ``pytorch_lightning`` copy has its
    own classes, so half-registered adapters there trained with checks silently missing. It gets no names."""
    pl = pytest.importorskip("pytorch_lightning")
    assert not [n for n in pl.strategies.StrategyRegistry.available_strategies() if n.startswith("zero")]
