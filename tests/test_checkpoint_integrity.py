"""Integrity of checkpoint directories: every file listed with its size and CRC-32, verified on load and by
``consolidate`` (a truncated or flipped file of any kind is one error naming it); ``consolidate`` applies the
Trainer's checks (never a silent partial output, never a raw traceback); a failed save leaves no temporary;
a pipeline directory given to the plain loader says what it is."""

from __future__ import annotations

import json
import os
import resource
import signal
from pathlib import Path

import pytest
import torch

import lightning_zero  # noqa: F401
from lightning_zero import checkpoint as ck
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.tools.cli import main as cli_main
from tests.helpers.ckpt_files import as_pipeline, copy_checkpoint, crc32, save_trained, tied_engine

pytestmark = pytest.mark.timeout(120)


_engine = tied_engine


@pytest.fixture
def saved(tmp_path):
    return save_trained(tmp_path)


_copy = copy_checkpoint


def _legacy(path: Path, edit=lambda info: None) -> None:
    """The json as a build without checksums wrote it, then ``edit``ed."""
    info = json.loads((path / ck.INFO_FILE).read_text())
    info.pop("info_crc32")
    info.pop("files")
    edit(info)
    (path / ck.INFO_FILE).write_text(json.dumps(info))


def _reads(path: Path, tmp_path: Path, match: str, capsys) -> None:
    """Refused alike by the engine load, consolidate (both formats) and the CLI, nothing written."""
    with pytest.raises(ValueError, match=match):
        ck.load_checkpoint_dir(path, *_engine(3))
    for name in ("o.pt", "o.safetensors"):
        with pytest.raises(ValueError, match=match):
            consolidate(path, tmp_path / name)
        assert cli_main(["consolidate", str(path), str(tmp_path / name), "--quiet"]) == 2
        assert "error:" in capsys.readouterr().err
        assert not (tmp_path / name).exists()


def test_every_file_is_listed_with_size_and_crc32(saved):
    info = json.loads((saved / ck.INFO_FILE).read_text())
    files = info["files"]
    assert sorted(files) == sorted(n for n in os.listdir(saved) if n != ck.INFO_FILE)
    assert {ck.META_FILE, ck.DCP_METADATA, "__0_0.distcp"} <= set(files)
    for name, d in files.items():
        assert d["size"] == os.path.getsize(saved / name) and d["crc32"] == crc32((saved / name).read_bytes())


