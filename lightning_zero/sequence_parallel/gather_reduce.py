"""The two other differentiable collectives sequence parallelism needs: a sum over the group (the loss) and an
all-gather along a dimension (T5's encoder output before the decoder).

[Note: every rank computes the whole loss] Each rank of a sequence-parallel group ends its forward with the
same value, the loss of the whole sequence, and runs backward from it. Both collectives are written for
that: the all-reduce's backward is an all-reduce (each rank's share of the loss receives the S ranks' seeds,
S in all), the all-gather's backward a reduce-scatter-sum (each rank's slice receives the S ranks' copies of
its gradient). So the ranks' parameter gradients sum to S times the whole sequence's gradient, and the ZeRO
engine, averaging over the data-parallel and sequence-parallel ranks alike, lands on DDP's gradient for
whole sequences without a divisor of its own.
"""
from __future__ import annotations

from typing import Any

import torch

from lightning_zero.engine.comm import collectives


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        collectives.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # [Note: every rank computes the whole loss]
        grad = grad.clone()
        collectives.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((size * moved.shape[0],) + tuple(moved.shape[1:]))
        collectives.all_gather(out.view(-1), moved.view(-1), group=group)
        return out.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):  # the sum of every rank's gradient of this rank's slice
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // ctx.size,) + tuple(moved.shape[1:]))
        collectives.reduce_scatter(out.view(-1), moved.view(-1), group=ctx.group)
        return out.movedim(0, ctx.dim), None, None, None


def all_reduce_sum(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The sum of ``x`` over ``group``; its backward sums the incoming gradients over the group too."""
    if collectives.world_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def all_gather_along(x: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order; backward: the reduce-scatter-sum of the
    gradient (this rank's slice, summed over the ranks)."""
    size = collectives.world_size(group)
    if size == 1:
        return x
    return _AllGather.apply(x, dim % x.dim(), group, size)
