"""Asynchronous saves at the engine level ([Note: asynchronous checkpoint saves]), on forked gloo ranks: the
background copy is the state of the step it was taken at whatever training does meanwhile (stages 0-3, CPU
offload, hybrid sharding); a write that fails on one rank is raised on every rank, the previous checkpoint
untouched and nothing half-visible; one save in flight."""

from __future__ import annotations

import os
import resource
import signal
import time
import warnings

import pytest
import torch

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero import checkpoint as ck
from lightning_zero.checkpoint.async_save import AsyncCheckpointer, SaveState
from tests.helpers.ckpt_files import assert_same_checkpoint
from tests.helpers.ckpt_models import make_tied, run_forked, train
from tests.helpers.models import make_optimizer

pytestmark = pytest.mark.timeout(240)

_LAYOUTS = {  # name -> (world size, ZeroConfig arguments)
    "zero0": (2, dict(stage=0)),
    "zero1": (2, dict(stage=1)),
    "zero2": (2, dict(stage=2)),
    "zero3": (2, dict(stage=3, unit_classes=["fc1", "fc2", "frozen"], persist_numel=0)),
    "zero2_offload": (2, dict(stage=2, offload_optimizer=True)),
    "zero3_offload": (2, dict(stage=3, offload_optimizer=True, offload_params=True, unit_classes=["fc1", "fc2"])),
    "hybrid_zero3": (4, dict(stage=3, shard_group_size=2, unit_classes=["fc1", "fc2"])),
    # masters and moments in scratch files: what the save reads from them is staged like the rest
    "zero3_nvme": (2, dict(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path="{base}_nvme",
                           unit_classes=["fc1", "fc2"])),
}


def _engine(cfg: dict, seed: int = 0):
    model = make_tied(seed)
    return model, ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(bucket_mb=0.0005, **cfg))


def _background_equals_sync(rank, world_size, cfg, base):
    cfg = {k: v.format(base=base) if k == "nvme_path" else v for k, v in cfg.items()}
    if "nvme_path" in cfg:
        os.makedirs(cfg["nvme_path"], exist_ok=True)
    model, engine = _engine(cfg)
    saver = AsyncCheckpointer()
    train(model, engine, rank, world_size, range(3))
    ck.save_engine_checkpoint(f"{base}/sync", model, engine, {"global_step": 3})
    ck.save_engine_checkpoint(f"{base}/async", model, engine, {"global_step": 3}, saver=saver)
    states = [saver.state]
    train(model, engine, rank, world_size, range(3, 6))  # the live masters move on while the copy is written
    saver.wait()
    states.append(saver.state)
    # the next save waits for none (the last is complete) and a second, while one is in flight, for the first:
    # told once (any wait counts here), on rank 0
    ck.save_engine_checkpoint(f"{base}/async6", model, engine, {"global_step": 6}, saver=saver)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        saver.slow_wait_s = 0.0
        ck.save_engine_checkpoint(f"{base}/async6b", model, engine, {"global_step": 6}, saver=saver)
        ck.save_engine_checkpoint(f"{base}/async6c", model, engine, {"global_step": 6}, saver=saver)
    told = [str(w.message) for w in seen if "waited" in str(w.message)]
    saver.close()
    ck.save_engine_checkpoint(f"{base}/sync6", model, engine, {"global_step": 6})
    return {"states": states, "records": [(r.written_s is not None, r.error, r.bytes_staged) for r in saver.records],
            "told": told}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_background_save_is_the_state_of_its_step(tmp_path, layout):
    world_size, cfg = _LAYOUTS[layout]
    res = run_forked(_background_equals_sync, world_size, cfg, str(tmp_path))
    for r in res:
        assert r["states"][0] in (SaveState.WRITING, SaveState.IDLE) and r["states"][1] is SaveState.IDLE
        assert all(done and err is None and nbytes > 0 for done, err, nbytes in r["records"])
    assert len(res[0]["told"]) == 1 and "saves are asked for faster than they are written" in res[0]["told"][0]
    assert all(r["told"] == [] for r in res[1:])
    assert sorted(os.listdir(tmp_path)) == ["async", "async6", "async6b", "async6c", "sync", "sync6"]
    assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")
    assert_same_checkpoint(tmp_path / "async6", tmp_path / "sync6")
    assert_same_checkpoint(tmp_path / "async6b", tmp_path / "sync6")


