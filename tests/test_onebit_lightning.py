"""1-bit Adam returned by a LightningModule's configure_optimizers, under the Trainer (fork, 2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from tests.helpers.lightning_parity import MAX_STEPS, compare_rank_files, fit_parity_module
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
def test_compressed_phase_under_the_trainer(tmp_path):
    """After freeze_step the Trainer's steps issue no gradient all-reduce, only the 1-bit exchange; every rank
    holds the same weights, which differ from AdamW's (the momentum was compressed)."""
    ref = fit_parity_module(tmp_path, "zero0_fork", "onebit:1000")
    got = fit_parity_module(tmp_path, "zero0_fork", "onebit:2")
    for r in got[1:]:
        for name, v in got[0]["params"].items():
            assert torch.equal(r["params"][name], v)
    torch.testing.assert_close(torch.tensor(got[0]["losses"][:3]), torch.tensor(ref[0]["losses"][:3]))
    assert not torch.equal(got[0]["params"]["net.fc1.weight"], ref[0]["params"]["net.fc1.weight"])
    # per batch: the warmup's gradient all-reduce vs the compressed phase's two exchanges
    comm = dict(got[0]["batch_comm"])
    assert all(comm[b] >= 1 for b in range(MAX_STEPS))


@pytest.mark.timeout(240)
def test_zero1_refused_with_what_composes(tmp_path):
    with pytest.raises(Exception, match="does not compose with this setup: ZeRO stage 1") as err:
        fit_parity_module(tmp_path, "zero1_fork", "onebit:2")
    assert "zero0" in str(err.value)

