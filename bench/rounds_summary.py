"""Summaries of the interleaved rounds (``harness.run_rounds``): medians, per-cycle ratios, floors, loss check.

Split from ``bench/harness.py`` (which re-exports every name here) to keep each file on one concept.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

from lightning_zero.engine.memory.floors import model_state_floor

WORLD_SIZE = 2
ADAM_STATE_BYTES = 8  # two fp32 moments per element

def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def cycle_ratio(rounds: list[dict], base: list[dict]) -> Optional[float]:
    """Median over cycles (same round, same step index) of this method's time / the base's time."""
    pairs = [t / tb for r, b in zip(rounds, base) if "times_ms" in r and "times_ms" in b
             for t, tb in zip(r["times_ms"], b["times_ms"])]
    return statistics.median(pairs) if pairs else None


def method_floor(method: str, numel: int, world_size: int = WORLD_SIZE, mixed: bool = False) -> Optional[dict]:
    """model-state floor (fp32, Adam K=8, offloaded bytes in 'host'); peers map to the ZeRO stage they match."""
    stage = {"ddp": 0, "zero_opt": 1, "fsdp2": 3, "fsdp2_noreshard": 3, "fsdp2_offload": 3}.get(method)
    if stage is None:
        stage = int(method.removeprefix("ds_")[4])
    off = method.endswith("_offload") and not method.startswith("fsdp2")  # FSDP2 keeps no separate master
    return model_state_floor(stage, numel, world_size, mixed=mixed, state_bytes=ADAM_STATE_BYTES,
                             offload_optimizer=off)


def summarize_methods(results: dict[str, list[dict]], bases: tuple[str, ...] = ("ddp",)) -> dict:
    """Per method: medians, p90, per-cycle ratios to each base, memory, floor, final losses; or its error."""
    summary = {}
    numel = next((r["numel"] for rs in results.values() for r in rs if "numel" in r), 0)
    for m, rounds in results.items():
        ok = [r for r in rounds if "times_ms" in r]
        if not ok:
            summary[m] = {"error": rounds[0].get("error", "no result")}
            continue
        all_t = [t for r in ok for t in r["times_ms"]]
        fl = method_floor(m, numel)
        summary[m] = {
            "median_ms": statistics.median(all_t),
            "p90_ms": percentile(all_t, 0.9),
            "round_medians_ms": [statistics.median(r["times_ms"]) for r in ok],
            "phase_medians_ms": {
                ph: statistics.median(r["phases_ms"][j][k] for r in ok for j in range(len(r["phases_ms"])))
                for k, ph in enumerate(("forward", "backward", "step"))
            },
            "cores_busy": statistics.median(c for r in ok for c in r.get("cores_busy", [])) if all(
                "cores_busy" in r for r in ok) else None,
            "gather_wait_ms": statistics.median(w for r in ok for w in r["gather_wait_ms"]) if all(
                r.get("gather_wait_ms") for r in ok) else None,
            "ratio_vs": {b: cycle_ratio(rounds, results[b]) for b in bases if b in results and b != m},
            "model_state_bytes": ok[-1]["memory"]["model_states"],
            "host_bytes": ok[-1]["memory"].get("host", 0),
            "memory_report": ok[-1]["memory"],
            "floor_bytes": fl["device"] + fl["host"],
            "floor": fl,
            "final_loss": ok[-1]["final_loss"],
            "final_loss_per_round": [r["final_loss"] for r in ok],
            "errors": [r["error"] for r in rounds if "error" in r],
        }
        for b in bases:
            if b == m:
                summary[m]["ratio_vs"][b] = 1.0
    return {"numel": numel, "methods": summary}


def loss_check(summary: dict, ref_method: str = "ddp", rtol: float = 1e-4) -> tuple[Optional[float], list[str]]:
    """Reference final loss and the methods (any round) that differ from it by more than ``rtol``."""
    ms = summary["methods"]
    ref_row = ms.get(ref_method) if "final_loss" in ms.get(ref_method, {}) else None
    if ref_row is None:
        ref_row = next((r for r in ms.values() if "final_loss" in r), None)
    if ref_row is None:
        return None, []
    ref = ref_row["final_loss"]
    bad = [m for m, r in ms.items() if "final_loss_per_round" in r
           and any(abs(x - ref) > rtol * abs(ref) for x in r["final_loss_per_round"])]
    return ref, bad
