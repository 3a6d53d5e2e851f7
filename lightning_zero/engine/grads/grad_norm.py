"""The global gradient norm of sharded gradients: squares of disjoint shards add up, so one all-reduce per
sharded optimizer gives DDP's ``clip_grad_norm_`` total; clipping is then one coefficient that
``ZeroEngine.step`` fuses with unscaling. Each optimizer caches its square for the step (``sq_norm``)."""

from __future__ import annotations

import math
from typing import Optional

import torch


def total_sq_norm(squares: list[torch.Tensor]) -> torch.Tensor:
    total = None
    for sq in squares:
        total = sq if total is None else total + sq.to(total.device)
    return total if total is not None else torch.zeros(())


def impose_sq_norm(shardeds: list, total: torch.Tensor) -> None:
    """Make ``total`` the step's squared norm (a pipeline's, over every stage): the first optimizer's
    cache holds it, the others zero, so their sum -- what clipping and the overflow check read -- is it."""
    for k, s in enumerate(shardeds):
        s.sq_norm = (total if k == 0 else torch.zeros(())).to(s.sq_norm.device, s.sq_norm.dtype)


def clip_coef(total: torch.Tensor, max_norm: float) -> Optional[float]:
    """DDP's ``clip_grad_norm_`` factor for the global norm ``total`` (None when it is not finite)."""
    return min(1.0, float(max_norm) / (float(total) + 1e-6)) if math.isfinite(total) else None
