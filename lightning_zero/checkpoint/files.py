"""A checkpoint directory on disk: its file names, when it is complete, what interrupted saves leave
behind, and its metadata read back with one clear error for anything malformed.

Design note
-----------
``X`` is only ever created by renaming a finished temporary ``X.zero-tmp`` (or, after an interrupted save,
its complete previous copy, :func:`aside_path`), so a directory that exists under its final name is complete.
An existing ``X`` is replaced by one atomic exchange of the two names (Linux ``renameat2(RENAME_EXCHANGE)``,
:func:`swap_dirs`): no instant exists at which ``X`` is missing. Where the filesystem cannot exchange, the old
``X`` is first renamed aside, to a name Lightning's own ``ckpt_path="last"`` search still finds
(``last.ckpt`` -> ``last.zero-old.ckpt``), so a crash between the two renames never loses the last copy.
Readers check what they rely on -- the json's seal and every listed file's size and CRC-32
(``integrity.py``), every key and type of ``zero_checkpoint.json``, its tensors against the ones DCP's
``.metadata`` stored (read with the restricted unpickler of ``trust.py``), a readable ``meta.pt``, the list
of optimizer state -- before any tensor is touched.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from . import integrity
from .names import DCP_METADATA, FORMAT, INFO_FILE, META_FILE, MODELS_FORMAT, PIPELINE_FORMAT, VERSION  # noqa: F401
from .names import TRAINABLE_ONLY_VERSION
from .trust import UntrustedCheckpointError, load_pickled, read_dcp_metadata, storage_files, trusted

_TMP, _OLD = ".zero-tmp", ".zero-old"
_PathLike = Union[str, os.PathLike]


def aside_path(path: _PathLike) -> Path:
    """Where a save that cannot exchange names moves the previous ``X`` (see the design note): X's stem +
    ``.zero-old`` + X's suffix, e.g. ``last.ckpt`` -> ``last.zero-old.ckpt``, ``mid`` -> ``mid.zero-old``."""
    path = Path(path)
    return path.with_name(path.stem + _OLD + path.suffix)


def final_of_aside(name: str) -> Optional[str]:
    """The final name whose aside copy ``name`` is (the inverse of :func:`aside_path`); None if it is none."""
    p = Path(name)
    if p.stem.endswith(_OLD) and p.suffix:
        return p.stem[: -len(_OLD)] + p.suffix
    if name.endswith(_OLD):
        return name[: -len(_OLD)]
    return None


def swap_dirs(new: _PathLike, final: _PathLike) -> bool:
    """Exchange the names ``new`` and ``final`` atomically; False where this OS or filesystem cannot."""
    import ctypes

    renameat2 = getattr(_libc(), "renameat2", None) if _libc() is not None else None
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(final), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # unsupported here: two renames
        return False
    raise OSError(err, os.strerror(err), os.fspath(final))


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to load (not Linux / macOS)
        return None


def _remove(p: Path) -> None:
    if os.path.islink(p) or p.is_file():
        os.unlink(p)
    elif p.is_dir():
        shutil.rmtree(p)


