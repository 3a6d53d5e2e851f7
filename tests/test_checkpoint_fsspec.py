"""Checkpoint directories at fsspec URLs in one process (``memory://``, which is per-process): the Trainer's
save -> resume -> consolidate round trip, ``load_from_checkpoint``, Fabric, the engine-level save and load,
integrity checks on a remote copy, an interrupted remote save, and the command line with a URL on each side
([Note: checkpoints at fsspec locations] in lightning_zero/checkpoint/location.py)."""

from __future__ import annotations

import io
import re
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_zero  # noqa: F401  (wraps pl_load)
from lightning_zero import ZeroCheckpointIO, ZeroStrategy
from lightning_zero import checkpoint as ck
from lightning_zero.checkpoint import location
from lightning_zero.tools.cli import main as cli_main
from tests.helpers.ckpt_files import crc32, tied_engine
from tests.helpers.ckpt_models import TiedParityModule, train
from tests.helpers.lightning_models import load_rank_files, trainer_kwargs

pytestmark = pytest.mark.timeout(300)
FIT = dict(max_steps=6, limit_train_batches=3, enable_checkpointing=True)  # 2 epochs of 3 steps


@pytest.fixture
def mem():
    """A fresh ``memory://`` root, emptied afterwards: (url, filesystem, root path)."""
    root = f"/lz-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    yield f"memory://{root}", fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(autouse=True)
def staging(tmp_path, monkeypatch):
    """Local staging and downloads in this test's own directory (to see what is left there)."""
    monkeypatch.setenv(location.STAGING_ENV, str(tmp_path / "staging"))


def _no_local_copies_left() -> list[str]:
    return [p.name for p in location.staging_root().glob("lightning_zero-*")]


def test_urls_and_local_paths_are_told_apart():
    for url in ("memory://run/x", "file:///tmp/x", "s3://bucket/run1", "simplecache::s3://bucket/run1"):
        assert location.is_remote(url), url
    # pathlib collapsed the "//" of a URL that went through Path: still that URL
    assert location.as_url(Path("file:///tmp/x")) == "file:///tmp/x"
    assert location.as_url(Path("s3://bucket/run1")) == "s3://bucket/run1"
    for local in ("/tmp/x", "rel/x.ckpt", "C:/x", "C:\\x", "d:x", "epoch=0-step=3.ckpt", "notaproto:/x", Path("/a")):
        assert not location.is_remote(local), local


def _fit(out, tag, ckpt_path=None, callbacks=()):
    Trainer(strategy=ZeroStrategy(stage=2), callbacks=list(callbacks), default_root_dir=out,
            **trainer_kwargs(devices=1, **{**FIT, "enable_checkpointing": bool(callbacks)})).fit(
        TiedParityModule(out, tag=tag), ckpt_path=ckpt_path)
    return load_rank_files(out, tag, "train", 1)[0]


