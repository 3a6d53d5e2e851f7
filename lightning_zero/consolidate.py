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
from typing import Union

import torch

from .checkpoint import read_info, _dcp_load  # noqa: F401

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
    path, out = Path(ckpt_dir), Path(out_path)
    info = read_info(path)
    spec = info["tensors"]

    def empty(name):
        d = spec[name]
        dt = getattr(torch, d["dtype"])
        dt = dtype if dt.is_floating_point else dt
        return torch.empty(int(torch.Size(d["shape"]).numel()) if d["flat"] else d["shape"], dtype=dt)

    def load(name):
        t = empty(name)
        _dcp_load({"model": {name: t}}, path)
        return t.view(spec[name]["shape"])

    order = [n for n in info["order"] if n in spec or n in info["aliases"]]
    total = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
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
        sd: dict[str, torch.Tensor] = {}
        targets = {n: empty(n) for n in spec}
        _dcp_load({"model": targets}, path)
        for n in order:
            c = info["aliases"].get(n, n)
            sd[n] = targets[c].view(spec[c]["shape"])
            total += sd[n].numel() * sd[n].element_size() if n == c else 0
        torch.save(sd, tmp)
    os.replace(tmp, out)
    return {"tensors": len(order), "bytes": total}


