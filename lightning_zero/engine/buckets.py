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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import collectives as C
from . import quantize as Q
from . import tensor_parallel as TP
from .sharding import ShardSpec, gather_from_rank_major, scatter_into_rank_major


@dataclass
class Bucket:
    index: int
    params: list[torch.Tensor]
    specs: list[ShardSpec]
    offsets: list[int] = field(default_factory=list)  # column of each param inside a rank's chunk
    full_offsets: list[int] = field(default_factory=list)  # offset of each param in a param-major buffer

    def __post_init__(self) -> None:
        col = full = 0
        for spec in self.specs:
            self.offsets.append(col)
            self.full_offsets.append(full)
            col += spec.shard_numel
            full += spec.numel

    @property
    def world_size(self) -> int:
        return self.specs[0].world_size

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's chunk (padded): the size of a reduce-scatter output."""
        return sum(s.shard_numel for s in self.specs)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    # -- rank-major layout (stages 1-3) ---------------------------------------------------------
    def pack_rank_major(
        self, tensors: list[torch.Tensor | None], dtype: torch.dtype, extra: int = 0
    ) -> torch.Tensor:
        """Flat ``world_size * (shard_numel + extra)`` buffer of full tensors (``None`` counts as zeros).

        The ``extra`` trailing columns of every rank's chunk are left for the caller (metadata that
        should travel with the collective).
        """
        width = self.shard_numel + extra
        flat = torch.empty(self.world_size * width, dtype=dtype, device=self.params[0].device)
        grid = flat.view(self.world_size, width)
        for t, off, spec in zip(tensors, self.offsets, self.specs):
            if t is None:
                grid[:, off : off + spec.shard_numel].zero_()
            else:
                scatter_into_rank_major(t, grid, off, spec)
        return flat

    def unpack_rank_major(self, flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
        grid = flat.view(self.world_size, self.shard_numel)
        for t, off, spec in zip(outs, self.offsets, self.specs):
            gather_from_rank_major(grid, t, off, spec)

    def local_views(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter unpadded views of this rank's chunk (a reduce-scatter output)."""
        return [chunk[off : off + spec.shard_len] for off, spec in zip(self.offsets, self.specs)]

    def all_gather(self, local: list[torch.Tensor | None], dtype: torch.dtype, group=None, host: bool = False,
                   async_op: bool = False, quantized: bool = False):
        """The one all-gather of a bucket (publish, full-parameter views, optimizer-state consolidation).

        This rank's slices ``local`` (one per parameter, ``None`` counts as zeros) go into a padded chunk --
        ``host``: a (pinned) host chunk copied to the device in one asynchronous transfer -- and every
        rank's chunk lands in one rank-major buffer. Returns ``(work, flat)``; read ``flat`` with
        :meth:`unpack_rank_major` or :meth:`full_tensors` after ``work.wait()`` (``work`` is None when
        ``async_op`` is False). ``quantized``: the chunks travel as int8 blocks (qwZ, :mod:`.quantize`).
        """
        dev = self.params[0].device
        send = torch.zeros(self.shard_numel, dtype=dtype, device="cpu" if host else dev,
                           pin_memory=host and dev.type == "cuda")
        for view, v in zip(self.local_views(send), local):
            if v is not None:
                view.copy_(v.reshape(-1), non_blocking=True)
        send = send.to(dev, non_blocking=True)  # a no-op unless the chunk was built on the host
        flat = torch.empty(self.world_size * self.shard_numel, dtype=dtype, device=dev)
        gather = Q.all_gather_int8 if quantized else C.all_gather
        return gather(flat, send, group=group, async_op=async_op), flat

    def full_tensors(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """New full-shape tensors of every parameter from a gathered rank-major buffer."""
        outs = [torch.empty(TP.local_shape(p), dtype=flat.dtype, device=flat.device) for p in self.params]
        self.unpack_rank_major(flat, outs)
        return outs

    # -- param-major layout (stage 0) -----------------------------------------------------------
    def pack_full(self, tensors: list[torch.Tensor | None], dtype: torch.dtype, extra: int = 0) -> torch.Tensor:
        flat = torch.empty(self.numel + extra, dtype=dtype, device=self.params[0].device)
        for t, off, spec in zip(tensors, self.full_offsets, self.specs):
            dst = flat[off : off + spec.numel]
            dst.zero_() if t is None else dst.copy_(t.reshape(-1))
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
