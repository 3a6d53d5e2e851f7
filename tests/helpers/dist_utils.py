"""Run a function on N gloo ranks from pytest (forked ranks; Lightning's popen launcher would re-run pytest).

The launcher is the package's own (``lightning_zero.tools.launch``), shared with the tuner and the benches.
"""

from __future__ import annotations

import torch

from lightning_zero.tools.launch import free_port  # noqa: F401  (tests pick ports with it)
from lightning_zero.tools.launch import run_ranks


def run_distributed(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    return run_ranks(fn, world_size, args, start_method="fork")


def clip_and_step(engine, model, optimizer, clip, norms: list) -> None:
    """One optimizer step of a ZeRO run (``engine``) or of its reference (``engine=None``: torch's clip and
    the plain optimizer), with the pre-clip norm appended to ``norms`` when clipping."""
    if engine is not None:
        if clip is not None:
            norms.append(engine.clip_grad_norm_(clip).item())
        engine.step()
        return
    if clip is not None:
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
    optimizer.step()
    optimizer.zero_grad()
