"""0/1 Adam runs for tests/test_zoadam_resume.py: the same 2-rank training under the Trainer and under Fabric, a
checkpoint after every step, each step's per-rank weights recorded; and a script a test runs as a user would
and SIGKILLs after a checkpoint:

    python -m tests.helpers.zoadam_runs {trainer,fabric} OUT [--ckpt-dir D] [--resume PATH] [--kill-at STEP]

ParityNet with ``zeroone:2`` (tests/helpers/models.py): two variance steps, one 1-bit gradient step, then
local steps with synchronizations at steps 4, 5, 6, 8, 12 (the interval 1, 1, 2, 2, 4): steps 7, 9, 10 and
11 end between synchronizations. Every batch is drawn from (step, rank), so a resumed run sees the batches
the uninterrupted one saw whatever Lightning's loader replays.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Optional

import lightning.pytorch as pl
import torch

from tests.helpers.lightning_models import ParityModule, trainer_kwargs, uses_sometimes
from tests.helpers.models import batch as step_batch
from tests.helpers.models import loss_fn, make_model, make_optimizer

STEPS = 11
OPT = "zeroone:2"
LOCAL_STEPS = (7, 9, 10)  # checkpoints taken between synchronizations (see the docstring), before STEPS


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def kill_everything() -> None:
    """SIGKILL this process group: the launcher and every rank, no teardown, no atexit (a job killed hard)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


class StepModule(ParityModule):
    """Batches from (global_step, rank); records every step's weights and what each validation evaluated."""

    def __init__(self, out: str, tag: str = "") -> None:
        super().__init__(out, opt_kind=OPT, tag=tag)
        self.trace: dict[int, dict[str, torch.Tensor]] = {}  # global step -> this rank's weights after it
        self.val_seen: dict[int, dict[str, torch.Tensor]] = {}  # global step -> the weights a validation used

    def training_step(self, batch, batch_idx):
        micro = batch_idx % self.trainer.accumulate_grad_batches  # each micro-batch of a step its own batch
        loss = loss_fn(self.net, step_batch(self.global_step, self.global_rank, micro),
                       uses_sometimes(self.global_rank, self.global_step))
        self.losses.append(loss.detach().item())
        return loss

    def on_train_start(self):  # after a checkpoint load: what the run resumes from
        self.start = params_of(self.net)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.trace[self.global_step] = params_of(self.net)  # with accumulation: the boundary's overwrites

    def validation_step(self, batch, batch_idx):
        self.val_seen.setdefault(self.global_step, params_of(self.net))
        return super().validation_step(batch, batch_idx)

    def on_train_end(self):  # before the strategy's own on_train_end: this rank's weights as training left them
        torch.save({"losses": self.losses, "trace": self.trace, "val_seen": self.val_seen,
                    "params": params_of(self.net), "global_step": self.global_step, "start": self.start},
                   os.path.join(self.out, f"{self.tag}train_rank{self.global_rank}.pt"))


class KillAfter(pl.Callback):
    """SIGKILL the job when step ``step`` starts, i.e. right after the checkpoint of step ``step`` is complete
    (ModelCheckpoint saves, collectively, at the end of the batch before)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.is_global_zero:
            kill_everything()


def trainer_fit(out: str, tag: str, strategy: str = "zero0_fork", ckpt_dir: Optional[str] = None,
                ckpt_path: Optional[str] = None, kill_at: Optional[int] = None, precision: str = "32-true",
                validate: bool = False, accum: int = 1, devices: int = 2, **kw) -> StepModule:
    """One fit with Lightning's defaults besides the test's (checkpoint callbacks, validation); returns the
    module the Trainer hands back."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = StepModule(out, tag)
    callbacks: list = []
    if ckpt_dir is not None:  # every step, or (validate) at every validation's end, with the mean swapped in
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", save_top_k=-1,
                                         **({"save_on_train_epoch_end": False} if validate
                                            else {"every_n_train_steps": 1})))
    if kill_at is not None:
        callbacks.append(KillAfter(kill_at))
    extra = dict(limit_val_batches=1, val_check_interval=1) if validate else {}
    Trainer(strategy=strategy, precision=precision, callbacks=callbacks,
            **trainer_kwargs(devices=devices, max_steps=STEPS, limit_train_batches=4, accum=accum,
                             enable_checkpointing=ckpt_dir is not None, **extra, **kw)).fit(module, ckpt_path=ckpt_path)
    return module


def fabric_loop(rank: int, world: int, ckpt_dir: Optional[str] = None, resume: Optional[str] = None,
                kill_at: Optional[int] = None) -> dict:
    """The same training under Fabric (ZeroFabricStrategy(stage=0)), ``fabric.save`` after every step,
    ``fabric.load`` to resume."""
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=world, strategy=ZeroFabricStrategy(stage=0))
    fabric.launch()
    torch.set_num_threads(1)
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model, OPT))
    state = {"model": model, "optimizer": opt, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    losses, trace = [], {}
    for t in range(state["step"], STEPS):
        loss = loss_fn(model, step_batch(t, fabric.global_rank), uses_sometimes(fabric.global_rank, t))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        trace[t + 1] = params_of(model)
        if ckpt_dir is not None:
            state["step"] = t + 1
            fabric.save(os.path.join(ckpt_dir, f"step={t + 1}"), state)
        if kill_at == t + 1 and fabric.global_rank == 0:
            kill_everything()
    return {"losses": losses, "trace": trace, "params": params_of(model)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("frontend", choices=["trainer", "fabric"])
    ap.add_argument("out")
    ap.add_argument("--ckpt-dir")
    ap.add_argument("--resume")
    ap.add_argument("--kill-at", type=int)
    a = ap.parse_args()
    if a.frontend == "fabric":
        res = fabric_loop(int(os.environ.get("LOCAL_RANK", 0)), 2, a.ckpt_dir, a.resume, a.kill_at)
        torch.save(res, os.path.join(a.out, f"fabric_rank{os.environ.get('LOCAL_RANK', 0)}.pt"))
        return
    module = trainer_fit(a.out, "", strategy="zero0", ckpt_dir=a.ckpt_dir, ckpt_path=a.resume, kill_at=a.kill_at)
    torch.save(params_of(module.net), os.path.join(a.out, f"handed_back_rank{module.global_rank}.pt"))


if __name__ == "__main__":
    main()