def tidy_checkpoint_dir(directory: _PathLike) -> None:
    """Undo what interrupted saves left in ``directory`` (rank 0, before a save there).

    X's aside copy (:func:`aside_path`) without ``X`` is the only complete copy of ``X``: renamed back. With ``X`` present it is
    redundant and removed, as is every ``*.zero-tmp`` (a save in progress is collective, so none is)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for entry in sorted(os.listdir(directory)):
        p = directory / entry
        if entry.endswith(_TMP):
            _remove(p)
        elif final_of_aside(entry) is not None:
            final = directory / final_of_aside(entry)
            if os.path.lexists(final):
                _remove(p)
            elif is_checkpoint_dir(p):
                os.rename(p, final)


def resolve_checkpoint_dir(path: _PathLike) -> Path:
    """``path``, or its aside copy when a save was interrupted between its two renames."""
    path = Path(path)
    old = aside_path(path)
    if not os.path.lexists(path) and is_checkpoint_dir(old):
        warnings.warn(f"Checkpoint {str(path)!r} is missing: a save was interrupted while replacing it. "
                      f"Loading the previous, complete checkpoint {str(old)!r} instead.", stacklevel=2)
        return old
    return path


def is_checkpoint_dir(path: _PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / INFO_FILE).is_file()


def read_info(path: _PathLike, trust_checkpoint: bool = False) -> dict:
    """The checkpoint's json, after checking that the directory is complete, unaltered (checksums) and that
    the json agrees with the tensors DCP stored. Clear errors otherwise."""
    path = Path(path)
    if not path.exists():
        hint = ""
        if aside_path(path).is_dir():
            hint = f" A save was interrupted while replacing it: the previous checkpoint is at {aside_path(path).name}."
        raise FileNotFoundError(f"Checkpoint directory not found: {str(path)!r}.{hint}")
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file, not a lightning_zero checkpoint directory.")
    if not (path / INFO_FILE).is_file():
        raise ValueError(
            f"{str(path)!r} is not a complete lightning_zero checkpoint: {INFO_FILE} is missing "
            "(an interrupted save, or not a checkpoint written by ZeroStrategy)."
        )
    try:
        info = json.loads((path / INFO_FILE).read_text())
    except ValueError as err:
        raise ValueError(f"Corrupt checkpoint {str(path)!r}: {INFO_FILE} is not valid json ({err}).") from None
    if not isinstance(info, dict):
        raise ValueError(f"Corrupt checkpoint {str(path)!r}: {INFO_FILE} holds a {type(info).__name__}, "
                         "not a json object.")
    if info.get("format") == MODELS_FORMAT:
        keys = list(info["models"]) if isinstance(info.get("models"), dict) else []
        raise ValueError(f"{str(path)!r} holds {len(keys)} models ({', '.join(map(str, keys))}), each an ordinary "
                         f"checkpoint directory under its 'models/' folder. Allowed: fabric.load(path, {{...}}) under "
                         f"ZeroFabricStrategy, or one model's directory (e.g. `lightning-zero consolidate "
                         f"{str(path / 'models')}/<key> OUT`).")
    if info.get("format") == PIPELINE_FORMAT:
        raise ValueError(f"{str(path)!r} is a pipeline checkpoint (one sharded directory per stage, written by "
                         "ZeroPipelineStrategy(pipeline_parallel_size=P) / PipelineZero.save). Allowed: resume it "
                         "with ZeroPipelineStrategy(pipeline_parallel_size=P), or `lightning-zero consolidate DIR "
                         "OUT.pt` for the uncut model's state dict.")
    if info.get("format") != FORMAT or not isinstance(info.get("version"), int) or info["version"] > TRAINABLE_ONLY_VERSION:
        raise ValueError(f"{str(path)!r}: unsupported checkpoint format {info.get('format')!r} "
                         f"version {info.get('version')!r} (this release reads {FORMAT} <= {TRAINABLE_ONLY_VERSION}).")
    integrity.verify(path, info, INFO_FILE)
    _check_info(info, path / INFO_FILE)
    for name in (DCP_METADATA, META_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"Incomplete or corrupt checkpoint {str(path)!r}: {name} is missing.")
    integrity.check_listed(path, info, [DCP_METADATA, META_FILE], INFO_FILE, "the loader")
    _check_stored(path, info, read_dcp_metadata(path, trust_checkpoint))
    return info


def _check_stored(path: Path, info: dict, md) -> None:
    """The json's tensors are exactly DCP's "model" entries, with the stored shape and dtype: a name dropped
    from the json would otherwise be a silently partial consolidation, an edited shape a raw DCP error."""
    where = f"Corrupt checkpoint {str(path)!r}"
    integrity.check_listed(path, info, storage_files(md), INFO_FILE, f"{DCP_METADATA}")
    stored = {k[len("model."):]: v for k, v in md.state_dict_metadata.items() if k.startswith("model.")}
    spec = info["tensors"]
    unlisted = sorted(set(stored) - set(spec))
    absent = sorted(set(spec) - set(stored))
    wrong = []
    for n in sorted(set(spec) & set(stored)):
        d, m = spec[n], stored[n]
        want = [int(torch.Size(d["shape"]).numel())] if d["flat"] else list(d["shape"])
        if list(m.size) != want or m.properties.dtype != getattr(torch, d["dtype"]):
            wrong.append(f"{n}: {INFO_FILE} {want} {d['dtype']}, stored {list(m.size)} "
                         f"{str(m.properties.dtype).replace('torch.', '')}")
    bad_alias = sorted(a for a, c in info["aliases"].items() if c not in spec)
    bad_order = sorted(n for n in info["order"] if n not in spec and n not in info["aliases"])
    problems = [f"{what}: {v[:10]}" for what, v in (
        (f"stored but not listed in {INFO_FILE}", unlisted), (f"listed in {INFO_FILE} but not stored", absent),
        ("shape or dtype differ", wrong), ("aliases of unknown tensors", bad_alias),
        ("'order' names unknown tensors", bad_order)) if v]
    if problems:
        raise ValueError(f"{where}: {INFO_FILE} does not match the tensors in {DCP_METADATA} -- "
                         + "; ".join(problems) + ". Nothing was read; load an earlier checkpoint.")


_INFO_KEYS = {"world_size": int, "tensors": dict, "aliases": dict, "order": list, "optimizer_state": (dict, type(None))}
_TENSOR_KEYS = {"shape": list, "dtype": str, "flat": bool}


def _check_info(info: dict, file: Path) -> None:
    """Every key the loaders read, with its type: one error naming the file and what is wrong."""
    problems = [f"{k!r} is missing" if k not in info else f"{k!r} is not a {_kind(t)}"
                for k, t in _INFO_KEYS.items() if k not in info or not isinstance(info[k], t)]
    tensors = info.get("tensors") if isinstance(info.get("tensors"), dict) else {}
    for name, d in tensors.items():
        bad = [k for k, t in _TENSOR_KEYS.items() if not isinstance(d, dict) or not isinstance(d.get(k), t)]
        if bad or not isinstance(getattr(torch, d["dtype"], None), torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in d["shape"]):
            problems.append(f"the entry of tensor {name!r} is not {{'shape': [ints], 'dtype': a torch dtype, "
                            f"'flat': bool}} (got {d!r})")
            break
    kinds = info.get("optimizer_state")
    if isinstance(kinds, dict) and not all(isinstance(v, list) for v in kinds.values()):
        problems.append("'optimizer_state' must map each parameter name to a list of state keys")
    if problems:
        raise ValueError(f"Corrupt checkpoint metadata {str(file)!r}: " + "; ".join(problems)
                         + f". Required keys: {', '.join(_INFO_KEYS)} (written by lightning_zero {FORMAT} "
                         f"version {VERSION}).")


def _kind(t) -> str:
    names = [x.__name__.replace("NoneType", "null") for x in (t if isinstance(t, tuple) else (t,))]
    return " or ".join({"dict": "json object", "list": "json list", "int": "integer"}.get(n, n) for n in names)


def read_meta(path: _PathLike, weights_only: Optional[bool] = None, trust_checkpoint: bool = False) -> dict:
    """The checkpoint's ``meta.pt`` (Lightning's loops, callbacks, hparams, ...), read restricted (see
    ``trust.py``) unless trusted. Clear error if unreadable."""
    file = Path(path) / META_FILE
    try:
        meta = load_pickled(file, trusted(trust_checkpoint, weights_only))
    except (FileNotFoundError, UntrustedCheckpointError):
        raise
    except Exception as err:  # a truncated zip archive, a failed unpickle, ...
        raise ValueError(f"Corrupt checkpoint {str(path)!r}: {META_FILE} cannot be read ({type(err).__name__}: "
                         f"{err}). Load an earlier checkpoint.") from err
    if not isinstance(meta, dict):
        raise ValueError(f"Corrupt checkpoint {str(path)!r}: {META_FILE} holds a {type(meta).__name__}, not a dict.")
    return meta


def check_state_entries(path: Path, kinds: Mapping[str, list], managed: Mapping[str, Any],
                        optim_key: str = "optim", trust_checkpoint: bool = False) -> None:
    """The json's list of which parameter has optimizer state must match the tensors DCP stored (under
    ``optim_key``: one per optimizer): a missing entry would otherwise drop that parameter's moments
    without a word."""
    stored: dict[str, set] = {}
    prefix = f"{optim_key}.state."
    for key in read_dcp_metadata(path, trust_checkpoint).state_dict_metadata:
        if key.startswith(prefix):
            name, _, state_key = key[len(prefix):].rpartition(".")
            stored.setdefault(name, set()).add(state_key)
    unknown = sorted(n for n in kinds if n not in managed)
    unlisted = sorted(n for n in stored if n not in kinds)
    if unknown or unlisted:
        what = ([f"{unknown[:10]} listed but not trainable parameters of this model"] if unknown else []) + (
            [f"the optimizer state of {unlisted[:10]} stored but not listed"] if unlisted else [])
        raise ValueError(f"Corrupt checkpoint metadata {str(path / INFO_FILE)!r}: 'optimizer_state' does not "
                         f"match the stored tensors: {'; '.join(what)}. Resuming would lose that state; "
                         "load an earlier checkpoint.")

