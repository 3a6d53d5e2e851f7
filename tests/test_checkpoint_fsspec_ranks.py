"""Checkpoint directories at ``file://`` URLs on 2 ranks (fsspec's LocalFileSystem, so the remote path runs
across processes; a LocalFileSystem under a protocol of its own where Lightning itself rewrites ``file://``):
stage 3 through the Trainer with ModelCheckpoint's top-k removal and ``ckpt_path="last"``,
and a rank failing mid-upload, raised on every rank with the previous copy still loadable
([Note: checkpoints at fsspec locations] in lightning_zero/checkpoint/location.py)."""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_zero  # noqa: F401
from lightning_zero import ZeroConfig, ZeroEngine, ZeroStrategy
from lightning_zero import checkpoint as ck
from lightning_zero.checkpoint import location
from lightning_zero.checkpoint.consolidate import consolidate
from tests.helpers.ckpt_models import TiedParityModule, make_tied, run_forked, train
from tests.helpers.lightning_models import load_rank_files, trainer_kwargs
from tests.helpers.models import make_optimizer

pytestmark = pytest.mark.timeout(600)


class _Bucket(LocalFileSystem):
    """A local directory under a protocol of its own, registered as any fsspec plugin registers: Lightning
    sees a remote location (its ModelCheckpoint turns a ``file://`` dirpath into a local path relative to the
    working directory), the checkpoints go through the remote path, the test reads the files on disk."""

    protocol = ("lzbucket",)
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path[len("lzbucket://"):] if path.startswith("lzbucket://") else path)


fsspec.register_implementation("lzbucket", _Bucket, clobber=True)


@pytest.fixture(autouse=True)
def staging(tmp_path, monkeypatch):
    monkeypatch.setenv(location.STAGING_ENV, str(tmp_path / "staging"))


def _callback(url):
    return ModelCheckpoint(dirpath=url, filename="{step}", monitor="step", mode="max", save_top_k=1,
                           save_last=True, every_n_epochs=1)


def _fit(out, tag, steps, ckpt_path=None, callbacks=()):
    strategy = ZeroStrategy(stage=3, start_method="fork")
    Trainer(strategy=strategy, callbacks=list(callbacks), **trainer_kwargs(
        devices=2, max_steps=steps, limit_train_batches=3, enable_checkpointing=bool(callbacks),
        default_root_dir=out)).fit(
        TiedParityModule(out, tag=tag), ckpt_path=ckpt_path)
    return load_rank_files(out, tag, "train", 2)


def test_stage3_trainer_top_k_and_last_through_a_registered_protocol(tmp_path):
    out, url = str(tmp_path), f"lzbucket://{tmp_path}/ckpts"
    full = _fit(out, "full_", 6, callbacks=[_callback(url)])
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert names == ["last.ckpt", "step=6.ckpt"], f"top-k removed step=3.ckpt through the URL: {names}"
    assert all(ck.is_checkpoint_dir(tmp_path / "ckpts" / n) for n in names)
    # the saved weights are the uninterrupted run's, bit for bit
    consolidate(tmp_path / "ckpts" / "step=6.ckpt", tmp_path / "w.pt")
    for k, v in torch.load(tmp_path / "w.pt").items():
        assert torch.equal(v, full[0]["params"][k]), k

    # resumed through Lightning's "last" search of the URL directory, and from the URL named explicitly:
    # the same run bit for bit, on both ranks
    from_url = _fit(out, "url_", 9, ckpt_path=f"file://{tmp_path}/ckpts/step=6.ckpt")  # a file:// URL too
    from_last = _fit(out, "last_", 9, ckpt_path="last", callbacks=[_callback(url)])  # replaces last.ckpt
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["last.ckpt", "step=9.ckpt"]
    for a, b in zip(from_last, from_url):
        assert a["global_step"] == b["global_step"] == 9 and len(a["losses"]) == 3
        assert a["losses"] == b["losses"]
        for k, v in b["params"].items():
            assert torch.equal(a["params"][k], v), k


