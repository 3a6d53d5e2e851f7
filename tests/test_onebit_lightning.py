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
@pytest.mark.parametrize("accum,clip", [(1, None), (2, 0.5)])
def test_zero1_warmup_equals_adamw_under_ddp(tmp_path, accum, clip):
    """strategy="zero1" with OneBitAdam before freeze_step: the stage-1 path (reduce-scatter, AdamW on the
    slices, all-gather) equals AdamW under Lightning's DDP at fp32 rtol 1e-5, with accumulation and clipping."""
    ref = fit_parity_module(tmp_path, DDPStrategy(start_method="fork", find_unused_parameters=True), "adamw",
                            accum=accum, clip=clip)
    got = fit_parity_module(tmp_path, "zero1_fork", "onebit:1000", accum=accum, clip=clip)
    compare_rank_files(got, ref, FP32)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accum", [1, 2])
def test_zero1_compressed_phase_equals_zero0(tmp_path, accum):
    """After freeze_step, zero1 (state sharded) trains exactly as zero0: every loss and final weight bit for
    bit (2 ranks: both reductions sum two rows), on ParityModule's two param groups with frozen, unused and
    rank-dependently used parameters."""
    zero0 = fit_parity_module(tmp_path, "zero0_fork", "onebit:2", accum=accum)
    zero1 = fit_parity_module(tmp_path, "zero1_fork", "onebit:2", accum=accum)
    for a, b in zip(zero0, zero1):
        assert a["losses"] == b["losses"]
        for name, v in a["params"].items():
            assert torch.equal(b["params"][name], v), name


def _fabric_onebit(rank, world, steps, freeze):
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy
    from lightning_zero.optim import OneBitAdam
    from tests.helpers.onebit_reference import BETAS, EPS, LR, WD, loss_of, tiny_net

    fabric = Fabric(accelerator="cpu", devices=world, strategy=ZeroFabricStrategy(stage=0))
    fabric.launch()
    model = tiny_net()
    opt = OneBitAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=freeze)
    model, opt = fabric.setup(model, opt)
    losses = []
    for t in range(1, steps + 1):
        loss = loss_of(model, rank, t)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_fabric_onebit_equals_the_reference():
    """Under Fabric (ZeroFabricStrategy(stage=0)) warmup and compressed phase equal the single-process
    reference of 1-bit Adam, as the bare engine does."""
    from lightning_zero.tools.launch import run_ranks
    from tests.helpers.onebit_reference import reference_run

    steps, freeze = 7, 3
    ref_losses, ref_params = reference_run(2, steps, freeze)
    for r, (losses, params) in enumerate(run_ranks(_fabric_onebit, 2, (steps, freeze))):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor([row[r] for row in ref_losses]),
                                   rtol=1e-6, atol=1e-7)
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
