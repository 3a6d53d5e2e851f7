"""The longest length that trains under a memory cap: the child-side cap and peak, and the parent's ladder.

Shared by ``bench/sparse_attention.py`` (one attention layer) and ``bench/long_sequence.py`` (GPT-2 steps).

A measured step runs in its own process, after an uncapped warm-up (thread pools, allocator arenas, lazy
library state, the optimizer's state; [Note: the cap is the kernel's address space] in
bench/sparse_attention.py): :func:`cap_address_space` then sets ``RLIMIT_AS`` to what the process maps plus
the cap, so every byte the step allocates counts and an allocation past it fails (``RuntimeError`` / ``MemoryError``: "does not fit"). :func:`reset_peak` clears the
resident high-water mark (``/proc/self/clear_refs``) and :func:`step_peak` is ``VmHWM`` minus the resident
size before the step: the step's own peak. On CUDA the cap is torch's per-process memory fraction over what
is allocated already and the peak ``max_memory_allocated``.

The ladder (:func:`longest`): lengths doubling from ``start`` until one fails, then a bisection between the
last that trained and the first that did not, down to ``resolution`` tokens (multiples of ``multiple``).
"""
from __future__ import annotations

import resource
from typing import Callable, Optional


def status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmSize``, ``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def cap_address_space(cap_gib: float) -> int:
    """Cap this process's address space at what it maps now plus ``cap_gib`` (0: no cap); what it mapped."""
    mapped = status("VmSize")
    if cap_gib:
        limit = mapped + int(cap_gib * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return mapped


def reset_peak() -> int:
    """Reset ``VmHWM`` to the current resident size; that size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def step_peak(rss_before: int) -> int:
    return status("VmHWM") - rss_before


def cuda_cap(cap_gib: float) -> int:
    """Cap torch's CUDA allocations at what is allocated now plus ``cap_gib``; reset the peak; the base."""
    import torch

    base = torch.cuda.memory_allocated()
    if cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (base + cap_gib * 2 ** 30) / total))
    torch.cuda.reset_peak_memory_stats()
    return base


def longest(run: Callable[[int], dict], label: str, start: int, max_tokens: int, resolution: int, multiple: int,
            describe: Callable[[dict], str]) -> tuple[Optional[dict], Optional[dict], list]:
    """The ladder then the bisection over ``run(n) -> {"ok": bool, "n": n, ...}`` (a failed run has "error"):
    (the longest run that trained, the shortest that failed, every run)."""
    runs, ok, bad = [], None, None

    def one(n: int) -> dict:
        r = run(n)
        runs.append(r)
        print(f"  {label:>10} {n:>7} tokens: " + (describe(r) if r["ok"] else f"failed ({r['error']})"), flush=True)
        return r

    n = start
    while bad is None and n <= max_tokens:
        r = one(n)
        ok, bad, n = (r, bad, n * 2) if r["ok"] else (ok, r, n)
    if bad is None or ok is None:
        return ok, bad, runs
    lo, hi = ok["n"], bad["n"]
    while hi - lo > resolution:
        mid = (lo + hi) // 2 // multiple * multiple
        if mid in (lo, hi):
            break
        r = one(mid)
        if r["ok"]:
            lo, ok = mid, r
        else:
            hi, bad = mid, r
    return ok, bad, runs