def _failing_upload_job(rank, world_size, url):
    torch.manual_seed(0)
    model = make_tied()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=3))
    train(model, engine, rank, world_size, range(2))
    ck.save_engine_checkpoint(url, model, engine, {"global_step": 2})
    with engine.gathered_params():
        first = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train(model, engine, rank, world_size, range(2, 3))
    fs = fsspec.filesystem("file")
    real = type(fs).put_file

    def put_file(self, lpath, rpath, *a, **kw):
        if rank == 1 and str(rpath).endswith(".distcp"):
            raise OSError("simulated network failure mid-upload on rank 1")
        return real(self, lpath, rpath, *a, **kw)

    type(fs).put_file = put_file
    try:
        ck.save_engine_checkpoint(url, model, engine, {"global_step": 3})
        error = None
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        error = f"{type(err).__name__}: {err}"
    finally:
        type(fs).put_file = real
    model2 = make_tied(5)
    engine2 = ZeroEngine(model2, make_optimizer(model2, "adamw"), ZeroConfig(stage=3))
    real_get, downloads = type(fs).get_file, []
    type(fs).get_file = lambda self, rpath, *a, **kw: (downloads.append(rpath), real_get(self, rpath, *a, **kw))[1]
    try:
        meta = ck.load_checkpoint_dir(url, model2, engine2)
    finally:
        type(fs).get_file = real_get
    with engine2.gathered_params():
        same = all(torch.equal(v, model2.state_dict()[k]) for k, v in first.items())
    return {"error": error, "step": meta["global_step"], "same": same, "downloads": len(downloads)}


def test_a_rank_failing_mid_upload_is_raised_on_every_rank_and_the_previous_copy_loads(tmp_path):
    url = f"file://{tmp_path}/x.ckpt"
    res = run_forked(_failing_upload_job, 2, url)
    assert "mid-upload on rank 1" in res[1]["error"]
    assert res[0]["error"].startswith("RuntimeError") and "rank 1 failed while uploading" in res[0]["error"]
    assert not (tmp_path / "x.ckpt" / ck.INFO_FILE).exists(), "nothing of the failed save is visible"
    assert ck.is_checkpoint_dir(tmp_path / "x.zero-old.ckpt")
    assert all(r["step"] == 2 and r["same"] for r in res), res
    # one download per host: the first rank fetched every file, the other read the same local copy
    assert res[0]["downloads"] == len(os.listdir(tmp_path / "x.zero-old.ckpt")) and res[1]["downloads"] == 0


def _gan_job(rank, world_size, url):
    from lightning_zero import ZeroFabricStrategy
    from tests.helpers.fabric_pair import pair_state, pair_steps, setup_pair

    fabric, g, d, opt_g, opt_d = setup_pair(2)
    pair_steps(fabric, g, d, opt_g, opt_d, rank, 0, 2)
    fabric.save(url, {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": 2})
    after = pair_steps(fabric, g, d, opt_g, opt_d, rank, 2, 2)
    uninterrupted = pair_state(fabric, g, d)
    fabric.strategy.teardown()
    fabric, g, d, opt_g, opt_d = setup_pair(ZeroFabricStrategy(stage=3))
    state = {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": 0}
    fabric.load(url, state)
    resumed = pair_steps(fabric, g, d, opt_g, opt_d, rank, state["step"], 2)
    same = all(torch.equal(v, uninterrupted[k]) for k, v in pair_state(fabric, g, d).items())
    fabric.strategy.teardown()
    return {"after": after, "resumed": resumed, "same": same}


def test_fabric_two_models_in_one_directory_at_a_file_url(tmp_path):
    """fabric.save of a GAN (one directory holding a sharded directory per model, checkpoint/models_dir.py)
    at a file:// URL from 2 ranks, loaded at stage 3: the run continues as the uninterrupted one."""
    res = run_forked(_gan_job, 2, f"file://{tmp_path}/gan.ckpt")
    assert sorted(os.listdir(tmp_path / "gan.ckpt" / "models")) == ["d", "g"]  # the state's keys
    for r in res:
        assert r["resumed"] == r["after"] and r["same"]


def _pipeline_job(rank, world_size, url):
    from lightning_zero.checkpoint.pipeline_dir import load_pipeline_checkpoint, save_pipeline_checkpoint
    from tests.helpers.pipeline_gpt2 import CALLS, make_pipeline, run_calls as _run

    SAVED_AT = 4  # two optimizer steps

    pipe = make_pipeline(2, 1, "1f1b")  # ZeRO-1, P2 x DP1
    _run(pipe, range(SAVED_AT))
    save_pipeline_checkpoint(pipe, url)
    uninterrupted = _run(pipe, range(SAVED_AT, CALLS))
    resumed = make_pipeline(2, 2, "1f1b")  # the same shape at ZeRO-2, from the URL
    load_pipeline_checkpoint(resumed, url)
    return {"uninterrupted": uninterrupted, "resumed": _run(resumed, range(SAVED_AT, CALLS))}


def test_pipeline_checkpoint_at_a_file_url_resumes(tmp_path):
    """A pipeline checkpoint (a sharded directory per stage, each written by another rank) at a file:// URL."""
    res = run_forked(_pipeline_job, 2, f"file://{tmp_path}/pipe")
    assert ck.is_checkpoint_dir(tmp_path / "pipe")
    for r in res:
        assert r["resumed"] == r["uninterrupted"]
