"""1-bit Adam returned by a LightningModule's configure_optimizers, under the Trainer (fork, 2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.helpers.lightning_parity import compare_rank_files, fit_parity_module
from tests.helpers.parity import FP32


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accum,clip", [(1, None), (2, 0.5)])
def test_warmup_equals_adamw_under_ddp(tmp_path, accum, clip):
    """Before freeze_step, OneBitAdam under zero0 is AdamW under Lightning's DDP: losses and final weights
    at fp32 rtol 1e-5, with accumulation and global-norm clipping."""
    ref = fit_parity_module(tmp_path, DDPStrategy(start_method="fork", find_unused_parameters=True), "adamw",
                            accum=accum, clip=clip)
    got = fit_parity_module(tmp_path, "zero0_fork", "onebit:1000", accum=accum, clip=clip)
    compare_rank_files(got, ref, FP32)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accum,clip", [(1, None), (2, 0.05)])
def test_compressed_phase_under_the_trainer(tmp_path, accum, clip):
    """After freeze_step (the bytes by phase: test_onebit_adam.py) every rank holds the same weights, which differ from AdamW's (the momentum was compressed). With clipping each rank
    clips its own gradient by its own norm (a small max_norm: it clips), the exchange keeps ranks equal."""
    ref = fit_parity_module(tmp_path, "zero0_fork", "onebit:1000", accum=accum, clip=clip)
    got = fit_parity_module(tmp_path, "zero0_fork", "onebit:2", accum=accum, clip=clip)
    for r in got[1:]:
        for name, v in got[0]["params"].items():
            assert torch.equal(r["params"][name], v)
    warm = 3 * accum  # the micro-batches of the two warmup steps and the first compressed one
    torch.testing.assert_close(torch.tensor(got[0]["losses"][:warm]), torch.tensor(ref[0]["losses"][:warm]))
    assert not torch.equal(got[0]["params"]["net.fc1.weight"], ref[0]["params"]["net.fc1.weight"])


@pytest.mark.timeout(240)
def test_zero1_refused_with_what_composes(tmp_path):
    with pytest.raises(Exception, match="does not compose with this setup: ZeRO stage 1") as err:
        fit_parity_module(tmp_path, "zero1_fork", "onebit:2")
    assert "zero0" in str(err.value)

