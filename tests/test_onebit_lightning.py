"""1-bit Adam returned by a LightningModule's configure_optimizers, under the Trainer (fork, 2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.helpers.lightning_models import ParityModule, load_rank_files, trainer_kwargs, uses_sometimes
from tests.helpers.lightning_parity import compare_rank_files, fit_parity_module
from tests.helpers.models import batch as step_batch
from tests.helpers.models import loss_fn
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


class _StepBatchModule(ParityModule):
    """ParityModule whose batch is drawn from (global_step, rank), not from the loader: Lightning replays the
    loader differently after an epoch-end resume (the restored epoch is re-entered, so the sampler's epoch
    seed and the batch order change), which would hide whether the strategy restored every state exactly."""

    def training_step(self, batch, batch_idx):
        tokens = step_batch(self.global_step, self.global_rank)
        loss = loss_fn(self.net, tokens, uses_sometimes(self.global_rank, self.global_step))
        self.losses.append(loss.detach().item())
        return loss


def _fit_steps(out, tag, strategy, opt_kind, ckpt_path=None, callbacks=()):
    from lightning.pytorch import Trainer

    module = _StepBatchModule(str(out), opt_kind=opt_kind, tag=tag)
    Trainer(strategy=strategy, callbacks=list(callbacks),
            **trainer_kwargs(devices=2, max_steps=6, limit_train_batches=3, enable_checkpointing=True)).fit(
        module, ckpt_path=ckpt_path)
    return load_rank_files(str(out), tag, "train", 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero0_fork", "zero1_fork"])
def test_trainer_resume_in_the_compressed_phase_is_exact(tmp_path, strategy):
    """trainer.fit(ckpt_path=<epoch-end directory>) with Lightning's defaults, saved at step 3 of 6 with
    freeze_step=2 (the error buffers and the frozen variance are live): the three resumed steps' losses and
    the final weights equal the uninterrupted run's bit for bit, on both ranks."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpts = tmp_path / "ckpts"
    whole = _fit_steps(tmp_path, "whole_", strategy, "onebit:2",
                       callbacks=[ModelCheckpoint(dirpath=ckpts, filename="{epoch}", save_top_k=-1)])
    resumed = _fit_steps(tmp_path, "resumed_", strategy, "onebit:2", ckpt_path=str(ckpts / "epoch=0.ckpt"))
    for w, r in zip(whole, resumed):
        assert r["global_step"] == w["global_step"] == 6
        assert r["losses"] == w["losses"][3:]
        for name, v in w["params"].items():
            assert torch.equal(r["params"][name], v), name
