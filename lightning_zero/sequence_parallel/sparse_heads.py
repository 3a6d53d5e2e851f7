"""A block-sparse layout cut to one rank's heads: what a sparsified attention runs after the Ulysses exchange.

The exchange hands rank ``r`` of ``S`` the heads ``r*H/S .. (r+1)*H/S - 1`` for the whole sequence, so its
kernel needs exactly those heads' rows of the layout made for the whole (padded) length. The layouts are
seeded (``layouts.py``), so every rank makes the same whole layout and keeps its own heads: the union over
the ranks is the single-process model's attention.
"""
from __future__ import annotations

import torch

from lightning_zero.sparse_attention.layouts import SparsityConfig


class HeadShardLayout(SparsityConfig):
    """``full``'s layout restricted to head group ``rank`` of ``size``: ``num_heads = full.num_heads / size``."""

    def __init__(self, full: SparsityConfig, rank: int, size: int):
        if full.num_heads % size:
            raise ValueError(f"the sparse layout has {full.num_heads} heads, which do not split over {size} "
                             "sequence-parallel ranks.")
        self.full = full
        self.head_rank, self.head_groups = rank, size
        self.num_heads = full.num_heads // size
        self.block = full.block
        self.different_layout_per_head = full.different_layout_per_head
        self.num_layout_heads = self.num_heads if self.different_layout_per_head else 1
        self.seed = full.seed
        if hasattr(full, "attention"):
            self.attention = full.attention

    def make_layout(self, seq_len: int) -> torch.Tensor:
        lo = self.head_rank * self.num_heads
        return self.full.make_layout(seq_len)[lo : lo + self.num_heads].contiguous()

    def describe(self) -> str:
        lo = self.head_rank * self.num_heads
        return f"{self.full.describe()}, heads {lo}..{lo + self.num_heads - 1} of {self.full.num_heads}"

    def __repr__(self) -> str:
        return f"HeadShardLayout({self.full!r}, rank={self.head_rank}, size={self.head_groups})"
