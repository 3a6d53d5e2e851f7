"""Consolidation: one full model state dict from a sharded checkpoint directory, in one process.

Design note
-----------
No process group and no optimizer state: each saved tensor is read back whole (DCP's metadata knows
every slice of it) and written straight out, so peak memory stays near the largest tensor (safetensors,
streamed in small batches) or the weights (torch.save) -- never weights plus optimizer state. Tied weights are written
under every alias recorded at save time, so the result loads with ``strict=True`` into the plain model.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from . import trainable_only as TO
from .format import _dcp_load, read_info, resolve_checkpoint_dir

_PathLike = Union[str, "os.PathLike[str]"]

# -- consolidation (one process, no process group) ----------------------------------------------------------------
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


_Progress = Optional[Callable[[int], None]]
_STREAM_BATCH_BYTES = 8 * 2**20  # one DCP read per batch: few reads, peak memory near the largest tensor


def consolidate(ckpt_dir: _PathLike, out_path: _PathLike, dtype: torch.dtype = torch.float32,
                progress: _Progress = None, trust_checkpoint: bool = False) -> dict:
    """Write the full model state dict (floating tensors in ``dtype``) loadable with ``strict=True``.

    ``out_path`` ending in ``.safetensors`` is written in safetensors format, streamed in small batches
    (peak memory: about the largest tensor); anything else with ``torch.save`` (peak: the weights).
    Optimizer state is never read. Tied weights are re-emitted under every alias. ``progress(nbytes)`` is
    called as tensors are read. The directory is verified first (checksums, the json against DCP's
    metadata: ``files.read_info``), as the Trainer's load does. Returns {"tensors": n, "bytes": weights}.
    """
    path, out = resolve_checkpoint_dir(ckpt_dir), Path(out_path)
    info = read_info(path, trust_checkpoint)
    if out.suffix == ".safetensors" and TO.entry_of(info) is None:  # trainable-only: the base is not in DCP
        order = [n for n in info["order"] if n in info["tensors"] or n in info["aliases"]]
        return write_safetensors(out, path, info, {n: n for n in order}, dtype, progress, trust_checkpoint)
    with atomic_output(out) as tmp:
        sd = full_model_state(path, info, dtype, progress, trust_checkpoint)
        save_state(sd, tmp, out.suffix == ".safetensors")
    return {"tensors": len(sd), "bytes": sum(t.numel() * t.element_size() for n, t in sd.items()
                                             if n not in TO.full_names(info)[1])}


def save_state(sd: Mapping[str, torch.Tensor], out: Path, safetensors: bool) -> None:
    """A state dict into ``out``: safetensors (tied tensors written once per name) or ``torch.save``."""
    if not safetensors:
        torch.save(dict(sd), out)
        return
    from safetensors.torch import save_file  # transformers' dependency, as in engine/stage3/pretrained_source.py

    seen: set = set()
    flat = {}
    for n, t in sd.items():
        key = (t.data_ptr(), t.numel())
        flat[n] = t.contiguous().clone() if key in seen else t.contiguous()
        seen.add(key)
    save_file(flat, str(out), metadata={"format": "pt"})


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """A temporary beside ``out``, renamed onto it on success; a failure (a corrupt input half-way) leaves
    no partial output behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def _dtype_of(spec: dict, name: str, dtype) -> torch.dtype:
    dt = getattr(torch, spec[name]["dtype"])
    return dtype if dt.is_floating_point and dtype is not None else dt


def _empty(spec: dict, name: str, dtype) -> torch.Tensor:
    d = spec[name]
    return torch.empty(int(torch.Size(d["shape"]).numel()) if d["flat"] else d["shape"],
                       dtype=_dtype_of(spec, name, dtype))


def stored_nbytes(info: dict, dtype: Optional[torch.dtype] = torch.float32) -> int:
    """Bytes of the stored tensors (each once, aliases not counted) in ``dtype``: a progress bar's total."""
    spec = info["tensors"]
    return sum(int(torch.Size(d["shape"]).numel()) * _dtype_of(spec, n, dtype).itemsize for n, d in spec.items())


