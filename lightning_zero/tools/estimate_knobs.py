"""The estimator's knobs checked once, before anything is computed (``estimate.py``, ``estimate_pipeline.py``
and ``lightning-zero estimate`` call it): a negative size, a zero step time or an unknown setting is one
error naming the knob, its command-line flag and what is allowed, never a table of negative bytes, an empty
table or a division by zero.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

# knob -> (command-line flag, may be None, int only, what it is)
KNOBS = {
    "world_size": ("--ranks", False, True, "the total number of ranks"),
    "num_nodes": ("--nodes", False, True, "the number of nodes"),
    "bucket_mb": ("--bucket-mb", False, False, "MiB per gradient bucket, e.g. 25"),
    "grad_accumulation": ("--grad-accum", False, True, "gradient accumulation steps"),
    "batch_size": ("--batch-size", True, True, "the micro-batch per rank"),
    "src_len": ("--src-len", False, True, "source tokens per sample"),
    "tgt_len": ("--tgt-len", False, True, "target tokens per sample"),
    "device_memory_gb": ("--device-memory", True, False, "GiB per device"),
    "cpu_memory_gb": ("--cpu-memory", True, False, "GiB of CPU RAM per node"),
    "vocab_size": ("--vocab", True, True, "the T5 vocabulary size"),
    "nvme_step_time": ("--step-time", False, False, "the optimizer step time in seconds"),
    "microbatches": ("--microbatches", True, True, "micro-batches per pipeline step"),
    "probe_batch": ("--probe-batch-size", False, True, "the probe step's micro-batch"),
}


def check_knobs(**values) -> None:
    """Each ``values`` entry (a :data:`KNOBS` name) positive and finite, an int where it counts something."""
    for name, value in values.items():
        flag, optional, integral, what = KNOBS[name]
        if optional and value is None:
            continue
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0 and math.isfinite(value)
        if ok and integral:
            ok = isinstance(value, numbers.Integral)
        if not ok:
            kind = "an int >= 1" if integral else "a positive, finite number"
            raise ValueError(f"{name}={value!r} ({flag}): allowed {'None or ' if optional else ''}{kind} ({what}).")


def check_settings(settings: Optional[Sequence[str]], names: Sequence[str]) -> Optional[list[str]]:
    """None (every setting) or a non-empty list of the table's setting names."""
    if settings is None:
        return None
    chosen = [settings] if isinstance(settings, str) else list(settings)
    unknown = [s for s in chosen if s not in names]
    if not chosen or unknown:
        shown = f"unknown {', '.join(map(repr, unknown))}" if unknown else "none given"
        raise ValueError(f"settings (--settings): {shown}. Allowed: a comma list of {', '.join(names)} "
                         f"(default: all {len(names)}).")
    return chosen


def check_estimate_knobs(settings: Optional[Sequence[str]], setting_names: Sequence[str], **values) -> Optional[list]:
    """``estimate_model_states``' knobs: each of ``values`` (:func:`check_knobs`), the world against the nodes,
    the CPU cap beside a device cap (the fit decision reads both), and ``settings`` (returned as a list)."""
    check_knobs(**values)
    if values["world_size"] % values["num_nodes"]:
        raise ValueError(f"world_size ({values['world_size']}) must be a multiple of num_nodes "
                         f"({values['num_nodes']}).")
    if values["cpu_memory_gb"] is not None and values["device_memory_gb"] is None:
        raise ValueError("cpu_memory_gb (--cpu-memory) without device_memory_gb (--device-memory). Allowed: "
                         "--device-memory alone, or both.")
    return check_settings(settings, setting_names)


def parse_count(text: str, flag: str = "--params") -> int:
    """A parameter count as typed (1.5e9, 1500000000, 1.5B, 350M, 7k) -> a positive int; else one error."""
    t = str(text).strip().lower().replace(",", "").replace("_", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:], None)
    try:
        value = float(t[:-1]) * mult if mult else float(t)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or int(value) < 1:
        raise ValueError(f"parameter count {text!r} ({flag}): allowed a positive count, e.g. 1.5e9, "
                         f"1500000000, 1.5B, 350M, 7k.")
    return int(value)


def check_state_dtypes(optimizer_state_dtype, master_dtype, precision: str, whole_tensor: bool) -> tuple[str, str]:
    """``optimizer_state_dtype`` / ``master_dtype`` as ``ZeroConfig`` normalizes them ("fp32" | "bf16", its one
    error otherwise), then what the run would refuse with them: a bf16 master without bf16 compute, and either
    knob with a whole-tensor optimizer (its owner ranks step whole fp32 tensors)."""
    from ..engine.config import state_dtype_name  # torch: not at CLI start-up

    states = state_dtype_name(optimizer_state_dtype, "optimizer_state_dtype (--optimizer-state-dtype)")
    master = state_dtype_name(master_dtype, "master_dtype (--master-dtype)")
    if master == "bf16" and not str(precision).startswith("bf16"):
        raise ValueError(f"master_dtype='bf16' (--master-dtype) needs bf16 compute; got precision {precision!r}. "
                         f"Allowed: --master-dtype bf16 with --precision bf16-mixed, or --master-dtype fp32.")
    if whole_tensor and "bf16" in (states, master):
        raise ValueError("optimizer_state_dtype / master_dtype 'bf16' (--optimizer-state-dtype, --master-dtype): "
                         "a whole-tensor optimizer (muon, adafactor) steps whole fp32 tensors on owner ranks and the "
                         "run refuses them. Allowed: 'fp32' with muon / adafactor, or an elementwise optimizer.")
    return states, master
