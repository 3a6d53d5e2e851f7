"""Lightning's own loaders reading lightning_zero checkpoint directories.

Design note
-----------
``LightningModule.load_from_checkpoint(DIR)`` reads through ``saving.pl_load`` (a ``torch.load``) whatever
the strategy, and Lightning offers no extension point there: ``import lightning_zero`` wraps it, acting on
lightning_zero directories only and leaving every other path to Lightning. The directory is consolidated on
the fly, weights only, placed by ``map_location`` as ``torch.load`` places a tensor saved on the CPU
(Lightning's default is a callable that returns None for it: "leave it where it is").

The other strategies read through their ``CheckpointIO``, a public seam: ``ZeroCheckpointIO``
(checkpoint_io.py) is the one to pass them. ``ckpt_path="last"`` after a save interrupted between its renames
needs no wrapper either: the save exchanges names atomically, or moves the previous copy to a name
Lightning's own search finds (checkpoint/files.py).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint.files import META_FILE
from ..checkpoint.format import INFO_FILE, aside_path, _dcp_load, _optim_key, is_checkpoint_dir, read_info, read_meta, resolve_checkpoint_dir
from ..checkpoint.consolidate import full_model_state
from ..checkpoint.local_copies import is_remote_checkpoint, local_checkpoint_copy
from ..checkpoint.location import is_remote
from ..checkpoint.trust import read_dcp_metadata, trusted


def load_as_lightning_checkpoint(path, weights_only: Optional[bool] = None, optimizer: bool = True,
                                 dtype: Optional[torch.dtype] = None, progress=None, map_location: Any = None,
                                 trust_checkpoint: bool = False) -> dict[str, Any]:
    """A sharded directory as the dict Lightning's DDP would have saved: full ``state_dict`` (floating
    tensors in ``dtype``; None: as saved, the fp32 masters) and position-keyed ``optimizer_states``; the
    loops, callbacks, schedulers, hparams, ``pytorch-lightning_version`` as saved. ``optimizer=False``: the
    weights-only checkpoint ``ModelCheckpoint(save_weights_only=True)`` writes (no optimizer state read).
    ``map_location``: any form ``torch.load`` takes (see :func:`apply_map_location`). Its pickles are read
    restricted unless ``trust_checkpoint`` or ``weights_only=False`` (checkpoint/trust.py)."""
    path = resolve_checkpoint_dir(path)
    trust = trusted(trust_checkpoint, weights_only)
    info = read_info(path, trust)
    checkpoint = read_meta(path, trust_checkpoint=trust)
    checkpoint["state_dict"] = full_model_state(path, info, dtype=dtype, progress=progress, trust_checkpoint=trust)
    saved = checkpoint.get("optimizer_states")
    if not optimizer:
        for key in ("optimizer_states", "lr_schedulers"):  # as Lightning's own weights-only dump
            checkpoint.pop(key, None)
    elif info["optimizer_state"] is not None and saved:
        checkpoint["optimizer_states"] = [_positional_optimizer_state(path, info, opt_meta, k, trust)
                                          for k, opt_meta in enumerate(saved)]
    return apply_map_location(checkpoint, map_location)


def write_lightning_checkpoint(ckpt_dir, out, optimizer: bool = False, dtype: Optional[torch.dtype] = torch.float32,
                               progress=None, trust_checkpoint: bool = False) -> dict[str, Any]:
    """``lightning-zero consolidate DIR OUT --lightning``: the directory as one Lightning checkpoint file
    that ``LightningModule.load_from_checkpoint`` and (with ``optimizer=True``) any strategy's
    ``fit(ckpt_path=...)`` accept. Returns {"tensors", "bytes", "optimizer"}."""
    from ..checkpoint.consolidate import atomic_output

    checkpoint = load_as_lightning_checkpoint(ckpt_dir, optimizer=optimizer, dtype=dtype, progress=progress,
                                              trust_checkpoint=trust_checkpoint)
    if "pytorch-lightning_version" not in checkpoint:
        raise ValueError(f"{str(ckpt_dir)!r} was not saved by a Lightning Trainer (its {META_FILE} has no "
                         "'pytorch-lightning_version'): write a plain state dict with `lightning-zero consolidate "
                         "DIR OUT.pt` instead.")
    with atomic_output(Path(out)) as tmp:
        torch.save(checkpoint, tmp)
    sd = checkpoint["state_dict"]
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in sd.values()}  # tied names share one tensor
    return {"tensors": len(sd), "bytes": sum(unique.values()),
            "optimizer": "optimizer_states" in checkpoint}


def _positional_optimizer_state(path: Path, info: dict, opt_meta: dict, index: int = 0,
                                trust_checkpoint: bool = False) -> dict:
    """Optimizer ``index``'s name-keyed flat shards -> torch's ``Optimizer.state_dict()`` layout (state by
    position, tensors shaped like the parameter). Positions follow the saved groups, i.e. the user's order of
    trainable parameters; each optimizer numbers its own parameters from 0, as torch does."""
    stored = read_dcp_metadata(path, trust_checkpoint).state_dict_metadata
    more = info.get("more_optimizer_states") or []
    kinds = (info["optimizer_state"] if index == 0 else more[index - 1] if index - 1 < len(more) else None) or {}
    key = _optim_key(index)
    missing = sorted(f"{n}.{k}" for n, keys in kinds.items() for k in keys if f"{key}.state.{n}.{k}" not in stored)
    if missing:
        raise ValueError(f"Corrupt checkpoint {str(path)!r}: its {INFO_FILE} lists optimizer state that is not "
                         f"stored: {missing[:10]}.")
    targets = {n: {k: torch.empty(tuple(stored[f"{key}.state.{n}.{k}"].size),
                                  dtype=stored[f"{key}.state.{n}.{k}"].properties.dtype) for k in keys}
               for n, keys in kinds.items()}
    if targets:
        _dcp_load({key: {"state": targets}}, path, no_dist=True, trust_checkpoint=trust_checkpoint)
    state, groups, pos = {}, [], 0
    layout = opt_meta.get("layout") or [g["params"] for g in opt_meta["param_groups"]]
    for g, names in zip(opt_meta["param_groups"], layout):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(pos, pos + len(names)))})
        for i, n in enumerate(names, start=pos):
            if n is None:  # frozen: numbered, never stepped, no state
                continue
            shape = info["tensors"][n]["shape"]
            st = {k: (v.view(shape) if v.dim() == 1 and v.numel() == torch.Size(shape).numel() else v)
                  for k, v in targets.get(n, {}).items()}
            st.update(opt_meta.get("nontensor_state", {}).get(n, {}))
            if st:
                state[i] = st
        pos += len(names)
    return {"state": state, "param_groups": groups}


def is_zero_checkpoint(path) -> bool:
    """A lightning_zero checkpoint directory (or the aside copy an interrupted save left of it), local or at a URL."""
    if is_remote(path):
        return is_remote_checkpoint(path)
    path = Path(path)
    return is_checkpoint_dir(path) or (not os.path.lexists(path) and is_checkpoint_dir(aside_path(path)))


def _wrap_pl_load(saving) -> None:
    """``LightningModule.load_from_checkpoint(DIR)`` reads through ``saving.pl_load`` (a ``torch.load``):
    a sharded directory is consolidated on the fly, as for ``TorchCheckpointIO`` above."""
    original = saving.pl_load
    if getattr(original, "_lightning_zero", False):
        return

    @functools.wraps(original)
    def pl_load(path_or_url, map_location=None, weights_only=None):
        if isinstance(path_or_url, (str, os.PathLike)) and is_zero_checkpoint(path_or_url):
            with local_checkpoint_copy(path_or_url) as local:  # a URL: downloaded, read, removed
                return load_as_lightning_checkpoint(local, weights_only, optimizer=False, map_location=map_location)
        if isinstance(path_or_url, (str, os.PathLike)) and os.path.isdir(path_or_url):
            raise IsADirectoryError(f"{str(path_or_url)!r} is a directory but not a complete lightning_zero "
                                    f"checkpoint ({INFO_FILE} is missing); a lightning_zero directory converts with "
                                    "`lightning-zero consolidate DIR OUT.ckpt --lightning`.")
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._lightning_zero = True
    saving.pl_load = pl_load


def apply_map_location(obj: Any, map_location: Any) -> Any:
    """Every tensor in ``obj`` (read on the CPU) placed as ``torch.load(..., map_location)`` places a tensor
    saved on the CPU: None leaves it; a string or ``torch.device`` moves it there; a dict maps the location
    "cpu" (absent: stays); a callable gets ``(storage, "cpu")`` and returns a storage, or None for "leave
    it" (Lightning's default). Tensors shared under several names (tied weights) stay shared."""
    if map_location is None:
        return obj
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def walk(x: Any) -> Any:
        if torch.is_tensor(x):
            if id(x) not in memo:
                memo[id(x)] = (x, _placed(x, map_location))
            return memo[id(x)][1]
        if isinstance(x, dict):
            return type(x)((k, walk(v)) for k, v in x.items())
        if type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)


def _placed(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    if isinstance(map_location, (str, torch.device)):
        return t.to(map_location)
    if isinstance(map_location, dict):
        return t.to(map_location.get("cpu", "cpu"))
    if not callable(map_location):
        raise TypeError(f"map_location={map_location!r}; allowed: None, a device string, a torch.device, a dict of "
                        "locations or a callable(storage, location) -> storage or None (as torch.load).")
    storage = map_location(t.untyped_storage(), "cpu")
    if storage is None:
        return t
    if torch.is_tensor(storage):  # a callable written for tensors
        return storage
    if isinstance(storage, torch.TypedStorage):
        storage = storage.untyped()
    if not isinstance(storage, torch.UntypedStorage):
        raise TypeError(f"map_location returned a {type(storage).__name__}; allowed: a storage or None (as torch.load).")
    return torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def install() -> None:
    """Wrap Lightning's ``load_from_checkpoint`` reader (the ``lightning`` distribution only)."""
    from lightning.pytorch.core import saving

    _wrap_pl_load(saving)
