"""A pretrained checkpoint read slice by slice: each rank reads only the rows covering the shards it keeps.

Design note
-----------
A stage-3 rank owns a contiguous slice ``[lo, hi)`` of every *flattened* parameter (engine/layout/sharding.py
``ShardSpec``). For a tensor of shape ``(d0, d1, ...)`` that slice lies in rows ``lo // R .. ceil(hi / R)`` of
its first dimension (``R = d1 * d2 * ...``): those rows are read -- safetensors' ``get_slice`` reads only the
requested rows from the file, a ``torch.load(mmap=True)`` state dict only touches their pages -- and cut to
the slice, in blocks of at most ``READ_BLOCK_BYTES`` (1 MiB, or one row). So loading holds this rank's shards
plus one block in flight, never the model (``LoadStats`` counts it; tests/test_pretrained_load.py checks the
bound).

Sources, as ``from_pretrained`` finds them in a directory: ``model.safetensors``,
``model.safetensors.index.json`` (sharded), ``pytorch_model.bin`` / ``pytorch_model.bin.index.json``; or one
file: ``.safetensors``, or a ``.bin`` / ``.pt`` state dict (``lightning-zero consolidate`` output; ``{"state_dict":
...}`` too). ``.bin`` / ``.pt`` are read with ``torch.load(weights_only=True, mmap=True)``: a checkpoint is
untrusted input. safetensors is transformers' dependency, not ours: imported when a safetensors file is opened.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

_PathLike = Union[str, "os.PathLike[str]"]
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class LoadStats:
    """Parameter bytes this rank holds while loading: its shards so far plus the rows in flight."""

    shard_bytes: int = 0
    inflight_bytes: int = 0
    peak_bytes: int = 0
    read_bytes: int = 0  # bytes of rows read from the checkpoint (>= the shards: whole first-dim rows)

    def hold(self, n: int) -> None:
        self.inflight_bytes += n
        self.read_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.shard_bytes + self.inflight_bytes)

    def drop(self, n: int) -> None:
        self.inflight_bytes -= n

    def keep(self, n: int) -> None:
        self.shard_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.shard_bytes + self.inflight_bytes)


class PretrainedSource:
    """The tensors of a checkpoint file or directory by name, each readable as a flat element range."""

    def __init__(self, path: _PathLike) -> None:
        self.path = Path(path)
        self.stats = LoadStats()
        self._files: dict[str, Path] = {}  # tensor name -> file
        self._open: dict[Path, object] = {}
        for f in _checkpoint_files(self.path):
            for name in self._handle(f).keys():
                self._files.setdefault(name, f)

    def __repr__(self) -> str:
        return f"PretrainedSource({str(self.path)!r}, {len(self._files)} tensors)"

    def keys(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def _handle(self, f: Path):
        if f not in self._open:
            if f.suffix == ".safetensors":
                from safetensors import safe_open  # transformers' dependency (see the design note)

                self._open[f] = _SafeTensorsFile(safe_open(str(f), framework="pt", device="cpu"))
            else:
                self._open[f] = _TorchFile(f)
        return self._open[f]

    def shape(self, name: str) -> torch.Size:
        return self._handle(self._files[name]).shape(name)

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of the flattened tensor ``name`` into ``out`` (1-D, ``hi - lo`` long, cast to its
        dtype), reading only the first-dimension rows that cover them."""
        if hi <= lo:
            return
        handle = self._handle(self._files[name])
        shape = handle.shape(name)
        if len(shape) == 0:
            self._copy(handle.rows(name, None, None).reshape(-1), out)
            return
        row = max(1, int(torch.Size(shape[1:]).numel()))
        # in blocks of rows: in flight at most READ_BLOCK_BYTES (or one row), not this rank's whole slice
        block = max(1, self.READ_BLOCK_BYTES // (row * max(1, self.dtype(name).itemsize)))
        r, done = lo // row, 0
        while done < hi - lo:
            rows = handle.rows(name, r, min(r + block, -(-hi // row))).reshape(-1)
            start = lo + done - r * row
            n = min(rows.numel() - start, hi - lo - done)
            self._copy(rows, out[done: done + n], start)
            done, r = done + n, r + block

    READ_BLOCK_BYTES = 2**20

    def _copy(self, rows: torch.Tensor, out: torch.Tensor, start: int = 0) -> None:
        held = rows.numel() * rows.element_size()
        self.stats.hold(held)
        out.copy_(rows[start: start + out.numel()])
        self.stats.drop(held)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor (buffers, which every rank keeps whole; modules loaded in place)."""
        shape = self.shape(name)
        out = torch.empty(shape, dtype=self.dtype(name))
        self.read_into(name, 0, out.numel(), out.view(-1))
        return out

    def dtype(self, name: str) -> torch.dtype:
        return self._handle(self._files[name]).dtype(name)


class _SafeTensorsFile:
    _DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}

    def __init__(self, f) -> None:
        self.f = f

    def keys(self):
        return self.f.keys()

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.f.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return self._DTYPES[self.f.get_slice(name).get_dtype()]

    def rows(self, name: str, r0: Optional[int], r1: Optional[int]) -> torch.Tensor:
        if r0 is None:
            return self.f.get_tensor(name)
        return self.f.get_slice(name)[r0:r1]  # reads only these rows from the file


class _TorchFile:
    def __init__(self, f: Path) -> None:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # a legacy (non-zip) file cannot be memory-mapped
            raise ValueError(f"{f} cannot be read with torch.load(weights_only=True, mmap=True) ({e}). Allowed: "
                             "a safetensors file or a zip-format state dict (torch.save since 1.6).") from e
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{f} holds no state dict of tensors. Allowed: a {{name: tensor}} dict "
                             "(save_pretrained, lightning-zero consolidate) or {'state_dict': {name: tensor}}.")
        self.state = state

    def keys(self):
        return self.state.keys()

    def shape(self, name: str) -> torch.Size:
        return self.state[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    def rows(self, name: str, r0: Optional[int], r1: Optional[int]) -> torch.Tensor:
        t = self.state[name]
        return t if r0 is None else t[r0:r1]  # a view of the mapped file: only these pages are read


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in (".safetensors", ".bin", ".pt", ".pth", ".ckpt"):
            raise ValueError(f"{path}: unknown checkpoint file type. Allowed: .safetensors, .bin, .pt, .pth.")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"No pretrained checkpoint at {path}. Allowed: a save_pretrained directory "
                                f"({', '.join(_SINGLES + _INDEXES)}) or one state dict file.")
    for index in _INDEXES:
        if (path / index).is_file():
            weight_map = json.loads((path / index).read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{path / index} has no weight_map.")
            files = []
            for name in dict.fromkeys(weight_map.values()):
                f = (path / name).resolve()
                if f.parent != path.resolve() or not f.is_file():  # untrusted: stay inside the directory
                    raise ValueError(f"{path / index} names {name!r}, not a file in {path}.")
                files.append(f)
            return files
    for single in _SINGLES:
        if (path / single).is_file():
            return [path / single]
    raise FileNotFoundError(f"{path} holds none of {', '.join(_SINGLES + _INDEXES)} (what save_pretrained writes).")
