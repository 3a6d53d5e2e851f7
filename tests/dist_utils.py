"""Run a function on N gloo ranks from pytest (forked ranks; Lightning's popen launcher would re-run pytest).

The launcher is the package's own (``lightning_zero.tools.launch``), shared with the tuner and the benches.
"""

from __future__ import annotations

from lightning_zero.tools.launch import free_port  # noqa: F401  (tests pick ports with it)
from lightning_zero.tools.launch import run_ranks


def run_distributed(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    return run_ranks(fn, world_size, args, start_method="fork")
