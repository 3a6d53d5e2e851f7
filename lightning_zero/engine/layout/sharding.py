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

[Note: tensor kinds]
The engine's tensors have one name each, used in code, comments and docs (as FSDP2's [Note: FSDP tensors]):

* **parameter**: the ``nn.Parameter`` the module computes with, in the compute dtype. Whole at stages 0-2;
  at stage 3 its ``.data`` is the gathered unit while the unit is in use and empty otherwise.
* **local piece**: what the engine sees of a parameter: the parameter itself, or, under tensor
  parallelism, a DTensor's ``_local_tensor`` (this TP rank's piece; tensor_parallel.py ``local``). Every
  slice, shard and row below is of the local piece.
* **slice**: the ``[rank * shard_numel, ...)`` span of one flattened local piece that a rank owns
  (:class:`ShardSpec`); possibly empty.
* **shard**: a rank's slices of several parameters together: the *gradient shard* of a bucket (the
  reduce-scatter's output), the *unit shard* of stage 3 (one flat tensor per unit, what a gather starts
  from and, with ``offload_params``, what lives on the host).
* **master**: the fp32 tensor the optimizer steps, one per parameter slice (stages 1-3) or per whole
  parameter (stage 0). It aliases the parameter's storage when nothing forces a copy (fp32 compute, no
  offload, no quantized publish); otherwise it is its own fp32 copy (on the host when offloaded).
* **source**: where the publish writes an updated master back (stage 3: the parameter's slice inside its
  unit shard, bucket_table.py ``sources``; stages 1-2: the parameter itself, through the bucket all-gather).
* **row**: a rank's contiguous span of a rank-major flat bucket buffer (its slices of every bucket member,
  back to back, padded to ``shard_numel`` each): what one reduce-scatter delivers and one all-gather sends.
  A *bucket row* of the bucket table (bucket_table.py) is a different thing: one bucket with its optimizer,
  unit and sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ShardSpec:
    """The slice of one flattened parameter owned by ``rank`` out of ``world_size``."""

    numel: int
    world_size: int
    rank: int

    @cached_property  # read for every parameter of every bucket at every step
    def shard_numel(self) -> int:
        """Padded chunk size: the span every rank reserves for this parameter in a flat buffer."""
        return -(-self.numel // self.world_size)

    @cached_property
    def lo(self) -> int:
        return min(self.rank * self.shard_numel, self.numel)

    @cached_property
    def hi(self) -> int:
        return min((self.rank + 1) * self.shard_numel, self.numel)

    @cached_property
    def shard_len(self) -> int:
        """Unpadded length of this rank's slice (0 when the parameter is smaller than the rank's offset)."""
        return self.hi - self.lo

    def local_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flattened full tensor (a view, no copy)."""
        return flat[self.lo : self.hi]
