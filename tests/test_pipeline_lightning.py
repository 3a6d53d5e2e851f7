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

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.pipeline_dir import consolidate_pipeline_checkpoint, read_manifest
from lightning_zero.lightning.pipeline_strategy import ZeroPipelineStrategy
from tests.helpers.pipeline_gpt2 import ACCUM, ATOL, BATCH, CLIP, M, RTOL
from tests.helpers.pipeline_lightning import (BATCHES, PipeGPT2, SaveAtEpochEnd, lr_lambda as _lr_lambda,
    trainer_reference as _reference, check_pipeline_fit as _check)


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
    with pytest.raises(ValueError, match="Allowed stages with pipeline parallelism: 0, 1, 2"):
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
