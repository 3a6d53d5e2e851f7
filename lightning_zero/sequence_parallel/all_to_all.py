"""The Ulysses exchange (Jacobs et al., *DeepSpeed Ulysses*, arXiv 2309.14509), differentiable.

Before attention every rank of a sequence-parallel group of ``S`` holds all ``H`` heads of its ``s / S``
positions; attention needs every position of a head. One all-to-all turns the sequence-sharded
``(B, H, s/S, d)`` into the head-sharded ``(B, H/S, s, d)``: rank ``j`` receives head group ``j`` of every
rank's positions, in rank (= position) order. The reverse exchange turns the attention's head-sharded output
back into this rank's positions.

[Note: the exchange's backward is the reverse exchange] The two exchanges are each other's inverse and
both are permutations of the elements across ranks: the gradient of a permutation is the inverse
permutation of the gradient, so each one's backward is the other one, with no scaling. A group of one rank
is the identity and issues no collective.
"""
from __future__ import annotations

from typing import Any

import torch

from lightning_zero.engine.comm import collectives


def _exchange(send: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all of the rank-major ``send`` (dim 0 has one entry per rank): entry ``j`` goes to rank ``j``,
    and the result's entry ``i`` came from rank ``i``."""
    recv = torch.empty_like(send)
    n = send.numel() // send.shape[0]
    splits = [n] * send.shape[0]
    collectives.all_to_all_v(recv.view(-1), send.view(-1), splits, splits, group, op="all_to_all")
    return recv


def _seq_to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    B, H, sl, d = x.shape
    send = x.reshape(B, size, H // size, sl, d).transpose(0, 1).contiguous()  # (S, B, H/S, sl, d)
    recv = _exchange(send, group)  # entry i: rank i's positions of this rank's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // size, size * sl, d)


def _heads_to_seq(y: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    B, h, s, d = y.shape
    send = y.reshape(B, h, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()  # (S, B, H/S, sl, d)
    recv = _exchange(send, group)  # entry i: head group i of this rank's positions
    return recv.transpose(0, 1).reshape(B, size * h, s // size, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _seq_to_heads(x, group, size)

    @staticmethod
    def backward(ctx, grad):  # [Note: the exchange's backward is the reverse exchange]
        return _heads_to_seq(grad, ctx.group, ctx.size), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, size):
        ctx.group, ctx.size = group, size
        return _heads_to_seq(y, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.size), None, None


def seq_to_heads(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sequence-sharded ``(B, H, s/S, d)`` -> head-sharded ``(B, H/S, s, d)`` over ``group`` (``H`` must
    divide by ``S``; ``apply_sequence_parallel`` checks every attention before a forward)."""
    size = collectives.world_size(group)
    if size == 1:
        return x
    if x.shape[1] % size:
        raise ValueError(f"{x.shape[1]} heads do not split over {size} sequence-parallel ranks.")
    return _SeqToHeads.apply(x, group, size)


def heads_to_seq(y: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Head-sharded ``(B, H/S, s, d)`` -> sequence-sharded ``(B, H, s/S, d)``: the inverse of
    :func:`seq_to_heads`."""
    size = collectives.world_size(group)
    if size == 1:
        return y
    return _HeadsToSeq.apply(y, group, size)
