"""Reading a checkpoint directory as untrusted input: nothing in it may run code, nothing it names may lie
outside it.

Design note
-----------
A checkpoint holds two pickles. ``meta.pt`` (Lightning's loops, callbacks, hparams, ...) is read with
``torch.load(weights_only=True)``, which rebuilds tensors, containers and primitives only, plus the few
harmless classes of :data:`META_SAFE_GLOBALS` that a Lightning checkpoint's metadata legitimately holds.
DCP's ``.metadata`` is a plain pickle that ``FileSystemReader.read_metadata`` would ``pickle.load``; it is
read here by :class:`_DCPUnpickler`, which resolves only DCP's metadata dataclasses, ``torch.Size``, dtypes,
layouts and paths -- anything else (``os.system``, ``builtins.eval``, ...) is refused before it is called.
:class:`ConfinedReader` is DCP's own ``FileSystemReader`` handed that metadata, so the tensors still load
through DCP's public reader. The metadata is checked too: DCP unpickles a ``BytesStorageMetadata`` entry's
bytes with ``torch.load(weights_only=False)``, and we never write one, so one is refused; every storage
file it names must lie inside the directory.

A user who trusts a checkpoint of an older build (or one whose hparams hold other objects, e.g. a
transformers config) opts in explicitly: ``trust_checkpoint=True`` in Python, ``--trust-checkpoint`` on the
command line. Then both pickles are read as torch and DCP would read them.
"""

from __future__ import annotations

import argparse
import builtins
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md

from .names import DCP_METADATA

_PathLike = Union[str, os.PathLike]

OPT_IN = "trust_checkpoint=True (Python API, ZeroStrategy / ZeroFabricStrategy) or --trust-checkpoint (CLI)"


class UntrustedCheckpointError(ValueError):
    """A checkpoint file holds something that would run code (or read outside the directory) when loaded."""


def refusal(file: _PathLike, what: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"Refusing to load {str(file)!r}: {what}. Loading it could execute code from the checkpoint. If you "
        f"trust who wrote it (e.g. a checkpoint of an earlier lightning_zero build), opt in with {OPT_IN}; "
        "see docs/security.md.")


# -- meta.pt ---------------------------------------------------------------------------------------------------
# constructing these runs no code of the file's choosing: paths and plain namespaces of hparams (Lightning
# itself stores hparams as a plain dict, so no Lightning class is needed; checkpoint/ imports no Lightning)
META_SAFE_GLOBALS: list = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath,
                           pathlib.PureWindowsPath, argparse.Namespace]