def test_trainer_save_resume_consolidate_round_trip_through_memory(tmp_path, mem):
    url, fs, root = mem
    out = str(tmp_path)
    every = dict(filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    full = _fit(out, "full_", callbacks=[ModelCheckpoint(dirpath=f"{url}/ckpts", **every),
                                         ModelCheckpoint(dirpath=tmp_path / "local", mode="max", **every)])
    assert sorted(p.rpartition("/")[2] for p in fs.ls(f"{root}/ckpts", detail=False)) == ["epoch=0.ckpt",
                                                                                       "epoch=1.ckpt"]
    assert fs.isfile(f"{root}/ckpts/epoch=0.ckpt/{ck.INFO_FILE}")

    # resumed from the URL: bit for bit the run resumed from the same save on local disk (losses and final
    # weights). Lightning's epoch-end resume is not the uninterrupted run's continuation, for its own
    # strategies too (the second step after it differs), so the local resume is the reference.
    resumed = _fit(out, "res_", ckpt_path=f"{url}/ckpts/epoch=0.ckpt")
    reference = _fit(out, "ref_", ckpt_path=str(tmp_path / "local" / "epoch=0.ckpt"))
    assert resumed["global_step"] == reference["global_step"] == full["global_step"] == 6
    assert resumed["losses"] == reference["losses"] and resumed["losses"][0] == full["losses"][3]
    for k, v in reference["params"].items():
        assert torch.equal(resumed["params"][k], v), k

    # another strategy (one device, no ZeRO) resumes through ZeroCheckpointIO: from the URL as from local disk
    plain = {}
    for tag, path in (("io_url_", f"{url}/ckpts/epoch=0.ckpt"), ("io_ref_", str(tmp_path / "local" / "epoch=0.ckpt"))):
        Trainer(plugins=[ZeroCheckpointIO()], default_root_dir=out, **trainer_kwargs(
            devices=1, **{**FIT, "enable_checkpointing": False})).fit(TiedParityModule(out, tag=tag), ckpt_path=path)
        plain[tag] = load_rank_files(out, tag, "train", 1)[0]
    assert plain["io_url_"]["global_step"] == 6 and plain["io_url_"]["losses"] == plain["io_ref_"]["losses"]

    # consolidated from the URL, to a local file and to a URL: the final weights
    assert cli_main(["consolidate", f"{url}/ckpts/epoch=1.ckpt", str(tmp_path / "w.pt"), "--quiet"]) == 0
    assert cli_main(["consolidate", f"{url}/ckpts/epoch=1.ckpt", f"{url}/out/w.safetensors", "--quiet"]) == 0
    from safetensors.torch import load as st_load

    for weights in (torch.load(tmp_path / "w.pt"), st_load(fs.cat(f"{root}/out/w.safetensors"))):
        for k, v in weights.items():
            assert torch.equal(v, full["params"][k]), k
    # LightningModule.load_from_checkpoint reads the URL (pl_load), weights only
    lit = TiedParityModule.load_from_checkpoint(f"{url}/ckpts/epoch=1.ckpt", out=out)
    for k, v in lit.state_dict().items():
        assert torch.equal(v.float(), full["params"][k]), k
    assert not [n for n in _no_local_copies_left() if "save" in n or "out" in n], "staging removed after upload"
    # the Trainer's copies (read across its restore hooks) are kept until the next fetch: one at most
    Trainer(strategy=ZeroStrategy(stage=2), default_root_dir=out, **trainer_kwargs(devices=1, limit_val_batches=1)
            ).validate(TiedParityModule(out, tag="val_"), ckpt_path=f"{url}/ckpts/epoch=1.ckpt")
    for k, v in load_rank_files(out, "val_", "val", 1)[0]["params"].items():
        assert torch.equal(v, full["params"][k]), k
    assert len([n for n in _no_local_copies_left() if "load" in n]) <= 1


def _trained(steps=2, seed=0):
    model, engine = tied_engine(seed)
    train(model, engine, 0, 1, range(steps))
    return model, engine


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_engine_save_and_load_at_a_url_and_the_same_integrity_errors(tmp_path, mem):
    url, fs, root = mem
    model, engine = _trained()
    ck.save_engine_checkpoint(f"{url}/a.ckpt", model, engine, {"global_step": 2})
    local = ck.save_engine_checkpoint(tmp_path / "a.ckpt", model, engine, {"global_step": 2})
    assert sorted(p.rpartition("/")[2] for p in fs.find(f"{root}/a.ckpt")) == sorted(
        p.name for p in local.iterdir())
    m2, e2 = tied_engine(1)
    assert ck.load_checkpoint_dir(f"{url}/a.ckpt", m2, e2)["global_step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(_weights(model).values(), _weights(m2).values()))

    # one byte of a shard changed, remotely and locally: the same error, before any tensor is read
    shard = next(p.name for p in local.iterdir() if p.suffix == ".distcp")
    for where in ("remote", "local"):
        if where == "remote":
            data = bytearray(fs.cat(f"{root}/a.ckpt/{shard}"))
            data[-1] ^= 0xFF
            fs.pipe(f"{root}/a.ckpt/{shard}", bytes(data))
        else:
            data = bytearray((local / shard).read_bytes())
            data[-1] ^= 0xFF
            (local / shard).write_bytes(bytes(data))
        with pytest.raises(ValueError, match=rf"Corrupt checkpoint .*a\.ckpt'?: {re.escape(shard)} is altered or "
                           rf"damaged: CRC-32 {crc32(bytes(data))}, the save wrote") as err:
            ck.load_checkpoint_dir(f"{url}/a.ckpt" if where == "remote" else local, *tied_engine(3))
        if where == "remote":  # the message names the local copy it checked; the note names the URL
            assert any(f"{url}/a.ckpt" in n for n in err.value.__notes__)
    assert not any("load" in n for n in _no_local_copies_left()), "the local copies are removed after the load"


def test_interrupted_remote_save_keeps_the_previous_copy_and_nothing_half_visible(mem, monkeypatch):
    url, fs, root = mem
    model, engine = _trained()
    ck.save_engine_checkpoint(f"{url}/x.ckpt", model, engine, {"global_step": 2})
    first = _weights(model)
    train(model, engine, 0, 1, range(2, 3))

    real = type(fs).put_file
    calls = []

    def failing_put(self, lpath, rpath, *a, **kw):
        calls.append(rpath)
        if rpath.endswith(".distcp"):
            raise OSError("simulated network failure mid-upload")
        return real(self, lpath, rpath, *a, **kw)

    monkeypatch.setattr(type(fs), "put_file", failing_put)
    with pytest.raises(OSError, match="mid-upload"):
        ck.save_engine_checkpoint(f"{url}/x.ckpt", model, engine, {"global_step": 3})
    monkeypatch.undo()
    assert not fs.exists(f"{root}/x.ckpt"), "nothing of the failed save is visible or left behind"
    assert fs.isfile(f"{root}/x.zero-old.ckpt/{ck.INFO_FILE}"), "the previous copy stays complete"
    m2, e2 = tied_engine(1)
    with pytest.warns(UserWarning, match="interrupted"):
        assert ck.load_checkpoint_dir(f"{url}/x.ckpt", m2, e2)["global_step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(first.values(), _weights(m2).values()))
    assert lightning_zero.lightning.lightning_io.is_zero_checkpoint(f"{url}/x.ckpt")

    # the next save keeps the only complete copy until its own json is written, then removes it
    ck.save_engine_checkpoint(f"{url}/x.ckpt", model, engine, {"global_step": 3})
    assert fs.isfile(f"{root}/x.ckpt/{ck.INFO_FILE}") and not fs.exists(f"{root}/x.zero-old.ckpt")
    assert ck.load_checkpoint_dir(f"{url}/x.ckpt", *tied_engine(1))["global_step"] == 3


def test_replacing_a_remote_checkpoint_always_leaves_a_complete_copy(mem, monkeypatch):
    """At every remote write or delete of a replacing save, X or X.zero-old is complete (has its json and all
    files the json lists)."""
    url, fs, root = mem
    model, engine = _trained()
    ck.save_engine_checkpoint(f"{url}/x.ckpt", model, engine, {"global_step": 2})
    train(model, engine, 0, 1, range(2, 3))
    seen = []

    def complete(d):
        import json

        if not fs.isfile(f"{d}/{ck.INFO_FILE}"):
            return False
        info = json.loads(fs.cat(f"{d}/{ck.INFO_FILE}"))
        return all(fs.isfile(f"{d}/{n}") for n in info["files"])

    def check(name):
        real = getattr(type(fs), name)

        def wrapped(self, *a, **kw):
            seen.append(name)
            assert complete(f"{root}/x.ckpt") or complete(f"{root}/x.zero-old.ckpt"), f"before {name}{a}"
            res = real(self, *a, **kw)
            assert complete(f"{root}/x.ckpt") or complete(f"{root}/x.zero-old.ckpt"), f"after {name}{a}"
            return res
        monkeypatch.setattr(type(fs), name, wrapped)

    for name in ("put_file", "rm_file", "cp_file", "rm"):
        check(name)
    ck.save_engine_checkpoint(f"{url}/x.ckpt", model, engine, {"global_step": 3})
    monkeypatch.undo()
    assert {"put_file", "rm_file", "cp_file"} <= set(seen)
    assert ck.load_checkpoint_dir(f"{url}/x.ckpt", *tied_engine(1))["global_step"] == 3


def test_cli_export_and_missing_remote_checkpoint(tmp_path, mem, capsys):
    url, fs, root = mem
    assert cli_main(["consolidate", f"{url}/none.ckpt", str(tmp_path / "o.pt"), "--quiet"]) == 2
    assert "Checkpoint directory not found" in capsys.readouterr().err
    fs.pipe(f"{root}/partial.ckpt/__0_0.distcp", b"x")
    assert cli_main(["consolidate", f"{url}/partial.ckpt", str(tmp_path / "o.pt"), "--quiet"]) == 2
    assert "not a complete lightning_zero checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o.pt").exists()
    model, engine = _trained()
    ck.save_engine_checkpoint(f"{url}/a.ckpt", model, engine)
    assert cli_main(["consolidate", f"{url}/a.ckpt", f"{url}/w.pt", "--quiet"]) == 0
    assert f"{url}/w.pt" in capsys.readouterr().out
    weights = torch.load(io.BytesIO(fs.cat(f"{root}/w.pt")))
    assert set(weights) == {k for k in _weights(model)}


def _fabric_job(rank, world_size, url):
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy
    from tests.helpers.models import batch, loss_fn, make_model, make_optimizer

    def setup(stage):
        fabric = Fabric(strategy=ZeroFabricStrategy(stage=stage), accelerator="cpu", devices=1)
        fabric.launch()
        torch.manual_seed(0)
        model = make_model()
        return (fabric, *fabric.setup(model, make_optimizer(model, "adamw")))

    def steps(fabric, model, opt, start):
        losses = []
        for step in range(start, start + 2):
            loss = loss_fn(model, batch(step, rank, 0), False)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    fabric, model, opt = setup(2)
    steps(fabric, model, opt, 0)
    fabric.save(url, {"model": model, "optimizer": opt, "step": 2})
    at_url = fsspec.filesystem("memory").isfile(f"{url[len('memory://'):]}/{ck.INFO_FILE}")
    uninterrupted = steps(fabric, model, opt, 2)
    fabric.strategy.teardown()
    fabric, model, opt = setup(3)  # resumed at another stage from the URL
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(url, state)
    return {"at_url": at_url, "step": state["step"], "uninterrupted": uninterrupted,
            "resumed": steps(fabric, model, opt, 2),
            "left": sorted(p.name for p in location.staging_root().glob("lightning_zero-save-*"))}


def test_fabric_save_and_resume_at_a_url_continue_the_run_exactly(mem):
    from tests.helpers.dist_utils import run_distributed

    (res,) = run_distributed(_fabric_job, 1, f"{mem[0]}/fabric.ckpt")  # memory:// lives in that process
    assert res["at_url"], "written at the URL, not into a local folder named after it"
    assert res["step"] == 2 and res["resumed"] == res["uninterrupted"] and not res["left"]


def test_export_hf_from_a_url_to_a_url(tmp_path, mem):
    transformers = pytest.importorskip("transformers")
    from tests.helpers.gpt2_module import GPTModule, gpt2_config

    url, fs, root = mem
    trainer = Trainer(strategy=ZeroStrategy(stage=2), default_root_dir=tmp_path, callbacks=[
        ModelCheckpoint(dirpath=f"{url}/ck", filename="{epoch}")], **trainer_kwargs(
        devices=1, max_epochs=1, max_steps=-1, limit_train_batches=2, enable_checkpointing=True))
    trainer.fit(GPTModule(gpt2_config().to_dict(), str(tmp_path)))
    assert cli_main(["export", f"{url}/ck/epoch=0.ckpt", f"{url}/hf", "--hf", "--quiet"]) == 0
    assert sorted(p.rpartition("/")[2] for p in fs.find(f"{root}/hf")) == ["config.json", "model.safetensors"]
    fs.get(f"{root}/hf/", str(tmp_path / "hf"), recursive=True)
    model, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert all(not v for v in info.values()), info
    weights = torch.load(tmp_path / "weights_step2.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[f"model.{k}"]), k


def test_full_format_file_at_a_url_saves_and_resumes(tmp_path, mem):
    """checkpoint_format="full": Lightning's single file at the URL, read back through a local copy."""
    url, fs, root = mem
    out = str(tmp_path)
    kw = dict(default_root_dir=out, **trainer_kwargs(devices=1, **{**FIT, "max_steps": 3}))
    trainer = Trainer(strategy=ZeroStrategy(stage=2, checkpoint_format="full"), **kw)
    trainer.fit(TiedParityModule(out, tag="a_"))
    trainer.save_checkpoint(f"{url}/full.ckpt")
    assert fs.isfile(f"{root}/full.ckpt")
    kw = dict(default_root_dir=out, **trainer_kwargs(devices=1, **FIT))
    Trainer(strategy=ZeroStrategy(stage=2), **kw).fit(TiedParityModule(out, tag="b_"), ckpt_path=f"{url}/full.ckpt")
    assert load_rank_files(out, "b_", "train", 1)[0]["global_step"] == 6
