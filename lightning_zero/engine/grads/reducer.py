"""Gradient reduction: bucketed all-reduce (stage 0) or reduce-scatter (stages 1-3) driven by backward.

Design note
-----------
Each trainable parameter gets a post-accumulate-grad hook. The hook fires once per backward, after
autograd has summed every use of the parameter (so tied weights are reduced once). When all members of
a bucket are ready the bucket is launched -- but strictly in bucket order, so every rank issues the same
collectives in the same sequence even when ranks see different unused parameters (the DDP rule). An
autograd end-of-backward callback launches whatever is left (parameters that got no gradient count as
zeros) and completes the reductions, so after ``backward()`` returns the reduced gradients are in place.

When reductions happen is the only thing that separates stage 1 from stage 2:
* stages 0 and 1 honour :meth:`no_sync`: under it gradients just accumulate locally in ``param.grad``
  and no collective is issued; the boundary micro-batch reduces the accumulated sum;
* stage 2 reduces every micro-batch into a gradient *shard* and frees the full gradient at once, so a
  rank never holds more than a bucket or two of full-size gradients.
In stages 1-2 the reduced slices accumulate in one flat shard per bucket; in stage 0 the all-reduced
values are written back into ``param.grad`` (identical on every rank, so repeated syncs stay correct).

How a bucket of stages 1-3 reaches its shard is ``mode``: a reduce-scatter; an all-reduce of the whole
rank-major buffer keeping this rank's row (the same sums in the same memory -- the full bucket exists
either way -- and faster where the backend's reduce-scatter is slow: gloo, see
``collectives.GRAD_REDUCE_BY_BACKEND``); one all-to-all of the rows, each rank summing the N it receives
in fp32 (a reduce-scatter's bytes, half an all-reduce's); or the same all-to-all with the rows as int8
blocks (qgZ). Both all-to-all forms are :func:`.quantize.reduce_scatter_by_all_to_all`.

Which parameters got a gradient on *any* rank travels inside the reductions themselves: every bucket
buffer carries one extra element per parameter (1 if this rank had a gradient), which the same sum turns
into a count of users. A parameter that no rank used keeps ``grad=None`` exactly as under DDP, so
optimizers skip it (no weight decay, no step count) instead of stepping on zeros -- at no extra
collective.

On CUDA the pack / collective / unpack sequence runs on a side stream that first waits for the compute
stream, so reductions overlap the rest of backward; freed gradients are ``record_stream``-ed so the
caching allocator does not hand their memory to the compute stream too early. On CPU (gloo) collectives
are issued with ``async_op=True`` and completed at the end of backward.

With the optimizer offloaded, each completed shard of the boundary micro-batch also goes to host memory right
there (host_copy.py, chosen once from the placement), on the side stream, so device->host traffic overlaps the
rest of backward instead of following it. Everything the reducer keeps about a bucket is in its
:class:`~.bucket_rows.BucketRow`.

[Note: hybrid reduction]
With hybrid sharding (``ZeroConfig.shard_group_size``) the reduce-scatter runs inside the shard group and
its output (shard + used-counts) is summed over the micro-batches locally, unreplicated; the boundary
micro-batch's completion all-reduces that sum once across the replicate group (the ranks holding the same
shard in the other groups) and only then divides by what is left of 1/N and adds it to the gradient shard.
So cross-group traffic is one all-reduce per bucket per optimizer step even at stage 2 under
accumulation, and the counts -- hence the used-parameter masks -- agree over the whole world. A step after
un-synced backwards only (an engine user's choice) replicates what is left in :meth:`finalize`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional, Union

import torch
from torch.autograd import Variable

from ..comm import collectives as C
from . import grad_clear as GC
from ..comm import quantize as Q
from ..layout import tensor_parallel as TP
from .backward_phase import BackwardPhase, GradSync
from .bucket_rows import BucketRow
from .buckets import Bucket
from .host_copy import host_copy_for
from ..plan import ShardingPlan

_SHARD_REDUCTIONS = {"reduce_scatter": C.reduce_scatter, "all_reduce": C.reduce_scatter_by_all_reduce,
                     "all_to_all": Q.reduce_scatter_by_all_to_all, "int8": Q.reduce_scatter_int8}


class GradReducer:
    def __init__(
        self,
        rows: list[Union[BucketRow, Bucket]],
        plan: ShardingPlan,
        reduce_dtype: Optional[torch.dtype],
        group: Optional[Any] = None,
        on_bucket_complete: Optional[Callable[[int], None]] = None,
        on_end_of_backward: Optional[Callable[[], None]] = None,
        replicate_group: Optional[Any] = None,
        mode: str = "reduce_scatter",
        local_grads: Callable[[], bool] = lambda: False,
    ) -> None:
        """``rows``: the bucket table's rows, in launch order; the reducer fills them (bucket_rows.py); a bare
        ``Bucket`` gets a row of its own (a reducer used without a table).
        ``local_grads``: asked before every reduction, True while the optimizer exchanges what it needs itself
        (a communicating optimizer kind, engine/optim/kinds/): backward launches nothing and the step takes
        the local gradients."""
        self.rows = [r if isinstance(r, BucketRow) else BucketRow(r, 0) for r in rows]
        self.takes_local_grads = local_grads
        self.plan = plan  # [Note: sharding plan]: whole or scattered reductions, and when they happen
        self.reduce_dtype = reduce_dtype
        self.group = group
        self.world_size = C.world_size(group)
        # hybrid sharding: ``group`` is the shard group; each reduced shard is then all-reduced once per step
        # across the replicas ([Note: hybrid reduction]), so the average is over both: world * replicas ranks
        self.replicate_group = replicate_group if plan.shards_optimizer_state else None
        replicas = C.world_size(self.replicate_group) if self.replicate_group is not None else 1
        ranks = self.world_size * replicas
        # fp16 sums of many ranks can overflow: split the 1/N averaging into a pre- and a post-factor.
        pre = math.sqrt(ranks) if reduce_dtype == torch.float16 else float(ranks)
        self._pre, self._post = pre, ranks / pre
        self.sync = GradSync.BOUNDARY
        # stages 1-3: "reduce_scatter", "all_reduce" (the whole bucket, this rank's row kept), "all_to_all"
        # (the rows exchanged, summed in fp32 on arrival) or "int8" (qgZ: the same all-to-all, int8 blocks);
        # see collectives.grad_reduce_mode
        if mode not in _SHARD_REDUCTIONS:
            raise ValueError(f"Unknown gradient reduction {mode!r}. Allowed: {', '.join(_SHARD_REDUCTIONS)}.")
        self.mode = mode
        self._on_bucket_complete = on_bucket_complete  # stage 3: release the unit's parameters
        self._on_end_of_backward = on_end_of_backward
        device = self.rows[0].bucket.params[0].device if self.rows else torch.device("cpu")
        # offload: where the step reads the boundary's shards, decided once (host_copy.py, [Note: placement])
        self.host_copy = host_copy_for(plan.placement.grad_shards, device)
        self._next = 0
        self._pending: list[tuple] = []
        self.phase = BackwardPhase.IDLE
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._handles: list = []
        self._register(self.rows)

    # views for readers that think in buckets (memory_report, tests); the rows hold the tensors
    @property
    def buckets(self) -> list[Bucket]:
        return [r.bucket for r in self.rows]

    @property
    def grad_shards(self) -> list[Optional[torch.Tensor]]:
        return [r.shard for r in self.rows]

    @property
    def unreplicated_shards(self) -> list[torch.Tensor]:
        """Hybrid sharding's sums of un-synced micro-batches, not yet all-reduced across the replicas (their
        gradient slices, without the counts): held beside (or instead of) the shard until the boundary."""
        return [r.unreplicated[: -len(r.bucket.params)] for r in self.rows if r.unreplicated is not None]

    @property
    def host_shards(self) -> list[Optional[torch.Tensor]]:
        return [r.host for r in self.rows]

    @property
    def host_grads(self) -> bool:
        return self.host_copy.copies

    def _register(self, rows: list[BucketRow]) -> None:
        for row in rows:
            for p in row.bucket.params:
                # a hook needs requires_grad at registration only; it survives freezing and unfreezing
                # (a frozen parameter of a group added after setup, to be unfrozen later)
                frozen = not p.requires_grad
                p.requires_grad_(True)
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(row)))
                p.requires_grad_(not frozen)

    def add_rows(self, rows: list[BucketRow]) -> None:
        """Reduce these rows too (parameters added to an optimizer after setup); their buckets' ``index``
        continues this reducer's numbering. Called between backwards only."""
        if self.in_backward:
            raise RuntimeError("Parameters cannot be added to the optimizer during backward.")
        first = len(self.rows)
        assert [r.index for r in rows] == list(range(first, first + len(rows)))
        self.rows.extend(rows)
        self._register(rows)

    @property
    def in_backward(self) -> bool:
        return self.phase is BackwardPhase.REDUCING

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards in this block accumulate (GradSync.ACCUMULATE); the previous setting is restored after."""
        prev, self.sync = self.sync, GradSync.ACCUMULATE
        try:
            yield
        finally:
            self.sync = prev

    @property
    def sync_enabled(self) -> bool:  # the boolean spelling of ``sync``
        return self.sync is GradSync.BOUNDARY

    # -- hooks ----------------------------------------------------------------------------------
    def _make_hook(self, row: BucketRow):
        def hook(_param: torch.Tensor) -> None:
            self._on_grad_ready(row)

        return hook

    def _syncing(self) -> bool:
        if self.takes_local_grads():
            return False
        return self.plan.shards_grads or self.sync is GradSync.BOUNDARY

    def _on_grad_ready(self, row: BucketRow) -> None:
        if not self._syncing():
            row.dirty = True
            return
        if self.phase is BackwardPhase.IDLE:
            self.phase = self.phase.check(BackwardPhase.REDUCING)
            self._begin_cycle()
            Variable._execution_engine.queue_callback(self._end_of_backward)
        row.ready += 1
        if self._on_bucket_complete is not None and row.complete:
            self._on_bucket_complete(row.index)
        self._launch_in_order(upto_ready=True)

    def _begin_cycle(self, only: Optional[list[BucketRow]] = None) -> None:
        self._next = 0
        for r in self.rows:
            r.ready = 0
            r.active = any(p.requires_grad for p in r.bucket.params) if only is None else r in only

    def _launch_in_order(self, upto_ready: bool) -> None:
        while self._next < len(self.rows):
            row = self.rows[self._next]
            if not row.active:
                self._next += 1
                continue
            if upto_ready and not row.complete:
                return
            self._launch(row)
            self._next += 1

    def _end_of_backward(self) -> None:
        self._launch_in_order(upto_ready=False)
        self.wait()
        self.phase = self.phase.check(BackwardPhase.IDLE)
        for r in self.rows:
            r.dirty = False
        if self._on_end_of_backward is not None:
            self._on_end_of_backward()
        for pool in {id(r.bucket.pool): r.bucket.pool for r in self.rows if r.bucket.pool is not None}.values():
            pool.drop_free()  # every buffer of the backward given back: none kept ([Note: kept communication buffers])

    # -- one bucket ---------------------------------------------------------------------------
    def _launch(self, row: BucketRow) -> None:
        b = row.bucket
        grads = [TP.local_grad(p) for p in b.params]  # a DTensor's local piece
        n = len(grads)
        dtype = self.reduce_dtype or b.params[0].dtype
        ctx = contextlib.nullcontext()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(b.params[0].device))
            ctx = torch.cuda.stream(self._stream)
        with ctx:
            shards = self.plan.shards_optimizer_state
            if not shards:  # stage 0: whole gradients, as DDP
                flat = b.pack_full(grads, dtype, extra=n)
                _write_flags(flat[b.numel :], grads)
            else:
                flat = b.pack_rank_major(grads, dtype, extra=n)
                _write_flags(flat.view(b.world_size, -1)[:, b.shard_numel :], grads)
            if self._pre != 1.0:  # one rank: nothing to divide
                flat.div_(self._pre)
            if not shards:
                work = C.all_reduce(flat, group=self.group, async_op=True)
                out = flat
            elif b.world_size == 1 and self.mode != "int8":  # one rank: the packed buffer is its reduced shard
                out, work = flat, C.done()
                b.keep(flat)
            else:
                out = torch.empty(b.shard_numel + n, dtype=dtype, device=flat.device)
                # int8: the used-parameter counts get scales of their own
                kw = dict(segments=[b.shard_numel, n]) if self.mode == "int8" else {}
                if self.mode == "all_to_all":  # its received rows come from the bucket's pool too
                    kw = dict(pool=b.pool)
                work = _SHARD_REDUCTIONS[self.mode](out, flat, group=self.group, async_op=True, **kw)
            if shards:
                for p in b.params:  # the full gradient is now inside ``flat``: free it
                    if p.grad is not None and self._stream is not None:
                        p.grad.record_stream(self._stream)
                    p.grad = None
            self._pending.append((row, work, flat, out))
            if self._stream is not None:  # NCCL orders the unpack after the collective on this stream
                self._complete(self._pending.pop())

    def _complete(self, item: tuple) -> None:
        row, work, flat, out = item
        work.wait()
        if self.replicate_group is not None:  # [Note: hybrid reduction]
            row.unreplicated = out if row.unreplicated is None else row.unreplicated.add_(out)
            if self.sync is GradSync.BOUNDARY:
                self._replicate(row)
        else:
            self._add_shard(row, out)
        if out is not flat or not self.plan.shards_optimizer_state:  # else one rank kept it as its shard
            row.bucket.done_with(flat)  # read to the end; ``out`` is a separate buffer whenever it is kept

    def _replicate(self, row: BucketRow) -> None:
        out, row.unreplicated = row.unreplicated, None
        C.all_reduce(out, group=self.replicate_group)
        self._add_shard(row, out)

    def _add_shard(self, row: BucketRow, out: torch.Tensor) -> None:
        b = row.bucket
        if self._post != 1.0:
            out.div_(self._post)
        n = len(b.params)
        counts = out[-n:].float()
        if not self.plan.shards_optimizer_state and counts.data_ptr() == out[-n:].data_ptr():
            counts = counts.clone()  # stage 0's ``out`` is its pooled pack buffer: the counts outlive it
        row.count_users(counts)
        out = out[:-n]
        if not self.plan.shards_optimizer_state:
            for p, red in zip(b.params, b.full_views(out)):
                if p.grad is None:
                    TP.set_grad(p, red.to(p.dtype, copy=True))
                else:
                    TP.local_grad(p).copy_(red)
            return
        row.add_reduced(out)
        if self.sync is GradSync.BOUNDARY:  # this sum is the final one
            self.host_copy.keep(row)

    def wait(self) -> None:
        """Complete every launched reduction (their results are in place afterwards)."""
        for item in self._pending:
            self._complete(item)
        self._pending.clear()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    # -- step boundary --------------------------------------------------------------------------
    def finalize(self, buckets: Optional[list[Bucket]] = None) -> list[tuple[BucketRow, torch.Tensor]]:
        """Make the reduced gradients of ``buckets`` (default: all) final for an optimizer step: per bucket
        its row and a bool mask of the parameters that got a gradient on any rank."""
        self.wait()
        rows = list(self.rows) if buckets is None else [self.rows[b.index] for b in buckets]
        if self.takes_local_grads():  # nothing reduced: this rank's own grads
            for r in rows:
                r.dirty = False
            return [(r, torch.tensor([p.grad is not None for p in r.bucket.params], dtype=torch.bool))
                    for r in rows]
        if any(r.dirty for r in rows):  # a step after un-synced backwards only: reduce what accumulated
            self._begin_cycle(only=rows)
            self._launch_in_order(upto_ready=False)
            self.wait()
            for r in rows:
                r.dirty = False
        for r in rows:
            if r.unreplicated is not None:
                self._replicate(r)
        counts = [r.take_used() for r in rows]
        masks = list((torch.cat([c.cpu() for c in counts]) > 0).split([len(c) for c in counts])) if rows else []
        return list(zip(rows, masks))

    def clear(self, buckets: Optional[list[Bucket]] = None, set_to_none: bool = True) -> None:
        """Drop (``set_to_none``) or zero the gradients (full, sharded, counted) of ``buckets`` (default: all):
        after a step, or a user's ``zero_grad`` ([Note: clearing reduced gradients])."""
        for row in self.rows if buckets is None else [self.rows[b.index] for b in buckets]:
            self.clear_params(row, None, set_to_none)

    def clear_params(self, row: BucketRow, positions: Optional[list[int]] = None, set_to_none: bool = True) -> None:
        """The gradients of parameters ``positions`` (default: all) of ``row``; the others are kept."""
        if positions is None and set_to_none:
            row.drop()
            return
        GC.zero_params(row, range(len(row.bucket.params)) if positions is None else positions, set_to_none,
                       self.plan.shards_optimizer_state)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _write_flags(cols: torch.Tensor, grads: list[Optional[torch.Tensor]]) -> None:
    """Column ``i`` of ``cols`` := 1 if parameter ``i`` has a gradient here, else 0.

    Written with fills on the buffer's own device: copying in a host tensor (pageable memory) would be a
    synchronous copy that blocks the host -- inside a backward hook, on a stream that waits for the
    compute stream -- until the GPU has drained all of backward so far, at every bucket.
    """
    cols.fill_(1.0)
    for i, g in enumerate(grads):
        if g is None:
            cols[..., i].zero_()
