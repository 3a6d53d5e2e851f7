"""ZeroPipelineStrategy(pipeline_parallel_size=2) under a real Trainer (fork launcher, gloo) on a tiny HF GPT-2.

Reference: the uncut model trained in this process (tests/test_pipeline.py's model, loss and AdamW) on
the batches the ranks saw (Lightning's training sampler shuffles; both stages must see the same batch: the
sampler splits by data-parallel rank only), each batch cut into the same M micro-batches whose gradients are summed, accumulation 2,
``clip_grad_norm_``, and a LambdaLR stepped per optimizer step. Per-step losses and final weights at rtol
1e-5. One epoch is 4 batches (2 optimizer steps); the checkpoint written at its end resumes into a second
epoch, which must continue as the uninterrupted reference does.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.pipeline_dir import consolidate_pipeline_checkpoint, read_manifest
from lightning_zero.engine.pipeline_split import split_gpt2
from lightning_zero.lightning.pipeline_strategy import ZeroPipelineStrategy
from tests.test_pipeline import ACCUM, ATOL, BATCH, CLIP, M, RTOL, _batch, _loss, _model, _optimizer

BATCHES = 4  # per epoch: 2 optimizer steps
VAL = 90  # the validation batch: _batch(VAL)


def _lr_lambda(step):
    return 1.0 / (1 + step)


class Rows(Dataset):
    """Row i % BATCH of ``_batch(i // BATCH)``."""

    def __len__(self):
        return BATCHES * BATCH

    def __getitem__(self, i):
        return _batch(i // BATCH)[i % BATCH]


class PipeGPT2(pl.LightningModule):
    def __init__(self, out: str, tag: str, batch_size: int = BATCH) -> None:
        super().__init__()
        self.out, self.tag, self.batch_size = out, tag, batch_size
        self.stage = None
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []
        self.val_losses: list[float] = []

    def setup(self, stage):
        torch.set_num_threads(1)  # forked ranks: see tests/lightning_models.py

    def configure_model(self):
        if self.stage is None:
            s = self.trainer.strategy
            self.stage = split_gpt2(_model(), s.pipeline_parallel_size, s.pipeline_stage_index)

    def forward(self, x):
        return self.stage(x)

    def pipeline_loss(self, output, target):
        return _loss(output, target)

    def training_step(self, batch, batch_idx):
        raise AssertionError("the pipeline strategy runs the schedule instead")

    def configure_optimizers(self):
        opt = _optimizer(self.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def validation_step(self, batch, batch_idx):
        raise AssertionError("the pipeline strategy runs the forward pipeline instead")

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader([row for row in _batch(VAL)], batch_size=self.batch_size, shuffle=False)

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


def _reference(batches):
    """Single process, the uncut model: what the pipeline computes over ``batches``, per batch a tensor or a
    list of the D replicas' parts (each cut into M micro-batches: as DDP over D ranks, accumulating M)."""
    model = _model()
    opt = _optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    losses, val = [], []

    def validate():
        model.eval()
        with torch.no_grad():
            val.append(_loss(model(_batch(VAL)).logits, _batch(VAL)).item())
        model.train()

    validate()  # the sanity check
    for call, parts in enumerate(batches):
        parts, total = parts if isinstance(parts, list) else [parts], 0.0
        chunks = [c for part in parts for c in part.chunk(M)]
        for chunk in chunks:
            loss = _loss(model(chunk).logits, chunk)
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


def _fit(out, tag, schedule, epochs, ckpt_path=None, callbacks=(), stage=None, devices=2):
    stage = stage if stage is not None else (2 if schedule == "1f1b" else 1)
    strategy = ZeroPipelineStrategy(stage=stage, start_method="fork", bucket_mb=0.01,
                                    pipeline_parallel_size=2, pipeline_microbatches=M, pipeline_schedule=schedule)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
                      accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, logger=False,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=1, limit_val_batches=1,
                      callbacks=list(callbacks))
    trainer.fit(PipeGPT2(str(out), tag, BATCH * 2 // devices), ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out, f"{tag}rank{r}.pt")) for r in range(devices)]


def _check(results, ref_losses, ref_val, ref_sd, what):
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


@pytest.mark.timeout(240)
def test_p2_trainer_matches_single_process_and_resumes(tmp_path):
    ckpt = tmp_path / "epoch0.ckpt"
    first = _fit(tmp_path, "a_", "1f1b", 1, callbacks=[SaveAtEpochEnd(str(ckpt))])
    seen = first[0]["batches"]
    assert len(seen) == BATCHES and all(b.shape[0] == BATCH for b in seen)  # the whole batch on both stages
    mid_losses, mid_val, mid_sd = _reference(seen)
    _check(first, mid_losses, mid_val, mid_sd, "1f1b, zero2")
    assert all(r["step"] == BATCHES // ACCUM and r["lr"] == pytest.approx(1e-3 * _lr_lambda(2)) for r in first)
    # the directory consolidates into the model's own state dict
    saved = consolidate_pipeline_checkpoint(str(ckpt))
    assert set(saved) == set(mid_sd) and all(torch.allclose(saved[k], mid_sd[k], rtol=RTOL, atol=ATOL)
                                             for k in mid_sd)
    # a second epoch from the checkpoint continues as the uninterrupted run
    resumed = _fit(tmp_path, "b_", "1f1b", 2, ckpt_path=str(ckpt))
    ref_losses, ref_val, ref_sd = _reference(seen + resumed[0]["batches"])
    # (its sanity check validates the loaded weights)
    _check(resumed, ref_losses[BATCHES:], ref_val[1:], ref_sd, "resumed")
    assert all(r["step"] == 2 * BATCHES // ACCUM for r in resumed)
    # GPipe at ZeRO-1: the same run
    gpipe = _fit(tmp_path, "c_", "gpipe", 1)
    assert all(torch.equal(a, b) for a, b in zip(gpipe[0]["batches"], seen))
    _check(gpipe, mid_losses, mid_val, mid_sd, "gpipe, zero1")


def test_bad_pipeline_settings_get_one_clear_error():
    assert type(ZeroPipelineStrategy(stage=1, pipeline_parallel_size=2)) is ZeroPipelineStrategy
    assert type(ZeroStrategy(stage=1)) is ZeroStrategy
    with pytest.raises(ValueError, match="Allowed: stage=0, 1 or 2"):
        ZeroPipelineStrategy(stage=3, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="Unknown pipeline_schedule 'zigzag'. Allowed: 1f1b, gpipe, interleaved"):
        ZeroPipelineStrategy(pipeline_parallel_size=2, pipeline_schedule="zigzag")
    with pytest.raises(ValueError, match="pipeline_microbatches must be an int >= 1"):
        ZeroPipelineStrategy(pipeline_parallel_size=2, pipeline_microbatches=0)
    # the plain ZeroStrategy has no pipeline: its options there are one clear error naming the class that has
    for kwargs in (dict(pipeline_parallel_size=2), dict(pipeline_microbatches=4)):
        with pytest.raises(TypeError, match=r"ZeroStrategy got unknown argument\(s\) pipeline_.* configure pipeline "
                                            r"parallelism: ZeroPipelineStrategy\(pipeline_parallel_size=P, ...\)"):
            ZeroStrategy(**kwargs)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int >= 1"):
        ZeroPipelineStrategy(pipeline_parallel_size=None)
    with pytest.raises(ValueError, match="pipeline_chunks=2 .* Allowed: pipeline_schedule='interleaved'"):
        ZeroPipelineStrategy(pipeline_parallel_size=2, pipeline_chunks=2)
    assert ZeroPipelineStrategy(pipeline_parallel_size=2, pipeline_schedule="interleaved").pipeline_chunks == 2
    with pytest.raises(ValueError, match="does not divide the world of 2 rank.*Allowed: 1, 2"):
        Trainer(strategy=ZeroPipelineStrategy(pipeline_parallel_size=3, start_method="fork"), accelerator="cpu",
                devices=2, logger=False)
    # what it inherits and cannot run is refused, not ignored
    with pytest.raises(ValueError, match=r"memory_summary=True is not available with pipeline_parallel_size.*"
                                         r"Allowed: memory_summary=False"):
        ZeroPipelineStrategy(pipeline_parallel_size=2, memory_summary=True)
    with pytest.raises(ValueError, match=r"load_weights_from=.* is not available with pipeline_parallel_size.*"
                                         r"Allowed: load_weights_from=None"):
        ZeroPipelineStrategy(pipeline_parallel_size=2, load_weights_from=str(Path(__file__).parent))


@pytest.mark.timeout(240)
def test_p2_dp2_zero1_matches_and_resumes_at_dp1(tmp_path):
    ckpt = tmp_path / "epoch0.ckpt"  # ModelCheckpoint writes it and last.ckpt: both pipeline directories
    first = _fit(tmp_path, "d_", "1f1b", 1, callbacks=[ModelCheckpoint(tmp_path, "epoch0", save_last=True)],
                 stage=1, devices=4)
    assert all(read_manifest(tmp_path / n)["data_parallel_size"] == 2 for n in ("epoch0.ckpt", "last.ckpt"))
    seen = [[first[0]["batches"][b], first[1]["batches"][b]] for b in range(BATCHES)]  # replicas 0 and 1
    assert all(p.shape[0] == BATCH // 2 for parts in seen for p in parts)
    mid_losses, mid_val, mid_sd = _reference(seen)
    _check(first, mid_losses, mid_val, mid_sd, "P2 x DP2, zero1")
    # the P2 x DP2 directory consolidates into the uncut model's own state dict (the DDP run's weights)
    saved = consolidate_pipeline_checkpoint(str(ckpt))
    assert set(saved) == set(mid_sd) and all(torch.allclose(saved[k], mid_sd[k], rtol=RTOL, atol=ATOL)
                                             for k in mid_sd)
    # resumed from last.ckpt at P2 x DP1 and ZeRO-2 (each stage's DCP shards resharded from 2 ranks to 1)
    resumed = _fit(tmp_path, "e_", "1f1b", 2, ckpt_path=str(tmp_path / "last.ckpt"), stage=2, devices=2)
    ref_losses, ref_val, ref_sd = _reference(seen + resumed[0]["batches"])
    _check(resumed, ref_losses[BATCHES:], ref_val[1:], ref_sd, "resumed at DP1")
