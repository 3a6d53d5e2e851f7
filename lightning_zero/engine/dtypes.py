"""The dtype names users write in knobs ("fp32", "bf16", torch dtypes), parsed once for every knob that takes one."""

from __future__ import annotations

from typing import Optional

import torch

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def parse_dtype(value, knob: str = "dtype") -> Optional[torch.dtype]:
    if value is None or (isinstance(value, torch.dtype) and value in _DTYPES.values()):
        return value
    key = value.lower().replace("torch.", "") if isinstance(value, str) else None
    if key not in _DTYPES:
        raise ValueError(f"Unknown dtype {value!r} for {knob}. Allowed: None, {', '.join(sorted(_DTYPES))} "
                         f"(or torch.float32 / torch.float16 / torch.bfloat16).")
    return _DTYPES[key]


STATE_DTYPE_KNOBS = ("optimizer_state_dtype", "master_dtype")


def state_dtype_name(value, knob: str) -> str:
    """``optimizer_state_dtype`` / ``master_dtype`` normalized to "fp32" or "bf16" (a torch dtype, "float32",
    "bfloat16" and None (fp32) accepted); fp16 and anything else refused, naming what is allowed."""
    try:
        dtype = parse_dtype(value, knob) if value is not None else torch.float32
    except (ValueError, AttributeError):
        dtype = None
    if dtype not in (torch.float32, torch.bfloat16):
        why = " (fp16's 5 exponent bits cannot hold Adam's second moment)" if dtype is torch.float16 else ""
        raise ValueError(f"{knob} must be 'fp32' (default) or 'bf16'; got {value!r}{why}.")
    return "bf16" if dtype is torch.bfloat16 else "fp32"