@pytest.mark.parametrize("victim", ["__0_0.distcp", ck.DCP_METADATA, ck.META_FILE])
@pytest.mark.parametrize("damage", ["truncated", "bit flip"])
def test_a_truncated_or_flipped_file_is_refused_naming_it(saved, tmp_path, victim, damage, capsys):
    path = _copy(saved, "broken.ckpt")
    data = bytearray((path / victim).read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x10
    (path / victim).write_bytes(bytes(data))
    what = "truncated or altered" if damage == "truncated" else "altered or damaged: CRC-32"
    _reads(path, tmp_path, rf"Corrupt checkpoint .*broken\.ckpt.*: {victim.replace('.', '[.]')} is {what}", capsys)


def test_a_flipped_bit_in_the_json_is_refused(saved, tmp_path, capsys):
    path = _copy(saved, "json.ckpt")
    text = (path / ck.INFO_FILE).read_text()
    info = json.loads(text)
    shape = info["tensors"]["fc1.weight"]["shape"]
    edited = text.replace(f'"shape": [\n    {shape[0]},', f'"shape": [\n    {shape[0] ^ 1},', 1)
    assert edited != text
    (path / ck.INFO_FILE).write_text(edited)
    _reads(path, tmp_path, r"zero_checkpoint\.json was altered after it was written", capsys)


# -- consolidate applies the Trainer's checks (json edited as an older build's, so no checksum catches it) -----
CASES = {
    "a tensor removed": (lambda info: info["tensors"].pop("fc2.bias"),
                         r"stored but not listed in zero_checkpoint\.json: \['fc2\.bias'\]"),
    "dtype 'os'": (lambda info: info["tensors"]["fc1.bias"].update(dtype="os"),
                   r"the entry of tensor 'fc1\.bias' is not \{'shape': \[ints\], 'dtype': a torch dtype"),
    "an edited shape": (lambda info: info["tensors"]["fc1.weight"].update(shape=[7, 7]),
                        r"shape or dtype differ: \['fc1\.weight: zero_checkpoint\.json \[49\] float32, stored \["),
    "a listed tensor not stored": (lambda info: info["tensors"].update(ghost={"shape": [2], "dtype": "float32",
                                                                             "flat": False}),
                                   r"listed in zero_checkpoint\.json but not stored: \['ghost'\]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_consolidate_refuses_what_the_trainer_refuses(saved, tmp_path, case, capsys):
    edit, match = CASES[case]
    path = _copy(saved, "edited.ckpt")
    _legacy(path, edit)
    _reads(path, tmp_path, match, capsys)


def test_a_truncated_dcp_metadata_without_checksums_is_one_clear_error(saved, tmp_path, capsys):
    path = _copy(saved, "md.ckpt")
    _legacy(path)
    md = path / ck.DCP_METADATA
    md.write_bytes(md.read_bytes()[:300])
    _reads(path, tmp_path, r"Corrupt checkpoint .*md\.ckpt.*\.metadata cannot be read", capsys)


def test_old_checkpoints_without_checksums_still_load(saved, tmp_path):
    path = _copy(saved, "old.ckpt")
    _legacy(path)
    model, engine = _engine(3)
    assert ck.load_checkpoint_dir(path, model, engine)["global_step"] == 2
    ref, ref_engine = _engine(4)
    ck.load_checkpoint_dir(saved, ref, ref_engine)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    consolidate(path, tmp_path / "old.pt")
    consolidate(saved, tmp_path / "new.pt")
    a, b = torch.load(tmp_path / "old.pt"), torch.load(tmp_path / "new.pt")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_pipeline_manifest_damage_is_one_clear_error(saved, tmp_path, capsys):
    path = as_pipeline(saved)
    assert cli_main(["consolidate", str(path), str(tmp_path / "ok.pt")]) == 0
    manifest = json.loads((path / ck.INFO_FILE).read_text())
    manifest.pop("num_stages")
    (path / ck.INFO_FILE).write_text(json.dumps(manifest))
    assert cli_main(["consolidate", str(path), str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err
    assert "Corrupt pipeline checkpoint" in err and "'num_stages' is missing" in err, err
    # a pipeline directory handed to the plain loader says what it is and what reads it
    with pytest.raises(ValueError, match=r"is a pipeline checkpoint .*Allowed: resume it with "
                                         r"ZeroPipelineStrategy\(pipeline_parallel_size=P\)"):
        ck.load_checkpoint_dir(as_pipeline(saved, "stage0"), *_engine(3))
    from lightning_zero.checkpoint.pipeline_dir import read_manifest
    with pytest.raises(ValueError, match=r"not a pipeline checkpoint directory but a ZeroStrategy checkpoint "
                                         r"without pipeline parallelism"):
        read_manifest(saved)


def _save_on_a_full_disk(path: str, limit: int, conn) -> None:
    """A child process whose files may not grow past ``limit`` bytes (RLIMIT_FSIZE: the write fails with
    EFBIG as on a full disk)."""
    torch.set_num_threads(1)  # a forked child (see tests/helpers/lightning_models.py)
    model, engine = _engine()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        ck.save_engine_checkpoint(path, model, engine, {"global_step": 1})
        conn.send("saved")
    except BaseException as err:  # DCP may wrap the OSError
        conn.send(f"{type(err).__name__}: {err}")
    finally:
        os._exit(0)


@pytest.mark.timeout(60)
def test_a_failed_save_removes_its_temporary(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    path = str(tmp_path / "full.ckpt")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_save_on_a_full_disk, args=(path, 4096, child))
    p.start()
    got = parent.recv() if parent.poll(50) else "no answer"
    p.join(5)
    assert "File too large" in got, got
    assert sorted(os.listdir(tmp_path)) == [], "the failed save left " + str(os.listdir(tmp_path))
