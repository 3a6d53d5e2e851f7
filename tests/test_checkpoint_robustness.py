"""Sharded checkpoints under faults: a crash between the two renames of an atomic save, corrupt metadata,
a corrupt input to ``consolidate``, and a ZeRO directory read by Lightning's plain DDP strategy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero
from lightning_zero import ZeroConfig, ZeroEngine, ZeroStrategy
from lightning_zero import checkpoint as ck
from lightning_zero.checkpoint import atomic as ck_atomic, format as ck_format
from lightning_zero.tools.cli import main as cli_main
from lightning_zero.checkpoint.consolidate import consolidate
from tests.helpers.ckpt_files import copy_checkpoint, save_trained, tied_engine
from tests.helpers.ckpt_models import TiedParityModule, make_tied, train
from tests.helpers.lightning_models import load_rank_files, trainer_kwargs
from tests.helpers.models import make_optimizer

pytestmark = pytest.mark.timeout(120)


# -- one process, no process group ------------------------------------------------------------------------------------
_engine = tied_engine


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _without_exchange(monkeypatch) -> None:
    """A filesystem that cannot exchange names atomically (checkpoint/files.py ``swap_dirs``): the save
    falls back to two renames, the window these tests crash into."""
    monkeypatch.setattr(ck_atomic, "swap_dirs", lambda new, final: False)


@pytest.fixture
def crash_final_rename(monkeypatch):
    """``crash()`` arms a crash of the next save between its two renames: the rename of the finished
    temporary directory into place raises (the previous checkpoint was already moved aside)."""
    _without_exchange(monkeypatch)
    real, armed = os.rename, []

    def rename(src, dst, *a, **kw):
        if armed and str(src).endswith(ck._TMP):
            armed.clear()
            raise OSError("simulated crash between the two renames")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    return lambda: armed.append(True)


def test_replacing_a_checkpoint_exchanges_the_names_atomically(tmp_path, monkeypatch):
    """Where the filesystem can (Linux renameat2, this machine's), replacing ``X`` is one exchange of names: no
    rename of ``X`` runs at all, so no crash can find ``X`` missing; the previous copy is gone afterwards."""
    path = tmp_path / "last.ckpt"
    model, engine = _engine()
    train(model, engine, 0, 1, range(2))
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 2})
    if not ck_format.swap_dirs(tmp_path, tmp_path):  # exchanging a name with itself: a no-op where supported
        pytest.fail("renameat2(RENAME_EXCHANGE) is unavailable on this machine's /tmp")
    real, renames = os.rename, []

    def rename(src, dst, *a, **kw):  # DCP renames its own files inside the directory; ours are the directories
        if Path(dst) in (path, ck.aside_path(path)) or Path(src) == path:
            renames.append((src, dst))
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    train(model, engine, 0, 1, range(2, 4))
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 4})
    assert not renames and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert torch.load(path / ck.META_FILE, weights_only=False)["global_step"] == 4


def test_crash_between_renames_falls_back_and_never_loses_the_last_copy(tmp_path, crash_final_rename, monkeypatch):
    path = tmp_path / "last.ckpt"
    old = ck.aside_path(path)
    model, engine = _engine()
    train(model, engine, 0, 1, range(2))
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 2})
    at_two = _weights(model)

    def loads_step_two(what):
        fresh, fresh_engine = _engine(5)
        with pytest.warns(UserWarning, match="interrupted while replacing it"):
            meta = ck.load_checkpoint_dir(path, fresh, fresh_engine)
        assert meta["global_step"] == 2, what
        for k, v in at_two.items():
            torch.testing.assert_close(fresh.state_dict()[k], v, rtol=0, atol=0, msg=f"{what}: {k}")

    for step in (4, 6):  # twice in a row: the second save must not delete the copy the first one left
        train(model, engine, 0, 1, range(step - 2, step))
        crash_final_rename()
        with pytest.raises(ck.CheckpointWriteError, match="simulated crash"):
            ck.save_engine_checkpoint(path, model, engine, {"global_step": step})
        assert not path.exists() and ck.is_checkpoint_dir(old)
        loads_step_two(f"after the crashed save of step {step}")

    out = tmp_path / "w.safetensors"
    with pytest.warns(UserWarning, match="interrupted"):
        consolidate(path, out)
    assert out.is_file()

    # a save that dies while writing: the interrupted one's copy is back under its own name, still step 2
    real_save = ck.dcp.save
    monkeypatch.setattr(ck.dcp, "save", lambda *a, **kw: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(ck.CheckpointWriteError, match="OSError: disk full"):
        ck.save_engine_checkpoint(path, model, engine, {"global_step": 6})
    monkeypatch.setattr(ck.dcp, "save", real_save)
    assert ck.is_checkpoint_dir(path) and not old.exists()
    assert ck.load_checkpoint_dir(path, make_tied(5))["global_step"] == 2

    # stale temporaries of any name in the directory go with the next successful save
    (tmp_path / ("epoch=0.ckpt" + ck._TMP)).mkdir()
    (tmp_path / ("epoch=0.ckpt" + ck._TMP) / "__0_0.distcp").write_bytes(b"half")
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 6})
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "w.safetensors"]
    assert ck.load_checkpoint_dir(path, make_tied(5))["global_step"] == 6


@pytest.fixture
def saved_dir(tmp_path):
    return save_trained(tmp_path)


_copy = copy_checkpoint


def _edit_info(path: Path, edit) -> None:
    """An edit that also drops the json's seal and file list (as an older build wrote it), so the structural
    checks behind the checksums are what refuses it (the checksums: tests/test_checkpoint_integrity.py)."""
    info = json.loads((path / ck.INFO_FILE).read_text())
    info.pop("info_crc32", None)
    info.pop("files", None)
    edit(info)
    (path / ck.INFO_FILE).write_text(json.dumps(info))


def test_corrupt_metadata_is_one_clear_error(saved_dir):
    broken = _copy(saved_dir, "truncated_meta.ckpt")
    meta = broken / ck.META_FILE
    meta.write_bytes(meta.read_bytes()[:60])
    with pytest.raises(ValueError, match=r"Corrupt checkpoint .*truncated_meta\.ckpt.*meta\.pt is truncated"):
        ck.load_checkpoint_dir(broken, *_engine(3))
    _edit_info(broken, lambda info: None)  # without checksums: still one clear error, from the unpickler
    with pytest.raises(ValueError, match=r"Corrupt checkpoint .*truncated_meta\.ckpt.*meta\.pt cannot be read"):
        ck.load_checkpoint_dir(broken, *_engine(3))

    for key in ("tensors", "optimizer_state", "aliases", "order"):
        broken = _copy(saved_dir, f"no_{key}.ckpt")
        _edit_info(broken, lambda info: info.pop(key))
        with pytest.raises(ValueError, match=rf"Corrupt checkpoint metadata .*no_{key}\.ckpt/zero_checkpoint\.json"
                                             rf".*'{key}' is missing.*Required keys: world_size, tensors"):
            ck.load_checkpoint_dir(broken, *_engine(3))
    broken = _copy(saved_dir, "bad_entry.ckpt")
    _edit_info(broken, lambda info: info["tensors"]["fc1.weight"].pop("shape"))
    with pytest.raises(ValueError, match=r"zero_checkpoint\.json.*the entry of tensor 'fc1\.weight' is not"):
        consolidate(broken, broken.with_name("out.pt"))
    broken = _copy(saved_dir, "list.ckpt")
    (broken / ck.INFO_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"zero_checkpoint\.json holds a list, not a json object"):
        ck.read_info(broken)


def test_a_removed_optimizer_state_entry_is_an_error_not_a_silent_drop(saved_dir):
    broken = _copy(saved_dir, "no_fc1_state.ckpt")
    _edit_info(broken, lambda info: info["optimizer_state"].pop("fc1.weight"))
    with pytest.raises(ValueError, match=r"'optimizer_state' does not match the stored tensors: the optimizer "
                                         r"state of \['fc1\.weight'\] stored but not listed"):
        ck.load_checkpoint_dir(broken, *_engine(3))
    ck.load_checkpoint_dir(saved_dir, *_engine(3))  # the intact one loads


def test_consolidate_of_a_corrupt_input_leaves_no_temporary(saved_dir, tmp_path):
    broken = _copy(saved_dir, "torn.ckpt")
    for shard in broken.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:200])
    out = tmp_path / "out"
    for name in ("m.safetensors", "m.pt"):
        assert cli_main(["consolidate", str(broken), str(out / name)]) == 2
        with pytest.raises(ValueError, match=r"__0_0\.distcp is truncated or altered"):
            consolidate(broken, out / name)
    assert not out.exists() or os.listdir(out) == []  # refused before anything was written


# -- Lightning ------------------------------------------------------------------------------------------------------
Z3 = dict(unit_classes=["net.fc1", "net.fc2", "net.frozen"], persist_numel=0)


def _fit(out, tag, strategy, max_steps, ckpt_path=None, callbacks=(), **module_kw):
    Trainer(strategy=strategy, callbacks=list(callbacks),
            **trainer_kwargs(devices=2, max_steps=max_steps, enable_checkpointing=True)).fit(
        TiedParityModule(out, tag=tag, **module_kw), ckpt_path=ckpt_path)
    return load_rank_files(out, tag, "train", 2)


def test_lightning_resume_from_last_after_a_crash_between_renames(tmp_path, monkeypatch):
    """The second save of last.ckpt dies between its renames (rank 0, in the forked launcher): the run fails,
    last.ckpt is gone. ``fit(ckpt_path="last")`` resumes from its previous copy (step 2, not step 0), and the
    next save puts everything back in order."""
    out, ckdir = str(tmp_path), tmp_path / "ck"
    real, saves = os.rename, []

    def rename(src, dst, *a, **kw):
        if str(src).endswith(ck._TMP) and Path(dst).name == "last.ckpt":
            saves.append(dst)
            if len(saves) == 2:
                raise OSError("simulated crash between the two renames")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)  # the forked ranks inherit it
    _without_exchange(monkeypatch)

    def saver():
        return [ModelCheckpoint(dirpath=ckdir, save_last=True, save_top_k=0, every_n_train_steps=2)]

    with pytest.raises(Exception, match="simulated crash"):
        _fit(out, "a_", ZeroStrategy(stage=2, start_method="fork"), 4, callbacks=saver())
    monkeypatch.setattr(os, "rename", real)
    # the previous copy sits under a name Lightning's own ckpt_path="last" search finds (no wrapper needed)
    assert not (ckdir / "last.ckpt").exists() and ck.is_checkpoint_dir(ckdir / "last.zero-old.ckpt")
    with pytest.warns(UserWarning, match="interrupted"):
        consolidate(ckdir / "last.ckpt", tmp_path / "at_step2.pt")

    _fit(out, "b_", ZeroStrategy(stage=2, start_method="fork"), 6, ckpt_path="last", callbacks=saver(),
         save_opt_state_on_start=True)
    for r, start in enumerate(load_rank_files(out, "b_", "start", 2)):
        assert start["global_step"] == 2, f"rank {r} restarted from step {start['global_step']}"
        for k, v in torch.load(tmp_path / "at_step2.pt").items():
            torch.testing.assert_close(start["params"][k], v, rtol=0, atol=0, msg=k)
    assert sorted(os.listdir(ckdir)) == ["last.ckpt"]
    assert torch.load(ckdir / "last.ckpt" / ck.META_FILE, weights_only=False)["global_step"] == 6


def _reference_optimizer_state(path, wrap: bool = True) -> dict:
    """The directory's optimizer state as the engine's own (tested) reshard path consolidates it."""
    module = torch.nn.Module()
    module.net = make_tied(5)
    if not wrap:  # saved from the bare model, not a LightningModule holding it as ``net``
        module = module.net
    engine = ZeroEngine(module, make_optimizer(getattr(module, "net", module), "adamw"), ZeroConfig(stage=1))
    ck.load_checkpoint_dir(path, module, engine)
    return engine.optimizer_state_dict()


def test_plain_ddp_resumes_from_a_zero3_directory(tmp_path):
    """``Trainer(strategy=DDPStrategy(checkpoint_io=ZeroCheckpointIO())).fit(ckpt_path=DIR)`` on a stage-3 sharded
    directory: consolidated on the
    fly (weights, Adam moments by position with the frozen parameter's slot kept, loops, schedulers), the
    run continues exactly as zero3 resuming from the same directory does."""
    out = str(tmp_path)
    _fit(out, "z3_", ZeroStrategy(stage=3, start_method="fork", **Z3), 3,
         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1,
                                    every_n_train_steps=3)])
    d = str(tmp_path / "ck" / "step=3.ckpt")
    assert ck.read_info(d)["stage"] == 3
    z3 = _fit(out, "z3r_", ZeroStrategy(stage=3, start_method="fork", **Z3), 6, ckpt_path=d)
    ddp = _fit(out, "ddp_", DDPStrategy(start_method="fork", find_unused_parameters=True,
                                        checkpoint_io=lightning_zero.ZeroCheckpointIO()), 6, ckpt_path=d,
               save_opt_state_on_start=True)
    start = load_rank_files(out, "ddp_", "start", 2)[0]
    assert start["global_step"] == 3
    opt, want = start["opt_state"], _reference_optimizer_state(d)
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert sorted(opt["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(opt["state"][i][k], v.reshape(opt["state"][i][k].shape), rtol=0, atol=0)
    for r, (a, b) in enumerate(zip(ddp, z3)):
        assert a["global_step"] == b["global_step"] == 6
        torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-5, atol=1e-6, msg=f"rank {r} losses")
        for k, v in b["params"].items():
            torch.testing.assert_close(a["params"][k], v, rtol=1e-5, atol=1e-6, msg=f"rank {r} {k}")


def test_zero_checkpoint_io_reads_zero_directories_and_leaves_the_rest_to_lightning(saved_dir, tmp_path):
    """``ZeroCheckpointIO`` (the plugin other strategies take): a ZeRO directory comes back as a Lightning
    checkpoint (full weights as ``consolidate`` writes them, optimizer state by position); a file is Lightning's
    own read; a directory that is not a checkpoint is one clear error. Lightning's TorchCheckpointIO itself is
    no longer patched."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as Plain

    assert not getattr(Plain.load_checkpoint, "_lightning_zero", False), "import lightning_zero patched Lightning"
    TorchCheckpointIO = lightning_zero.ZeroCheckpointIO
    loaded = TorchCheckpointIO().load_checkpoint(str(saved_dir))
    consolidate(saved_dir, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt")
    assert list(loaded["state_dict"]) == list(full) and loaded["global_step"] == 2
    for k, v in full.items():
        torch.testing.assert_close(loaded["state_dict"][k], v, rtol=0, atol=0)
    want = _reference_optimizer_state(saved_dir, wrap=False)
    got = loaded["optimizer_states"][0]
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(got["state"][i][k], v, rtol=0, atol=0)
    torch.save({"a": torch.ones(2)}, tmp_path / "plain.ckpt")
    assert torch.equal(TorchCheckpointIO().load_checkpoint(tmp_path / "plain.ckpt")["a"], torch.ones(2))
    (tmp_path / "not_ours").mkdir()
    with pytest.raises(IsADirectoryError, match="not a complete lightning_zero checkpoint.*Allowed"):
        TorchCheckpointIO().load_checkpoint(tmp_path / "not_ours")


def test_removing_a_checkpoint_removes_what_an_interrupted_save_left_of_it(saved_dir):
    """ModelCheckpoint dropping ``X`` from its top-k must not leave its aside copy for the next save to rename
    back into a checkpoint the callback deleted."""
    old = _copy(saved_dir, ck.aside_path("b.ckpt").name)
    tmp = _copy(saved_dir, "b.ckpt" + ck._TMP)
    ZeroStrategy(stage=2).remove_checkpoint(saved_dir.with_name("b.ckpt"))
    assert not old.exists() and not tmp.exists() and ck.is_checkpoint_dir(saved_dir)
