"""Background saves of pipeline checkpoints: P2 x DP2 (4 ranks), each stage's directory written over a gloo
stand-in of its data-parallel group and the manifest gathered over one of its pipeline group, in the
background thread; the directory is the synchronous save's and resumes exactly."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_zero.checkpoint.async_save import AsyncCheckpointer
from lightning_zero.checkpoint.pipeline_dir import load_pipeline_checkpoint, read_manifest, save_pipeline_checkpoint
from tests.helpers.dist_utils import run_distributed
from tests.helpers.pipeline_gpt2 import BATCH, CALLS, make_pipeline, named_state, run_calls as _run

SAVED_AT = 4


def _job(rank, world_size, path):
    pipe = make_pipeline(2, 2, "1f1b")
    _run(pipe, range(SAVED_AT))
    saver = AsyncCheckpointer()
    save_pipeline_checkpoint(pipe, os.path.join(path, "sync"))
    save_pipeline_checkpoint(pipe, os.path.join(path, "async"), saver=saver)
    uninterrupted = _run(pipe, range(SAVED_AT, CALLS))  # training moves on while the copy is written
    saver.close()
    out = {"uninterrupted": uninterrupted, "named": named_state(pipe)}
    for name in ("sync", "async"):
        resumed = make_pipeline(2, 2, "1f1b")
        load_pipeline_checkpoint(resumed, os.path.join(path, name))
        out[name] = _run(resumed, range(SAVED_AT, CALLS)), named_state(resumed)
    return out


@pytest.mark.timeout(240)
def test_pipeline_background_save_resumes_exactly(tmp_path):
    results = run_distributed(_job, 4, str(tmp_path))
    manifest = read_manifest(tmp_path / "async")
    assert (manifest["pipeline_parallel_size"], manifest["data_parallel_size"]) == (2, 2)
    assert sorted(os.listdir(tmp_path)) == ["async", "sync"]
    for r, res in enumerate(results):
        for name in ("sync", "async"):
            losses, named = res[name]
            assert losses == res["uninterrupted"], (r, name)
            for k, v in res["named"].items():
                assert torch.equal(named[k], v), (r, name, k)


def _fit(out, tag, async_save, epochs, ckpt_path=None, callbacks=()):
    from lightning.pytorch import Trainer

    from lightning_zero.lightning.pipeline_strategy import ZeroPipelineStrategy
    from tests.helpers.pipeline_gpt2 import ACCUM, CLIP, M
    from tests.helpers.pipeline_lightning import PipeGPT2

    strategy = ZeroPipelineStrategy(stage=2, start_method="fork", bucket_mb=0.01, pipeline_parallel_size=2,
                                    pipeline_microbatches=M, async_save=async_save)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, accumulate_grad_batches=ACCUM,
                      gradient_clip_val=CLIP, logger=False, enable_checkpointing=bool(callbacks),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=list(callbacks))
    trainer.fit(PipeGPT2(str(out), tag, BATCH), ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out, f"{tag}rank{r}.pt")) for r in range(2)]


@pytest.mark.timeout(300)
def test_pipeline_trainer_background_saves_equal_sync_saves(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero.checkpoint.pipeline_dir import consolidate_pipeline_checkpoint

    for kind, flag in (("sync", False), ("async", True)):
        _fit(tmp_path, f"{kind}_", flag, 1, callbacks=[ModelCheckpoint(tmp_path / kind, "epoch0", save_last=True)])
        assert sorted(os.listdir(tmp_path / kind)) == ["epoch0.ckpt", "last.ckpt"]
    for name in ("epoch0.ckpt", "last.ckpt"):
        a, b = (consolidate_pipeline_checkpoint(str(tmp_path / k / name)) for k in ("async", "sync"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name
    resumed = {k: _fit(tmp_path, f"{k}_res_", True, 2, ckpt_path=str(tmp_path / k / "last.ckpt"))
               for k in ("sync", "async")}
    for ra, rb in zip(resumed["async"], resumed["sync"]):
        assert ra["losses"] == rb["losses"]
