"""Sharding math: which slice of which parameter a rank owns, and how slices meet flat buffers.

Design note
-----------
Every trainable parameter is flattened and cut into ``world_size`` equal chunks of ``shard_numel =
ceil(numel / world_size)`` elements (the last chunks padded). Rank ``r`` owns elements
``[r * shard_numel, (r + 1) * shard_numel)`` clipped to ``numel`` -- possibly an empty slice for a tiny
parameter. Because every rank owns the *same* slice of *every* parameter:

* an elementwise optimizer (SGD, Adam, ...) can step a shard as if it were the parameter;
* a checkpoint written as per-parameter slices reshards to any world size by re-slicing;
* communication still runs on flat buffers: a bucket of parameters is laid out *rank-major*
  (``[rank 0's slices of p1, p2, ... | rank 1's slices ... ]``), so one reduce-scatter hands every rank
  exactly its slices of all bucket members, and one all-gather rebuilds them all.

Only the flat communication buffers carry padding; master shards and optimizer state are unpadded
(``shard_len`` elements), so their bytes meet the per-stage floors exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """The slice of one flattened parameter owned by ``rank`` out of ``world_size``."""

    numel: int
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        """Padded chunk size: the span every rank reserves for this parameter in a flat buffer."""
        return -(-self.numel // self.world_size)

    @property
    def lo(self) -> int:
        return min(self.rank * self.shard_numel, self.numel)

    @property
    def hi(self) -> int:
        return min((self.rank + 1) * self.shard_numel, self.numel)

    @property
    def shard_len(self) -> int:
        """Unpadded length of this rank's slice (0 when the parameter is smaller than the rank's offset)."""
        return self.hi - self.lo

    def local_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flattened full tensor (a view, no copy)."""
        return flat[self.lo : self.hi]


def scatter_into_rank_major(full: torch.Tensor, dest: torch.Tensor, offset: int, spec: ShardSpec) -> None:
    """Write a full flattened tensor into its column of a rank-major ``(world_size, S)`` buffer.

    ``dest`` is the 2-D view of a bucket buffer; this parameter's chunk of every rank's row lives at
    columns ``[offset, offset + shard_numel)``. The tail past ``numel`` is zero-filled so that padding
    never carries stale values into a sum.
    """
    s = spec.shard_numel
    block = dest[:, offset : offset + s]
    full_rows, rem = divmod(spec.numel, s)
    flat = full.reshape(-1)
    if full_rows:
        block[:full_rows].copy_(flat[: full_rows * s].view(full_rows, s))
    if full_rows < spec.world_size:
        block[full_rows:].zero_()
        if rem:
            block[full_rows, :rem].copy_(flat[full_rows * s :])


def gather_from_rank_major(src: torch.Tensor, full: torch.Tensor, offset: int, spec: ShardSpec) -> None:
    """Inverse of :func:`scatter_into_rank_major`: rebuild a full tensor from a gathered buffer."""
    s = spec.shard_numel
    block = src[:, offset : offset + s]
    full_rows, rem = divmod(spec.numel, s)
    flat = full.view(-1)
    if full_rows:
        flat[: full_rows * s].view(full_rows, s).copy_(block[:full_rows])
    if rem:
        flat[full_rows * s :].copy_(block[full_rows, :rem])
