"""Checkpoints for the robustness tests: a small trained stage-1 engine saved as a directory, copies to damage,
CRC-32 as the format lists it, a pipeline checkpoint around a sharded directory."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero import checkpoint as ck
from tests.helpers.ckpt_models import make_tied, train
from tests.helpers.models import make_optimizer


def tied_engine(seed: int = 0):
    """A model with tied weights under a stage-1 AdamW engine: (model, engine)."""
    model = make_tied(seed)
    return model, ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=1))


def save_trained(tmp_path: Path) -> Path:
    """``tmp_path/a.ckpt``: the tied model after two steps, saved as a sharded directory."""
    model, engine = tied_engine()
    train(model, engine, 0, 1, range(2))
    return ck.save_engine_checkpoint(tmp_path / "a.ckpt", model, engine, {"global_step": 2})


def copy_checkpoint(src: Path, name: str) -> Path:
    """A copy of the directory ``src`` beside it, to damage."""
    dst = src.with_name(name)
    shutil.copytree(src, dst)
    return dst


def crc32(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


def as_pipeline(stage: Path, dir_name: str = "stage0") -> Path:
    """A one-stage pipeline checkpoint around a copy of the sharded directory ``stage``."""
    path = stage.parent / f"pipe_{stage.name}_{dir_name.replace('/', '_')}"
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(stage, path / "stage0")
    shutil.copy(stage / ck.META_FILE, path / ck.META_FILE)
    names = json.loads((stage / ck.INFO_FILE).read_text())["order"]
    manifest = {"format": "lightning_zero.pipeline", "version": 2, "num_stages": 1, "pipeline_parallel_size": 1,
                "chunks": 1, "data_parallel_size": 1, "zero_stage": 2,
                "stages": {"0": {"dir": dir_name, "params": 0, "source_names": {n: n for n in names}}}}
    (path / ck.INFO_FILE).write_text(json.dumps(manifest))
    return path


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """Two checkpoint directories hold the same tensors, optimizer state included (bit for bit), and the same
    training progress (``global_step``, and Lightning's loops where saved)."""
    from lightning_zero.checkpoint.consolidate import full_model_state
    from lightning_zero.lightning.lightning_io import load_as_lightning_checkpoint

    info_a, info_b = ck.read_info(got), ck.read_info(want)
    a, b = full_model_state(got, info_a), full_model_state(want, info_b)
    assert a.keys() == b.keys()
    for k in b:
        assert torch.equal(a[k], b[k]), f"{got}: {k}"
    assert info_a["optimizer_state"] == info_b["optimizer_state"]
    ma, mb = ck.read_meta(got, trust_checkpoint=True), ck.read_meta(want, trust_checkpoint=True)
    assert ma.get("global_step") == mb.get("global_step") and ma.get("loops") == mb.get("loops")
    oa, ob = (load_as_lightning_checkpoint(p, trust_checkpoint=True)["optimizer_states"][0]["state"] for p in (got, want))
    assert oa.keys() == ob.keys()
    for i in ob:
        for key in ob[i]:
            assert torch.equal(oa[i][key], ob[i][key]), f"{got}: optimizer state {i}.{key}"
