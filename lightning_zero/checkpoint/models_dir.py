"""Several models' checkpoints in one atomic directory (Fabric's ``fabric.save(path, {"g": g, "d": d, ...})``).

Design note
-----------
::

    ckpt/                      (written as ckpt.zero-tmp, renamed when complete: format.py's atomic rename)
      zero_checkpoint.json     the manifest: format "lightning_zero.models" version 1; per model (by the key
                               it was saved under) its directory and the keys of its optimizers, in the
                               engine's order; the world size and ZeRO stage at save
      meta.pt                  the caller's other entries (step counters, the precision plugin's state, ...)
      models/<key>/            each exactly what one ZeRO engine writes (format.py's files: the model's
                               flat DTensor shards, its optimizers as "optim", "optim_1", ..., its json), so
                               each reshards on load (N -> M ranks, stage a -> b) and consolidates on its own
                               (``lightning-zero consolidate ckpt/models/<key> out.pt``)

A model's directory is its key when the key is a plain name (letters, digits, ``_``, ``-``, ``.``; not
starting with a dot), else ``model<i>``. One model is written as an ordinary checkpoint directory, as
before; this layout is for two or more. The manifest is untrusted input: every directory it names must
be a plain relative path inside ``ckpt/models`` holding a complete checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..engine.comm.collectives import barrier as _barrier, rank as _rank
from .files import INFO_FILE, META_FILE, MODELS_FORMAT, is_checkpoint_dir, read_info
from .trust import confined
from .atomic import atomic_checkpoint_dir
from .prepared import _map_tensors, prepare_checkpoint, release_saved_state, write_prepared
from .sharded_state import sharded_model_state, sharded_optimizer_state

MODELS_VERSION = 1
MODELS_DIR = "models"
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_PathLike = Union[str, Path]


class SavedModel:
    """One model of a multi-model checkpoint: the key it is saved under, its module and engine (None: a
    model without one, written whole), and its optimizers' keys with the optimizers, in the engine's order."""

    def __init__(self, key: str, module: torch.nn.Module, engine=None,
                 optimizers: Sequence[tuple[str, Any]] = ()) -> None:
        self.key, self.module, self.engine, self.optimizers = key, module, engine, list(optimizers)


def model_dirs(keys: Sequence[str]) -> dict[str, str]:
    """Each key's directory (relative to the checkpoint), distinct for distinct keys."""
    out: dict[str, str] = {}
    for i, key in enumerate(keys):
        name = key if _PLAIN.fullmatch(key) else f"model{i}"
        while f"{MODELS_DIR}/{name}" in out.values():
            name += "_"
        out[key] = f"{MODELS_DIR}/{name}"
    return out


def save_models_checkpoint(path: _PathLike, models: Sequence[SavedModel], metadata: Optional[dict] = None,
                           barrier: Callable[[], None] = _barrier, saver=None) -> Path:
    """Write ``path`` for ``models`` (at least two): each model's directory, then the manifest and
    ``metadata``. Collective over the world: every rank passes the same models in the same order.
    ``saver``: an AsyncCheckpointer writing it in the background (async_save.py)."""
    parts, finish = prepare_models_checkpoint(models, metadata)
    if saver is not None:
        saver.save(path, parts, engines=[m.engine for m in models], finish=finish)
        return Path(path)
    try:
        with atomic_checkpoint_dir(path, barrier) as tmp:
            for sub, prepared in parts:
                write_prepared(tmp / sub, prepared)
            finish(tmp, lambda g: g)
    finally:
        for m in models:
            release_saved_state(m.engine)
    return Path(path)


def prepare_models_checkpoint(models: Sequence[SavedModel], metadata: Optional[dict] = None):
    """Each model's prepared directory ([Note: a save in two halves], prepared.py) and ``finish(tmp, group_of)``,
    rank 0's manifest and ``meta.pt`` once they are written."""
    dirs = model_dirs([m.key for m in models])
    parts = []
    for m in models:
        opt_states = [sharded_optimizer_state(m.engine, opt) for _, opt in m.optimizers] or None
        parts.append((dirs[m.key], prepare_checkpoint(sharded_model_state(m.module, m.engine), m.module, m.engine,
                                                      opt_states, {})))
    stages = {m.engine.config.stage for m in models if m.engine is not None}
    manifest = {"format": MODELS_FORMAT, "version": MODELS_VERSION,
                "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
                "zero_stage": stages.pop() if len(stages) == 1 else None,
                "models": {m.key: {"dir": dirs[m.key], "optimizers": [k for k, _ in m.optimizers]} for m in models}}
    meta = _map_tensors(dict(metadata or {}), lambda t: t.detach().cpu().clone())  # may be written later

    def finish(tmp: Path, group_of) -> None:
        if _rank() != 0:
            return
        torch.save(meta, tmp / META_FILE)
        (tmp / INFO_FILE).write_text(json.dumps(manifest, indent=1))

    return parts, finish


def is_models_checkpoint(path: _PathLike) -> bool:
    """A directory whose ``zero_checkpoint.json`` names the multi-model format (any version)."""
    try:
        return json.loads((Path(path) / INFO_FILE).read_text()).get("format") == MODELS_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_models_manifest(path: _PathLike) -> dict:
    """The manifest of a multi-model checkpoint, each model's directory checked (inside ``path/models``, a
    complete checkpoint) before anything is read from it. One clear error for anything malformed."""
    path = Path(path)
    if not is_models_checkpoint(path):
        raise ValueError(f"{str(path)!r} is not a multi-model checkpoint directory (no {INFO_FILE} with format "
                         f"{MODELS_FORMAT!r}). Allowed: a directory written by fabric.save with several models.")
    manifest = json.loads((path / INFO_FILE).read_text())
    if manifest.get("version") != MODELS_VERSION:
        raise ValueError(f"{str(path)!r}: multi-model checkpoint version {manifest.get('version')!r}; this release "
                         f"reads version {MODELS_VERSION}.")
    models = manifest.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError(f"Corrupt checkpoint {str(path / INFO_FILE)!r}: 'models' must map each saved key to "
                         "{'dir': 'models/<name>', 'optimizers': [keys]}.")
    for key, entry in models.items():
        d = entry.get("dir") if isinstance(entry, dict) else None
        opts = entry.get("optimizers") if isinstance(entry, dict) else None
        parts = d.split("/") if isinstance(d, str) else []
        if (len(parts) != 2 or parts[0] != MODELS_DIR or not _PLAIN.fullmatch(parts[1])
                or not isinstance(opts, list) or not all(isinstance(k, str) for k in opts)):
            raise ValueError(f"Corrupt checkpoint {str(path / INFO_FILE)!r}: the entry of model {key!r} is "
                             f"{entry!r}; allowed: {{'dir': 'models/<plain name>', 'optimizers': [keys]}}.")
        if not is_checkpoint_dir(path / d):
            raise ValueError(f"Incomplete checkpoint {str(path)!r}: the directory of model {key!r} ({d}) is missing "
                             f"or has no {INFO_FILE}. Load an earlier checkpoint.")
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"Incomplete or corrupt checkpoint {str(path)!r}: {META_FILE} is missing.")
    return manifest


def model_checkpoint(path: _PathLike, manifest: dict, key: str, trust_checkpoint: bool = False) -> tuple[Path, dict]:
    """The directory of the model saved under ``key`` (confined to ``path``) and its json (read and checked)."""
    d = confined(path, manifest["models"][key]["dir"], f"the directory of model {key!r}")
    return d, read_info(d, trust_checkpoint)
