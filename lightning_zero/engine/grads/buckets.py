"""Buckets: groups of parameters that travel together in one flat collective.

Design note
-----------
A bucket is an ordered group of trainable parameters whose gradients are reduced with a single
collective (stage 0: all-reduce of a param-major flat buffer; stages 1-2: reduce-scatter of a rank-major
buffer, see :mod:`sharding`) and whose updated shards come back with a single all-gather. Buckets are
filled in *reverse registration order*, which approximates the order in which backward produces
gradients, so the first bucket is usually ready first and its reduction overlaps the rest of backward.
The size cap (``bucket_mb``) bounds the transient communication buffers: at most a few buckets' worth
of flat memory is alive at any time, which is the "plus bounded bucket buffers" in the memory floors.

[Note: one copy per bucket]
Packing a bucket into its flat buffer and unpacking a gathered one are pure copies, but written as one
``copy_`` per parameter they cost a few dispatcher calls each: on a CPU rank with tens of parameters
that was ~1.4 ms per direction per step, a tenth of the ZeRO step. Every parameter that divides evenly
by the world size *is* its ``(world_size, shard_numel)`` block of the rank-major grid (a view), so the
whole bucket moves with one ``torch.cat(..., dim=1, out=grid)`` (pack) or one
``torch.split_with_sizes_copy(grid, ..., dim=1, out=views)`` (unpack), as FSDP2's copy-in / copy-out
do. Only a parameter whose size does not divide (its padded tail) goes through a small staging copy.
Copies are exact, so the numbers are bit for bit those of the per-parameter loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..comm import collectives as C
from ..comm import quantize as Q
from ..layout import tensor_parallel as TP
from ..comm.buffer_pool import BufferPool
from ..layout.sharding import ShardSpec


@functools.lru_cache(maxsize=None)
def _zeros(dtype: torch.dtype, device) -> torch.Tensor:
    # one read-only scalar per (dtype, device), only ever expanded as an input of a copy: no allocation a call
    return torch.zeros((), dtype=dtype, device=device)


def as_rank_major(t: torch.Tensor | None, spec: ShardSpec, dtype: torch.dtype, device) -> torch.Tensor:
    """A full tensor seen as its ``(world_size, shard_numel)`` block of a rank-major buffer: a view when
    the parameter divides evenly, else a zero-padded copy; ``None`` is a broadcast zero (no memory)."""
    w, s = spec.world_size, spec.shard_numel
    if t is None:
        return _zeros(dtype, device).expand(w, s)
    flat = t.reshape(-1)
    if spec.numel == w * s:
        return flat.view(w, s)
    return torch.nn.functional.pad(flat, (0, w * s - spec.numel)).view(w, s)


@dataclass
class Bucket:
    index: int
    params: list[torch.Tensor]
    specs: list[ShardSpec]
    offsets: list[int] = field(default_factory=list)  # column of each param inside a rank's chunk
    full_offsets: list[int] = field(default_factory=list)  # offset of each param in a param-major buffer
    pool: Optional[BufferPool] = None  # the table's: where the flat buffers below come from and go back to

    def __post_init__(self) -> None:
        col = full = 0
        for spec in self.specs:
            self.offsets.append(col)
            self.full_offsets.append(full)
            col += spec.shard_numel
            full += spec.numel

    def new_flat(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A transient flat buffer on the bucket's device; give it back with :meth:`done_with` once nothing
        reads it (after its collective's wait and the copies out of it)."""
        dev = self.params[0].device
        return self.pool.take(numel, dtype, dev) if self.pool is not None else torch.empty(numel, dtype=dtype, device=dev)

    def done_with(self, flat: torch.Tensor) -> None:
        if self.pool is not None:
            self.pool.give(flat)

    def keep(self, flat: torch.Tensor) -> None:
        """A :meth:`new_flat` buffer the caller keeps for good (never given back)."""
        if self.pool is not None:
            self.pool.disown(flat)

    @property
    def world_size(self) -> int:
        return self.specs[0].world_size

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's chunk (padded): the size of a reduce-scatter output."""
        return self.offsets[-1] + self.specs[-1].shard_numel if self.specs else 0

    @property
    def numel(self) -> int:
        return self.full_offsets[-1] + self.specs[-1].numel if self.specs else 0

    # -- rank-major layout (stages 1-3) ---------------------------------------------------------
    def pack_rank_major(
        self, tensors: list[torch.Tensor | None], dtype: torch.dtype, extra: int = 0
    ) -> torch.Tensor:
        """Flat ``world_size * (shard_numel + extra)`` buffer of full tensors (``None`` counts as zeros).

        The ``extra`` trailing columns of every rank's chunk are left for the caller (metadata that
        should travel with the collective). [Note: one copy per bucket]
        """
        width = self.shard_numel + extra
        flat = self.new_flat(self.world_size * width, dtype)
        grid = flat.view(self.world_size, width)
        parts, staged = [], []
        for t, spec in zip(tensors, self.specs):
            if t is not None and spec.numel != spec.world_size * spec.shard_numel:  # the padded tail: staged
                stage = self.new_flat(spec.world_size * spec.shard_numel, dtype)
                stage[: spec.numel].copy_(t.reshape(-1))
                stage[spec.numel :].zero_()
                staged.append(stage)
                parts.append(stage.view(spec.world_size, spec.shard_numel))
            else:
                parts.append(as_rank_major(t, spec, dtype, flat.device))
        if extra:  # zeros the caller overwrites: the output stays the whole (contiguous) grid
            parts.append(_zeros(dtype, flat.device).expand(self.world_size, extra))
        torch.cat(parts, dim=1, out=grid)
        for stage in staged:
            self.done_with(stage)
        return flat

    def unpack_rank_major(self, flat: torch.Tensor, outs: list[torch.Tensor], skip_rank: int | None = None) -> None:
        """Write a gathered rank-major buffer into ``outs`` (full tensors); one copy kernel for the
        bucket, plus one per padded parameter. [Note: one copy per bucket]

        ``skip_rank``: that rank's row is already in ``outs`` (this rank's masters alias the parameters'
        slices, so the step wrote it in place) and is not copied again, except for padded parameters."""
        w = self.world_size
        grid = flat.view(w, self.shard_numel)
        views, padded = [], []
        for t, spec, off in zip(outs, self.specs, self.offsets):
            s = spec.shard_numel
            if spec.numel == w * s and t.dtype == flat.dtype and t.is_contiguous():
                views.append(t.view(w, s))
            else:  # the padded tail (or a cast) goes through a staging chunk
                views.append(self.new_flat(w * s, flat.dtype).view(w, s))
                padded.append((t, views[-1], spec, off))
        sizes = [s.shard_numel for s in self.specs]
        spans = [(0, w)] if skip_rank is None else [(0, skip_rank), (skip_rank + 1, w)]
        for a, b in spans:
            if b > a:
                torch.split_with_sizes_copy(grid[a:b], sizes, dim=1, out=[v[a:b] for v in views])
        for t, stage, spec, off in padded:
            if skip_rank is not None:  # the staging chunk is written whole into ``t``: its own row too
                stage[skip_rank].copy_(grid[skip_rank, off : off + spec.shard_numel])
            t.copy_(stage.view(-1)[: spec.numel].view_as(t))
            self.done_with(stage)

    def local_views(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter unpadded views of this rank's chunk (a reduce-scatter output)."""
        return [chunk[off : off + spec.shard_len] for off, spec in zip(self.offsets, self.specs)]

    def all_gather(self, local: list[torch.Tensor | None], dtype: torch.dtype, group=None, host: bool = False,
                   async_op: bool = False, quantized: bool = False, pooled: bool = False):
        """The one all-gather of a bucket (publish, full-parameter views, optimizer-state consolidation).

        This rank's slices ``local`` (one per parameter, ``None`` counts as zeros) go into a padded chunk --
        ``host``: a (pinned) host chunk copied to the device in one asynchronous transfer -- and every
        rank's chunk lands in one rank-major buffer. Returns ``(work, flat)``; read ``flat`` with
        :meth:`unpack_rank_major` or :meth:`full_tensors` after ``work.wait()`` (``work`` is None when
        ``async_op`` is False). ``quantized``: the chunks travel as int8 blocks (qwZ, :mod:`.quantize`).
        ``pooled``: ``flat`` comes from the bucket's pool and the caller gives it back (:meth:`done_with`) once
        it has been unpacked; callers that keep views of ``flat`` (full-state views) leave it False.
        """
        dev = self.params[0].device
        flat = self.new_flat(self.world_size * self.shard_numel, dtype) if pooled else torch.empty(
            self.world_size * self.shard_numel, dtype=dtype, device=dev)
        # this rank's chunk is packed in place, into its own row of the output, where the collective takes
        # it so (an in-place all-gather); else, or from the host, into a chunk of its own
        if host and dev.type != "cpu":  # a CPU-only run's "host chunk" is its own row, as below
            send = torch.empty(self.shard_numel, dtype=dtype, device="cpu", pin_memory=True)
        elif C.gathers_in_place(group):
            send = flat.view(self.world_size, self.shard_numel)[self.specs[0].rank]
        else:
            send = torch.empty(self.shard_numel, dtype=dtype, device=dev)
        parts = []  # this rank's slices, each followed by its padding: one cat writes the chunk
        for v, spec in zip(local, self.specs):
            if v is not None and spec.shard_len:
                parts.append(v.reshape(-1))
            pad = spec.shard_numel - (spec.shard_len if v is not None else 0)
            if pad:
                parts.append(_zeros(dtype, send.device).expand(pad))
        if parts:
            torch.cat(parts, out=send)
        send = send.to(dev, non_blocking=True)  # a no-op unless the chunk was built on the host
        gather = Q.all_gather_int8 if quantized else C.all_gather
        return gather(flat, send, group=group, async_op=async_op), flat

    def full_tensors(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """New full-shape tensors of every parameter from a gathered rank-major buffer."""
        outs = [torch.empty(TP.local_shape(p), dtype=flat.dtype, device=flat.device) for p in self.params]
        self.unpack_rank_major(flat, outs)
        return outs

    # -- param-major layout (stage 0) -----------------------------------------------------------
    def pack_full(self, tensors: list[torch.Tensor | None], dtype: torch.dtype, extra: int = 0) -> torch.Tensor:
        flat = self.new_flat(self.numel + extra, dtype)
        torch.cat([t.reshape(-1) if t is not None else _zeros(dtype, flat.device).expand(spec.numel)
                   for t, spec in zip(tensors, self.specs)], out=flat[: self.numel])
        return flat

    def full_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[off : off + spec.numel].view(TP.local_shape(p))
            for p, off, spec in zip(self.params, self.full_offsets, self.specs)
        ]


def build_buckets(
    params: list[torch.Tensor], world_size: int, rank: int, bucket_bytes: int, sharded: bool = True
) -> list[Bucket]:
    """Group ``params`` (in registration order) into buckets of at most ``bucket_bytes``.

    ``sharded=False`` (stage 0) gives every rank the whole parameter: ``ShardSpec(world_size=1)``.
    A parameter larger than the cap gets a bucket of its own rather than being split, which keeps one
    parameter's gradient inside one collective.
    """
    buckets: list[Bucket] = []
    cur: list[torch.Tensor] = []
    cur_bytes = 0
    for p in reversed(params):
        nbytes = TP.local_numel(p) * p.element_size()  # a DTensor: its local piece
        if cur and cur_bytes + nbytes > bucket_bytes:
            buckets.append(_make(len(buckets), cur, world_size, rank, sharded))
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += nbytes
    if cur:
        buckets.append(_make(len(buckets), cur, world_size, rank, sharded))
    return buckets


def _make(index: int, params: list[torch.Tensor], world_size: int, rank: int, sharded: bool) -> Bucket:
    specs = [ShardSpec(TP.local_numel(p), world_size if sharded else 1, rank if sharded else 0) for p in params]
    return Bucket(index, list(params), specs)
