"""BucketTable: one row per gradient bucket -- the bucket, the optimizer that owns it, and at stage 3 the
unit it belongs to and the unit-shard slices its masters come from and are published into.

One table instead of parallel per-bucket lists: a bucket added after setup (``add_param_group``) is one
row appended, so what the sharded optimizers, the publish and the releaser read can never fall out of
step (the engine hands the new rows' buckets to the reducer, which numbers them the same way).

Launch order ([Note: sharding plan] decides the layout): stages 0-2 order buckets by the registration
position of their first parameter, reversed (as backward produces gradients); stage 3 by unit, the
non-root units reversed and the root last; ties by optimizer, so several optimizers share one numbering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .bucket_rows import BucketRow
from .buckets import Bucket, _make, build_buckets
from ..comm.buffer_pool import BufferPool


class BucketTable:
    def __init__(self) -> None:
        self.rows: list[BucketRow] = []
        self.pool = BufferPool()  # every bucket's transient flat buffers ([Note: kept communication buffers])

    def add(self, rows: list[BucketRow]) -> list[Bucket]:
        """Append ``rows`` (numbered after the existing ones); returns their buckets."""
        for i, r in enumerate(rows):
            r.bucket.index = len(self.rows) + i
            r.bucket.pool = self.pool
        self.rows.extend(rows)
        return [r.bucket for r in rows]

    @property
    def buckets(self) -> list[Bucket]:
        return [r.bucket for r in self.rows]

    def of_optimizer(self, k: int) -> list[BucketRow]:
        return [r for r in self.rows if r.optimizer == k]

    def sources(self, index: int) -> Optional[list[torch.Tensor]]:
        return self.rows[index].sources

    def repoint_sources(self) -> None:
        """Stage 3 after the unit shards were cast to the compute dtype: they are new tensors, so the
        sources point at them, not at the fp32 originals."""
        for r in self.rows:
            if r.unit is not None:
                views = dict(zip(map(id, r.unit.params), r.unit.local_views()))
                r.sources = [views[id(p)] for p in r.bucket.params]


@dataclass(frozen=True)
class BucketMaker:
    """How parameters become buckets: one per unit when ``units`` (stage 3), else by size, sliced rank-major
    when ``sharded`` (stages 1-2) or whole (stage 0)."""

    world_size: int
    rank: int
    bucket_bytes: int
    sharded: bool
    units: Optional[list] = None

    def rows(self, params: list[nn.Parameter], optimizer: int) -> list[BucketRow]:
        if self.units is not None:
            bs, srcs, owner = grad_buckets_for_units(self.units, params, self.world_size, self.rank)
            return [BucketRow(b, optimizer, s, u) for b, s, u in zip(bs, srcs, owner)]
        return [BucketRow(b, optimizer) for b in
                build_buckets(params, self.world_size, self.rank, self.bucket_bytes, sharded=self.sharded)]

    def table(self, module: nn.Module, per_opt: list[list[nn.Parameter]]) -> BucketTable:
        """Every optimizer's buckets in one launch order (see the module docstring)."""
        rows = [r for k, params in enumerate(per_opt) for r in self.rows(params, k)]
        if self.units is not None:
            backward = list(reversed(self.units[:-1])) + [self.units[-1]]
            pos = {id(u): i for i, u in enumerate(backward)}
            rows.sort(key=lambda r: (pos[id(r.unit)], r.optimizer))
        else:
            order = {id(p): i for i, p in enumerate(module.parameters())}
            rows.sort(key=lambda r: (-order[id(r.bucket.params[0])], r.optimizer))
        table = BucketTable()
        table.add(rows)
        return table


def grad_buckets_for_units(units: list, managed: list[nn.Parameter], world_size: int, rank: int):
    """One gradient bucket per unit (its trainable, optimizer-managed parameters), in backward order.

    Returns (buckets, sources, owner): ``sources[b][i]`` is the unit-shard view of bucket ``b``'s
    parameter ``i`` (where its master comes from); ``owner[b]`` is the unit of bucket ``b``.
    Backward runs the units in reverse forward order and the root (embeddings, tied heads) last, so the
    buckets are the non-root units reversed, then the root: in-order launching then rarely waits.
    """
    wanted = {id(p) for p in managed}
    buckets, sources, owner = [], [], []
    for u in list(reversed(units[:-1])) + [units[-1]]:
        params = [p for p in u.params if id(p) in wanted]
        if not params:
            continue
        views = dict(zip((id(p) for p in u.params), u.local_views()))
        buckets.append(_make(len(buckets), params, world_size, rank, True))
        sources.append([views[id(p)] for p in params])
        owner.append(u)
    return buckets, sources, owner