def iter_stored_tensors(path: Path, info: dict, names: Sequence[str], dtype: Optional[torch.dtype] = torch.float32,
                        progress: _Progress = None, batch_bytes: int = _STREAM_BATCH_BYTES,
                        trust_checkpoint: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for the stored ``names`` (no aliases), in order, read in batches of about
    ``batch_bytes`` (one DCP read each, in this process only: no collective)."""
    spec = info["tensors"]
    batch: dict[str, torch.Tensor] = {}

    def flush():
        _dcp_load({"model": batch}, path, no_dist=True, trust_checkpoint=trust_checkpoint)
        for n, t in batch.items():
            if progress is not None:
                progress(t.numel() * t.element_size())
            yield n, t.view(spec[n]["shape"])
        batch.clear()

    size = 0
    for n in names:
        batch[n] = _empty(spec, n, dtype)
        size += batch[n].numel() * batch[n].element_size()
        if size >= batch_bytes:
            yield from flush()
            size = 0
    if batch:
        yield from flush()


def full_model_state(path: Path, info: dict, dtype: Optional[torch.dtype] = torch.float32,
                     progress: _Progress = None, trust_checkpoint: bool = False) -> dict:
    """Every tensor of the checkpoint whole, under every name (aliases too), in module order; floating
    tensors in ``dtype`` (None: as saved). Reads in this process only (no collective)."""
    spec = info["tensors"]
    loaded = dict(iter_stored_tensors(path, info, list(spec), dtype, progress, batch_bytes=2**62,
                                      trust_checkpoint=trust_checkpoint))
    # a trainable-only checkpoint: the frozen base from its recorded source, hash-checked
    loaded.update(TO.read_base(info, dtype, trust_checkpoint, lambda src: full_model_state(
        resolve_checkpoint_dir(src), read_info(resolve_checkpoint_dir(src), trust_checkpoint), dtype,
        trust_checkpoint=trust_checkpoint)))
    order, aliases = TO.full_names(info)
    return {n: loaded[aliases.get(n, n)] for n in order if aliases.get(n, n) in loaded}


def write_safetensors(out: Path, path: Path, info: dict, names: Mapping[str, str], dtype: Optional[torch.dtype],
                      progress: _Progress = None, trust_checkpoint: bool = False) -> dict:
    """``out`` in safetensors format, streamed: ``names`` maps each name written to its checkpoint name (an
    alias or a stored tensor), in the order written. Returns {"tensors": n, "bytes": data written}."""
    spec, aliases = info["tensors"], info["aliases"]
    src = {new: aliases.get(old, old) for new, old in names.items()}
    header, offset = {}, 0
    for new, stored in src.items():
        dt = _dtype_of(spec, stored, dtype)
        nbytes = int(torch.Size(spec[stored]["shape"]).numel()) * dt.itemsize
        header[new] = {"dtype": _ST_DTYPES[dt], "shape": spec[stored]["shape"], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    # a stored tensor written under two names (tied weights) is read once per name: streaming keeps no cache
    with atomic_output(out) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        written = 0
        for (new, stored), (_, t) in zip(src.items(), _each(path, info, list(src.values()), dtype, progress,
                                                                     trust_checkpoint)):
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            written += t.numel() * t.element_size()
    return {"tensors": len(src), "bytes": written}


def _each(path: Path, info: dict, stored: list[str], dtype, progress: _Progress,
          trust_checkpoint: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``stored`` names in order, repeats allowed (batches hold distinct names)."""
    i = 0
    while i < len(stored):
        j, seen = i, set()
        while j < len(stored) and stored[j] not in seen:
            seen.add(stored[j])
            j += 1
        yield from iter_stored_tensors(path, info, stored[i:j], dtype, progress, trust_checkpoint=trust_checkpoint)
        i = j