def load_pickled(file: _PathLike, trust_checkpoint: bool = False) -> Any:
    """``torch.load`` of a checkpoint's pickle (``meta.pt``) on the CPU; restricted unless trusted."""
    if trusted(trust_checkpoint):
        return torch.load(file, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(META_SAFE_GLOBALS):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        text = str(err)
        if "weights_only" not in text and "Weights only" not in text:
            raise
        found = re.search(r"GLOBAL ([\w.]+)", text)  # torch's line naming the refused global
        what = f"global {found.group(1)}" if found else text.strip().splitlines()[-1][:300]
        raise refusal(file, f"it holds an object the restricted unpickler does not admit ({what})") from None


# -- DCP .metadata -------------------------------------------------------------------------------------------
def _dcp_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        if hasattr(dcp_md, name):
            allowed[(dcp_md.__name__, name)] = getattr(dcp_md, name)
    allowed[(_StorageInfo.__module__, "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a lookup by name
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
    for name in ("set", "frozenset", "list", "dict", "tuple", "int", "float", "str", "bytes", "bool", "complex"):
        allowed[("builtins", name)] = getattr(builtins, name)
    return allowed


class _DCPUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's metadata is made of; any other global is refused unresolved."""

    _allowed: dict = {}

    def find_class(self, module: str, name: str) -> Any:
        if not _DCPUnpickler._allowed:
            _DCPUnpickler._allowed = _dcp_classes()
        try:
            return _DCPUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not a DCP metadata type") from None


def confined(directory: _PathLike, relative: Any, what: str) -> Path:
    """``directory / relative``, refused unless it is a relative path that stays inside ``directory``
    (symlinks resolved): a checkpoint may name only its own files."""
    base = Path(directory).resolve()
    if not isinstance(relative, str) or not relative or os.path.isabs(relative) or "\x00" in relative:
        raise refusal(directory, f"{what} {relative!r} is not a relative path inside the checkpoint")
    target = (base / relative).resolve()
    if target == base or not target.is_relative_to(base):
        raise refusal(directory, f"{what} {relative!r} points outside the checkpoint directory")
    return base / relative


def read_dcp_metadata(directory: _PathLike, trust_checkpoint: bool = False) -> Any:
    """DCP's ``Metadata`` of ``directory``, read with the restricted unpickler and checked: no pickled
    (bytes) entries, every storage file inside the directory. Clear errors for a truncated or foreign file."""
    file = Path(directory) / DCP_METADATA
    if trusted(trust_checkpoint):
        return FileSystemReader(str(directory)).read_metadata()
    try:
        with open(file, "rb") as f:
            md = _DCPUnpickler(f).load()
    except FileNotFoundError:
        raise FileNotFoundError(f"Incomplete or corrupt checkpoint {str(directory)!r}: {DCP_METADATA} is missing.") \
            from None
    except pickle.UnpicklingError as err:
        if "is not a DCP metadata type" in str(err):
            raise refusal(file, str(err)) from None
        raise ValueError(f"Corrupt checkpoint {str(directory)!r}: {DCP_METADATA} cannot be read ({err}).") from None
    except Exception as err:  # truncated (EOFError), a dataclass rebuilt from garbage, ...
        raise ValueError(f"Corrupt checkpoint {str(directory)!r}: {DCP_METADATA} cannot be read "
                         f"({type(err).__name__}: {err}).") from None
    _check_dcp_metadata(md, directory, file)
    return md


def _check_dcp_metadata(md: Any, directory: _PathLike, file: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise ValueError(f"Corrupt checkpoint {str(directory)!r}: {file.name} holds a {type(md).__name__}, "
                         "not DCP metadata.")
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, dcp_md.BytesStorageMetadata):
            raise refusal(file, f"entry {key!r} is a pickled object, which DCP would unpickle unrestricted "
                          "(lightning_zero writes tensors only)")
        if not isinstance(entry, dcp_md.TensorStorageMetadata):
            raise ValueError(f"Corrupt checkpoint {str(directory)!r}: {file.name} entry {key!r} is a "
                             f"{type(entry).__name__}, not tensor metadata.")
    storage = md.storage_data if isinstance(md.storage_data, dict) else None
    if storage is None:
        raise ValueError(f"Corrupt checkpoint {str(directory)!r}: {file.name} has no storage index.")
    for info in storage.values():
        if not isinstance(info, _StorageInfo) or not all(isinstance(getattr(info, k, None), int) and
                                                         getattr(info, k) >= 0 for k in ("offset", "length")):
            raise ValueError(f"Corrupt checkpoint {str(directory)!r}: {file.name} holds a malformed storage entry.")
        if info.transform_descriptors:
            raise refusal(file, f"storage entry of {info.relative_path!r} asks for load transforms "
                          f"{list(info.transform_descriptors)!r}; lightning_zero writes none")
        confined(directory, info.relative_path, f"{file.name} storage file")


def storage_files(md: Any) -> set[str]:
    """The files DCP's metadata reads tensors from (relative to the checkpoint directory)."""
    return {info.relative_path for info in md.storage_data.values()}


class ConfinedReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading ``metadata`` (already read and checked by
    :func:`read_dcp_metadata`) instead of unpickling ``.metadata`` itself."""

    def __init__(self, path: _PathLike, metadata: Any) -> None:
        super().__init__(str(path))
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        md = self._checked
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def trusted(trust_checkpoint: bool = False, weights_only: Any = None) -> bool:
    """Whether to read a checkpoint unrestricted: ``trust_checkpoint``, or
    torch's / Lightning's own opt-in ``weights_only=False``; an explicit ``weights_only=True`` always restricts."""
    return weights_only is False or (bool(trust_checkpoint) and weights_only is not True)
