"""LightningModules and data for the Lightning-level ZeRO tests (importable, so spawn would work too)."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_zero.engine.comm import collectives
from tests.helpers.models import VOCAB, loss_fn, make_model, make_optimizer


class TokenDataset(Dataset):
    """Deterministic map-style data: item i is a fixed (seq,) token row; the index rides along."""

    def __init__(self, length: int = 256, seq: int = 5) -> None:
        self.length, self.seq = length, seq

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(7919 * i + 13)
        return torch.randint(0, VOCAB, (self.seq,), generator=g), i


def uses_sometimes(rank: int, step: int) -> bool:
    return rank == 0 and step % 2 == 0


class ParityModule(pl.LightningModule):
    """ParityNet + AdamW (two param groups) or SGD-momentum, LambdaLR stepped per optimizer step.

    Every rank writes ``{out}/{tag}rank{r}.pt`` at the end of training: per-micro-batch losses, the final
    full parameters, and the number of collectives (lightning_zero's counter) issued in each batch.
    """

    def __init__(self, out: str, opt_kind: str = "adamw", batch_size: int = 4, tag: str = "",
                 n_optimizers: int = 1, save_opt_state_on_start: bool = False) -> None:
        super().__init__()
        self.net = make_model()
        self.out, self.opt_kind, self.batch_size, self.tag = out, opt_kind, batch_size, tag
        self.n_optimizers = n_optimizers
        if n_optimizers > 1:  # Lightning itself refuses several optimizers under automatic optimization
            self.automatic_optimization = False
        self.save_opt_state_on_start = save_opt_state_on_start
        self.losses: list[float] = []
        self.batch_comm: list[tuple[int, int]] = []  # (batch_idx, collectives issued during the batch)
        self.seen: dict[str, list[int]] = {"train": [], "val": [], "test": [], "predict": []}
        self._calls_before = 0

    def setup(self, stage: str) -> None:
        # Runs in each launched rank before any compute. A forked child inherits the parent's OpenMP/MKL
        # thread-pool bookkeeping but not its threads: if the pytest process already ran a threaded op and
        # the child uses more than one thread (Lightning gives a devices=1 rank every core), the first
        # threaded op (e.g. MKL's tanh) waits forever on a libgomp barrier. One thread per rank avoids that.
        torch.set_num_threads(1)

    # -- data -----------------------------------------------------------------------------------------
    def train_dataloader(self):
        return DataLoader(TokenDataset(), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader(TokenDataset(20), batch_size=3, shuffle=False)

    def test_dataloader(self):
        return DataLoader(TokenDataset(22), batch_size=3, shuffle=False)

    def predict_dataloader(self):
        return DataLoader(TokenDataset(18), batch_size=3, shuffle=False)

    # -- steps ------------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen["train"].extend(idx.tolist())
        loss = loss_fn(self.net, tokens, uses_sometimes(self.global_rank, self.global_step))
        self.losses.append(loss.detach().item())
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen["val"].extend(idx.tolist())
        return loss_fn(self.net, tokens, False)

    def test_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen["test"].extend(idx.tolist())
        return loss_fn(self.net, tokens, False)

    def predict_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen["predict"].extend(idx.tolist())
        return self.net(tokens)

    def configure_optimizers(self):
        opt = make_optimizer(self.net, self.opt_kind)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        if self.n_optimizers > 1:
            extra = [torch.optim.SGD(self.net.parameters(), lr=0.1) for _ in range(self.n_optimizers - 1)]
            return [opt, *extra]
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- recording ---------------------------------------------------------------------------------------
    def on_train_batch_start(self, batch, batch_idx):
        self._calls_before = collectives.stats.total_calls

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_comm.append((batch_idx, collectives.stats.total_calls - self._calls_before))

    def on_train_start(self):
        if not self.save_opt_state_on_start:
            return
        strategy = self.trainer.strategy
        engine = getattr(strategy, "engine", None)
        opt_state = engine.optimizer_state_dict() if engine is not None else self.trainer.optimizers[0].state_dict()
        torch.save(
            {"params": _params(self), "opt_state": opt_state, "global_step": self.global_step},
            os.path.join(self.out, f"{self.tag}start_rank{self.global_rank}.pt"),
        )

    def on_train_end(self):
        self._dump("train")

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            self._dump("val")

    def on_test_end(self):
        self._dump("test")

    def on_predict_end(self):
        self._dump("predict")

    def _dump(self, what: str) -> None:
        torch.save(
            {
                "losses": list(self.losses),
                "params": _params(self),
                "batch_comm": list(self.batch_comm),
                "seen": dict(self.seen),
                "global_step": self.global_step,
                "world_size": self.trainer.world_size,
                "has_engine": getattr(self.trainer.strategy, "engine", None) is not None,
                "sampler_kwargs": getattr(self.trainer.strategy, "distributed_sampler_kwargs", None),
            },
            os.path.join(self.out, f"{self.tag}{what}_rank{self.global_rank}.pt"),
        )


def _params(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    strategy = module._trainer.strategy if module._trainer is not None else None
    gathered = getattr(strategy, "gathered_params", None)  # ZeRO-3: parameters are whole only in there
    with gathered() if gathered is not None else contextlib.nullcontext():
        return {k: v.detach().clone().float() for k, v in module.state_dict().items()}


def load_rank_files(out: str, tag: str, what: str, world_size: int) -> list[dict]:
    res = []
    for r in range(world_size):
        path = os.path.join(out, f"{tag}{what}_rank{r}.pt")
        if not os.path.exists(path):
            raise AssertionError(f"rank {r} wrote no {path}")
        res.append(torch.load(path, weights_only=False))
    return res


def trainer_kwargs(devices: int = 2, max_steps: int = 5, accum: int = 1, clip: Optional[float] = None, **kw):
    base = dict(
        accelerator="cpu", devices=devices, max_steps=max_steps, accumulate_grad_batches=accum,
        gradient_clip_val=clip, gradient_clip_algorithm="norm" if clip is not None else None,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    base.update(kw)
    return base
