"""The pipeline strategy's LightningModule on the tiny GPT-2, and the Trainer run's single-process reference.

The reference is the uncut model trained in one process on the batches the ranks saw, each cut into the same
M micro-batches whose gradients are summed, accumulation 2, ``clip_grad_norm_`` and a LambdaLR stepped per
optimizer step (tests/test_pipeline_lightning.py says why).
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_zero.engine.pipeline.split import split_gpt2
from tests.helpers.pipeline_gpt2 import ACCUM, ATOL, BATCH, CLIP, M, RTOL, global_batch, lm_loss, gpt2_model, adamw

BATCHES = 4  # per epoch: 2 optimizer steps
VAL = 90  # the validation batch: global_batch(VAL)


def lr_lambda(step):
    return 1.0 / (1 + step)


class Rows(Dataset):
    """Row i % BATCH of ``global_batch(i // BATCH)``."""

    def __len__(self):
        return BATCHES * BATCH

    def __getitem__(self, i):
        return global_batch(i // BATCH)[i % BATCH]


class PipeGPT2(pl.LightningModule):
    def __init__(self, out: str, tag: str, batch_size: int = BATCH) -> None:
        super().__init__()
        self.out, self.tag, self.batch_size = out, tag, batch_size
        self.stage = None
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []
        self.val_losses: list[float] = []

    def setup(self, stage):
        torch.set_num_threads(1)  # forked ranks: see tests/helpers/lightning_models.py

    def configure_model(self):
        if self.stage is None:
            s = self.trainer.strategy
            self.stage = split_gpt2(gpt2_model(), s.pipeline_parallel_size, s.pipeline_stage_index)

    def forward(self, x):
        return self.stage(x)

    def pipeline_loss(self, output, target):
        return lm_loss(output, target)

    def training_step(self, batch, batch_idx):
        raise AssertionError("the pipeline strategy runs the schedule instead")

    def configure_optimizers(self):
        opt = adamw(self.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def validation_step(self, batch, batch_idx):
        raise AssertionError("the pipeline strategy runs the forward pipeline instead")

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader([row for row in global_batch(VAL)], batch_size=self.batch_size, shuffle=False)

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_losses.append(float(outputs))

    def on_train_batch_start(self, batch, batch_idx):
        self.batches.append(batch.clone())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(self.trainer.strategy.last_loss))

    def on_train_end(self):
        pipe = self.trainer.strategy.pipe
        named = {sd["source_names"][k]: v for sd in pipe.state_dicts() for k, v in sd["model"].items()}
        torch.save({"losses": self.losses, "batches": self.batches, "val": self.val_losses, "named": named, "step": self.trainer.global_step,
                    "lr": self.trainer.optimizers[0].param_groups[0]["lr"]},
                   os.path.join(self.out, f"{self.tag}rank{self.global_rank}.pt"))


class SaveAtEpochEnd(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def trainer_reference(batches):
    """Single process, the uncut model: what the pipeline computes over ``batches``, per batch a tensor or a
    list of the D replicas' parts (each cut into M micro-batches: as DDP over D ranks, accumulating M)."""
    model = gpt2_model()
    opt = adamw(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    losses, val = [], []

    def validate():
        model.eval()
        with torch.no_grad():
            val.append(lm_loss(model(global_batch(VAL)).logits, global_batch(VAL)).item())
        model.train()

    validate()  # the sanity check
    for call, parts in enumerate(batches):
        parts, total = parts if isinstance(parts, list) else [parts], 0.0
        chunks = [c for part in parts for c in part.chunk(M)]
        for chunk in chunks:
            loss = lm_loss(model(chunk).logits, chunk)
            (loss / (len(chunks) * ACCUM)).backward()
            total += loss.item() / len(chunks)
        losses.append(total)
        if call % ACCUM == ACCUM - 1:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP  # the clip acts
            opt.step()
            opt.zero_grad()
            sched.step()
        if call % BATCHES == BATCHES - 1:
            validate()  # each epoch's end
    return losses, val, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_pipeline_fit(results, ref_losses, ref_val, ref_sd, what):
    merged, dp = {}, len(results) // 2
    for d in range(dp):  # the two stages of a replica read the same batch
        assert all(torch.equal(a, b) for a, b in zip(results[d]["batches"], results[d + dp]["batches"])), what
    for r, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref_losses, rel=RTOL), (what, r)
        assert res["val"] == pytest.approx(ref_val, rel=RTOL), (what, r)
        merged.update(res["named"])
    assert set(merged) == set(ref_sd), what  # the two stages together name the whole model
    bad = [k for k in ref_sd if not torch.allclose(merged[k], ref_sd[k], rtol=RTOL, atol=ATOL)]
    assert not bad, (what, bad)
