"""Checkpoints are untrusted input: a crafted pickle in ``meta.pt`` or DCP's ``.metadata`` runs nothing in any
reader (Trainer resume, load_from_checkpoint, Fabric, consolidate, export, the pipeline loaders), paths named
inside a checkpoint stay inside it, and ``trust_checkpoint`` / ``--trust-checkpoint`` is the one opt-in.

Each crafted file is re-listed in ``zero_checkpoint.json`` with its true size and CRC-32 (as someone who
knows the format would): the checksums are no defence against a deliberate edit, the restricted readers are."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint import FileSystemReader

import lightning_zero  # noqa: F401  (installs the Lightning loaders)
from lightning_zero import ZeroCheckpointIO, ZeroPipelineStrategy, ZeroStrategy
from lightning_zero import checkpoint as ck
from lightning_zero.checkpoint.consolidate import consolidate, full_model_state
from lightning_zero.checkpoint.pipeline_dir import consolidate_pipeline_checkpoint
from lightning_zero.lightning.fabric_strategy import ZeroFabricStrategy
from lightning_zero.tools.cli import main as cli_main
from tests.helpers.ckpt_files import as_pipeline, crc32
from tests.helpers.ckpt_models import TiedParityModule
from tests.helpers.lightning_models import trainer_kwargs

pytestmark = pytest.mark.timeout(180)
OPT_IN = r"trust_checkpoint=True .*--trust-checkpoint"


class Payload:
    """Unpickling it creates ``marker`` (what a real attack would do with os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def reseal(path: Path) -> None:
    """List every file again with its true size and CRC-32 and seal the json (written here from the format's
    description, not with the package's code): a deliberate edit by someone who knows the format."""
    info = json.loads((path / ck.INFO_FILE).read_text())
    if "files" not in info:  # a build without checksums
        return
    info.pop("info_crc32", None)
    info["files"] = {n: {"size": os.path.getsize(path / n), "crc32": crc32((path / n).read_bytes())}
                     for n in info["files"]}
    info["info_crc32"] = crc32(json.dumps(info, sort_keys=True, separators=(",", ":")).encode())
    (path / ck.INFO_FILE).write_text(json.dumps(info))


@pytest.fixture(scope="module")
def lightning_dir(tmp_path_factory):
    """A Trainer's sharded checkpoint (ZeRO-2, 2 steps, one process)."""
    out = tmp_path_factory.mktemp("trust")
    kw = trainer_kwargs(devices=1, max_steps=2, enable_checkpointing=True)
    env = dict(os.environ)  # module scope: set up before conftest's per-test hygiene takes its snapshot
    Trainer(strategy=ZeroStrategy(stage=2), callbacks=[ModelCheckpoint(dirpath=out / "ck", save_last=True)],
            **kw).fit(TiedParityModule(str(out)))
    os.environ.clear()
    os.environ.update(env)  # Lightning's exported MASTER_PORT, LOCAL_RANK, ... would make later forked ranks hang
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return out / "ck" / "last.ckpt"


def _crafted(src: Path, tmp_path: Path, victim: str, name: str = "evil.ckpt") -> tuple[Path, Path]:
    path = tmp_path / name
    shutil.copytree(src, path)
    marker = tmp_path / f"PWNED_{victim.strip('.')}"
    if victim == ck.META_FILE:
        torch.save({"global_step": 2, "x": Payload(marker)}, path / victim)
    else:
        (path / victim).write_bytes(pickle.dumps(Payload(marker)))
    reseal(path)
    return path, marker


def _fit(ckpt_path, tmp_path, **strategy_kw):
    Trainer(strategy=ZeroStrategy(stage=2, **strategy_kw), **trainer_kwargs(devices=1, max_steps=3)).fit(
        TiedParityModule(str(tmp_path)), ckpt_path=str(ckpt_path))


def test_crafted_meta_pt_runs_in_no_reader(lightning_dir, tmp_path, capsys):
    path, marker = _crafted(lightning_dir, tmp_path, ck.META_FILE)
    refused = rf"Refusing to load .*evil\.ckpt/meta\.pt.*{OPT_IN}"
    readers = {
        "engine load": lambda: ck.load_checkpoint_dir(path, TiedParityModule(str(tmp_path))),
        "Trainer resume": lambda: _fit(path, tmp_path),
        "DDP resume from the directory": lambda: Trainer(strategy=DDPStrategy(checkpoint_io=ZeroCheckpointIO()),
                                                         **trainer_kwargs(devices=1, max_steps=3)
                                                         ).fit(TiedParityModule(str(tmp_path)), ckpt_path=str(path)),
        "load_from_checkpoint": lambda: TiedParityModule.load_from_checkpoint(path, out=str(tmp_path)),
        "Fabric load": lambda: Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(stage=2)).load(path),
        "pipeline strategy": lambda: ZeroPipelineStrategy(pipeline_parallel_size=2).load_checkpoint(as_pipeline(path)),
    }
    for what, read in readers.items():
        with pytest.raises(ValueError, match=refused if what != "pipeline strategy" else r"Refusing .*meta\.pt"):
            read()
        assert not marker.exists(), what
    for argv in (["consolidate", str(path), str(tmp_path / "o.ckpt"), "--lightning"],
                 ["export", str(path), str(tmp_path / "hf"), "--hf"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert "Refusing to load" in err and "meta.pt" in err and "--trust-checkpoint" in err, err
        assert not marker.exists(), argv[0]
    # the opt-in reads it as torch.load(weights_only=False) would: the payload runs
    ck.load_checkpoint_dir(path, TiedParityModule(str(tmp_path)), trust_checkpoint=True)
    assert marker.exists()


def test_crafted_dcp_metadata_runs_in_no_reader(lightning_dir, tmp_path, capsys):
    path, marker = _crafted(lightning_dir, tmp_path, ck.DCP_METADATA)
    refused = rf"Refusing to load .*evil\.ckpt/\.metadata.*global io\.open is not a DCP metadata type.*{OPT_IN}"
    for argv in (["consolidate", str(path), str(tmp_path / "o.safetensors")],
                 ["consolidate", str(path), str(tmp_path / "o.ckpt"), "--lightning"]):
        assert cli_main(argv) == 2
        assert "global io.open is not a DCP metadata type" in capsys.readouterr().err
    with pytest.raises(ValueError, match=refused):
        TiedParityModule.load_from_checkpoint(path, out=str(tmp_path), weights_only=True)
    with pytest.raises(ValueError, match=refused):
        _fit(path, tmp_path)
    assert not marker.exists()


def _edited_metadata(src: Path, tmp_path: Path, name: str, edit) -> Path:
    path = tmp_path / name
    shutil.copytree(src, path)
    md = FileSystemReader(str(path)).read_metadata()  # ours, written by a save: trusted
    edit(md, path)
    (path / ck.DCP_METADATA).write_bytes(pickle.dumps(md))
    reseal(path)
    return path


def test_dcp_metadata_may_not_hold_pickled_entries_nor_point_outside(lightning_dir, tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def to_bytes(md, _path):  # DCP would torch.load(weights_only=False) this entry's bytes
        md.state_dict_metadata["model.net.fc1.weight"] = BytesStorageMetadata()

    path = _edited_metadata(lightning_dir, tmp_path, "bytes.ckpt", to_bytes)
    with pytest.raises(ValueError, match=r"entry 'model\.net\.fc1\.weight' is a pickled object"):
        consolidate(path, tmp_path / "o.pt")

    def escape(md, path):
        outside = tmp_path / "outside"
        outside.mkdir()
        for info in md.storage_data.values():
            shutil.copy(path / info.relative_path, outside / info.relative_path)
            info.relative_path = f"../outside/{info.relative_path}"

    path = _edited_metadata(lightning_dir, tmp_path, "escape.ckpt", escape)
    with pytest.raises(ValueError, match=r"storage file '\.\./outside/__0_0\.distcp' points outside"):
        consolidate(path, tmp_path / "o.pt")
    with pytest.raises(ValueError, match=r"points outside"):
        TiedParityModule.load_from_checkpoint(path, out=str(tmp_path))
    assert not (tmp_path / "o.pt").exists()


def test_a_pipeline_manifest_names_only_its_own_stage_directories(lightning_dir, tmp_path):
    sd = consolidate_pipeline_checkpoint(as_pipeline(lightning_dir))  # a legitimate one reads
    plain = full_model_state(lightning_dir, ck.read_info(lightning_dir), None)
    assert sorted(sd) == sorted(plain) and all(torch.equal(sd[k], plain[k]) for k in plain)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(lightning_dir, elsewhere)
    for bad in ("../../elsewhere", str(elsewhere), "stage0/../..", ""):
        path = as_pipeline(lightning_dir, bad)
        with pytest.raises(ValueError, match=r"stage 0's directory .*(points outside|is not a relative path)"):
            consolidate_pipeline_checkpoint(path)
        assert cli_main(["consolidate", str(path), str(tmp_path / "o.pt")]) == 2
        assert not (tmp_path / "o.pt").exists()


class HparamsModule(TiedParityModule):
    def __init__(self, out: str, extra=None) -> None:
        super().__init__(out)
        self.save_hyperparameters("out", "extra")


def _fit_hparams(tmp_path, extra, name):
    kw = trainer_kwargs(devices=1, max_steps=2, enable_checkpointing=True)
    Trainer(strategy=ZeroStrategy(stage=2), callbacks=[ModelCheckpoint(dirpath=tmp_path / name, save_last=True)],
            **kw).fit(HparamsModule(str(tmp_path), extra))
    return tmp_path / name / "last.ckpt"


def test_what_a_lightning_checkpoint_legitimately_holds_loads_by_default_and_the_rest_by_opt_in(tmp_path):
    import argparse

    transformers = pytest.importorskip("transformers")
    path = _fit_hparams(tmp_path, {"root": Path("/data/x"), "args": argparse.Namespace(lr=0.5)}, "plain")
    loaded = HparamsModule.load_from_checkpoint(path)  # Lightning's defaults
    assert loaded.hparams.extra["root"] == Path("/data/x") and loaded.hparams.extra["args"].lr == 0.5
    _fit(path, tmp_path)  # resume with the default strategy
    # an object outside the allow-list (a transformers config among the hparams): refused, then opted in
    path = _fit_hparams(tmp_path, transformers.GPT2Config(n_layer=1), "hf")
    with pytest.raises(ValueError, match=rf"Refusing to load .*hf/last\.ckpt/meta\.pt.*GPT2Config.*{OPT_IN}"):
        HparamsModule.load_from_checkpoint(path)
    with pytest.raises(ValueError, match=r"Refusing to load"):
        _fit(path, tmp_path)
    assert HparamsModule.load_from_checkpoint(path, weights_only=False).hparams.extra.n_layer == 1
    _fit(path, tmp_path, trust_checkpoint=True)
    assert cli_main(["consolidate", str(path), str(tmp_path / "hf.ckpt"), "--lightning", "--quiet"]) == 2
    assert cli_main(["consolidate", str(path), str(tmp_path / "hf.ckpt"), "--lightning", "--quiet",
                     "--trust-checkpoint"]) == 0
    assert torch.load(tmp_path / "hf.ckpt", weights_only=False)["hyper_parameters"]["extra"].n_layer == 1
