"""Consolidation: one full model state dict from a sharded checkpoint directory, in one process.

Design note
-----------
No process group and no optimizer state: each saved tensor is read back whole (DCP's metadata knows
every slice of it) and written straight out, so peak memory stays near the largest tensor (safetensors,
streamed) or the weights (torch.save) -- never weights plus optimizer state. Tied weights are written
under every alias recorded at save time, so the result loads with ``strict=True`` into the plain model.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Optional, Union

import torch

from .format import _dcp_load, read_info, resolve_checkpoint_dir

_PathLike = Union[str, "os.PathLike[str]"]

# -- consolidation (one process, no process group) ----------------------------------------------------------------
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def consolidate(ckpt_dir: _PathLike, out_path: _PathLike, dtype: torch.dtype = torch.float32) -> dict:
    """Write the full model state dict (floating tensors in ``dtype``) loadable with ``strict=True``.

    ``out_path`` ending in ``.safetensors`` is written in safetensors format, one tensor at a time (peak
    memory: the largest tensor); anything else with ``torch.save`` (peak: the weights). Optimizer state is
    never read. Tied weights are re-emitted under every alias. Returns {"tensors": n, "bytes": weights}.
    """
    path, out = resolve_checkpoint_dir(ckpt_dir), Path(out_path)
    info = read_info(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:  # a corrupt input fails half-way: leave no partial output behind
        result = _write(path, info, out, tmp, dtype)
    finally:
        if tmp.exists():
            tmp.unlink()
    return result


def _empty(spec: dict, name: str, dtype) -> torch.Tensor:
    d = spec[name]
    dt = getattr(torch, d["dtype"])
    dt = dtype if dt.is_floating_point and dtype is not None else dt
    return torch.empty(int(torch.Size(d["shape"]).numel()) if d["flat"] else d["shape"], dtype=dt)


def full_model_state(path: Path, info: dict, dtype: Optional[torch.dtype] = torch.float32) -> dict:
    """Every tensor of the checkpoint whole, under every name (aliases too), in module order; floating
    tensors in ``dtype`` (None: as saved). Reads in this process only (no collective)."""
    spec = info["tensors"]
    targets = {n: _empty(spec, n, dtype) for n in spec}
    _dcp_load({"model": targets}, path, no_dist=True)
    return {n: targets[info["aliases"].get(n, n)].view(spec[info["aliases"].get(n, n)]["shape"])
            for n in info["order"] if n in spec or n in info["aliases"]}


def _write(path: Path, info: dict, out: Path, tmp: Path, dtype) -> dict:
    spec = info["tensors"]

    def load(name):
        t = _empty(spec, name, dtype)
        _dcp_load({"model": {name: t}}, path, no_dist=True)
        return t.view(spec[name]["shape"])

    order = [n for n in info["order"] if n in spec or n in info["aliases"]]
    total = 0
    if out.suffix == ".safetensors":
        header, offset = {}, 0
        for n in order:
            d = spec[info["aliases"].get(n, n)]
            dt = getattr(torch, d["dtype"])
            dt = dtype if dt.is_floating_point else dt
            nbytes = int(torch.Size(d["shape"]).numel()) * dt.itemsize
            header[n] = {"dtype": _ST_DTYPES[dt], "shape": d["shape"], "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for n in order:
                t = load(info["aliases"].get(n, n)).contiguous()
                total += t.numel() * t.element_size()
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                del t
    else:
        sd = full_model_state(path, info, dtype)
        total = sum(t.numel() * t.element_size() for n, t in sd.items() if n not in info["aliases"])
        torch.save(sd, tmp)
    os.replace(tmp, out)
    return {"tensors": len(order), "bytes": total}