def _failing_rank(rank, world_size, base):
    model, engine = _engine(dict(stage=2))
    saver = AsyncCheckpointer()
    train(model, engine, rank, world_size, range(2))
    ck.save_engine_checkpoint(f"{base}/ckpt", model, engine, {"global_step": 2}, saver=saver)
    saver.wait()
    train(model, engine, rank, world_size, range(2, 4))
    if rank == 1:  # this rank's disk is full: its files may not grow past 1 KiB (EFBIG, as ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    ck.save_engine_checkpoint(f"{base}/ckpt", model, engine, {"global_step": 4}, saver=saver)
    train(model, engine, rank, world_size, range(4, 5))  # training goes on while the write fails
    while saver.state is SaveState.WRITING:
        time.sleep(0.01)
    state = saver.state
    try:
        saver.raise_if_failed()
        raised = None
    except ck.CheckpointWriteError as err:
        raised = str(err)
    saver.raise_if_failed()  # reported once
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    torch.distributed.barrier()
    listing = sorted(os.listdir(base))
    step = ck.read_meta(f"{base}/ckpt")["global_step"]
    ck.save_engine_checkpoint(f"{base}/ckpt", model, engine, {"global_step": 5}, saver=saver)  # the next one works
    saver.close()
    return {"state": state, "raised": raised, "listing": listing, "step": step,
            "after": ck.read_meta(f"{base}/ckpt")["global_step"]}


def test_a_write_failing_on_one_rank_is_raised_on_every_rank(tmp_path):
    res = run_forked(_failing_rank, 2, str(tmp_path))
    for r in res:
        assert r["state"] is SaveState.FAILED
        assert r["raised"] is not None and "rank 1" in r["raised"] and "File too large" in r["raised"], r["raised"]
        assert "background checkpoint save" in r["raised"] and "ckpt" in r["raised"]
        assert r["listing"] == ["ckpt"], "nothing half-visible, no temporary left"
        assert r["step"] == 2, "the previous checkpoint is untouched"
        assert r["after"] == 5


def test_after_commit_runs_only_after_a_complete_save(tmp_path):
    model, engine = _engine(dict(stage=0))
    saver, ran = AsyncCheckpointer(), []
    saver.after_commit(lambda: ran.append("idle"))  # nothing in flight: at once
    assert ran == ["idle"]
    ck.save_engine_checkpoint(tmp_path / "a", model, engine, {}, saver=saver)
    saver.after_commit(lambda: ran.append(ck.is_checkpoint_dir(tmp_path / "a")))
    saver.close()
    assert ran == ["idle", True]
    (tmp_path / "b").write_text("a file where the checkpoint's directory must go")
    ck.save_engine_checkpoint(tmp_path / "b" / "c", model, engine, {}, saver=saver)
    saver.after_commit(lambda: ran.append("after a failure"))
    with pytest.raises(ck.CheckpointWriteError, match="background checkpoint save of .*c.* failed"):
        saver.wait()
    assert ran == ["idle", True], "never after a failed save"
    assert saver.summary().startswith("lightning_zero: 2 background checkpoint save(s); training stood still ")


def _to_url(rank, world_size, url, base):
    model, engine = _engine(dict(stage=3, unit_classes=["fc1", "fc2"]))
    saver = AsyncCheckpointer()
    train(model, engine, rank, world_size, range(2))
    ck.save_engine_checkpoint(f"{base}/sync", model, engine, {"global_step": 2})
    ck.save_engine_checkpoint(f"{url}/async", model, engine, {"global_step": 2}, saver=saver)
    train(model, engine, rank, world_size, range(2, 4))
    saver.close()
    fresh, fresh_engine = _engine(dict(stage=3, unit_classes=["fc1", "fc2"]), seed=5)
    meta = ck.load_checkpoint_dir(f"{url}/async", fresh, fresh_engine)
    train(fresh, fresh_engine, rank, world_size, range(2, 4))
    with engine.gathered_params(), fresh_engine.gathered_params():
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    return meta["global_step"], same


def test_background_save_to_an_fsspec_url_resumes_exactly(tmp_path):
    """The background thread uploads through the remote commit (location.py) over its own group."""
    for step, same in run_forked(_to_url, 2, f"file://{tmp_path}/remote", str(tmp_path)):
        assert step == 2 and same
    assert sorted(os.listdir(tmp_path / "remote")) == ["async"]
    assert_same_checkpoint(tmp_path / "remote" / "async", tmp_path / "sync")
