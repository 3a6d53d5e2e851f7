"""Stage 3 parameter partitioning: gather on demand, release after use, prefetch the next unit.

Design note
-----------
Every parameter keeps its ``nn.Parameter`` object (so optimizers, hooks and ``module.weight.shape`` keep
working) but its storage is resized to zero whenever its unit is not in use. Gathering a unit is one
all-gather of the unit's flat shard followed by a copy-out into the parameters' re-grown storage. The
copy goes through ``param.data`` so autograd's version counters do not move: tensors saved for backward
stay valid across a release/re-gather cycle (FSDP2 relies on the same property).

Lifecycle in a training step::

    forward start       gather the root ... the first ``prefetch`` units' gathers issued behind it
    pre-forward(unit)   gather (or wait for the prefetch) ... prefetch the next ``prefetch`` units in recorded order
    post-forward(unit)  release (root and persistent units stay; the last unit of a verified training forward,
                        [Note: the last unit stays gathered]; reshard_after_forward=False: training units too)
                        ... arm a pre-backward hook on outputs
    pre-backward(unit)  gather again ... prefetch the ``prefetch`` units backward reaches next
    grads complete      reduce-scatter (GradReducer, on its own process group) ... release
    end of backward     release whatever is still gathered; after the step all units are stale

The states and their moves: [Note: unit lifecycle] and [Note: order recording] in lifecycle.py. The hooks that
run these moves (and record and check the order) are :class:`~.hooks.UnitHooks` (hooks.py), which this class
inherits.

Order: the first training forward is recorded; while recording, every gather is preceded by a tiny
all-gather of the unit index, so ranks that run different units fail with :class:`RankDivergenceError`
instead of exchanging mismatched buffers (gloo aborts, NCCL hangs). The order is then compared across
ranks once; later forwards are checked against it locally before any collective, and it drives
prefetch. In eval mode nothing is recorded; every gather is announced instead, so ranks with fewer
batches can serve the others' gathers (:meth:`join`) and divergence fails fast on every rank
([Note: evaluation join] in join.py). ``generate()`` is fastest inside :meth:`gathered` (one gather of
everything, then no collective at all).
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import quantize as Q
from .deferred_init import has_meta_params, materialize
from .pretrained import fill_shards, marked
from .lifecycle import OrderCheck, OrderState, UnitState
from ..placement.io_agreement import agree_on_io
from ..placement.param_stores import ParamShardStore
from .join import RankDivergenceError, agreed_unit, announce, serve_until_all_joined  # noqa: F401 (re-export)
from .hooks import UnitHooks
from .units import Unit
from ..comm.buffer_pool import BufferPool


class ParamPartitioner(UnitHooks):
    def __init__(
        self,
        module: nn.Module,
        units: list[Unit],
        compute_dtype: Optional[torch.dtype],
        device: torch.device,
        store: ParamShardStore,
        group: Optional[Any] = None,
        prefetch: int = 1,
        order_check: "str | OrderCheck" = "strict",
        init_group: Optional[Any] = None,
        quantize: bool = False,
        reshard_after_forward: bool = True,
    ) -> None:
        """``store``: where the unit shards live between uses ([Note: parameter-shard stores] in
        engine/placement/param_stores.py): every shard goes in through it and every gather reads from it; a store
        that reads ahead (NVMe) is told the units along the same recorded order that drives ``prefetch``."""
        self.module = module
        self.init_group = init_group if init_group is not None else group  # deferred init broadcasts from rank 0 of it
        # qwZ: training and evaluation gathers travel as int8 blocks (engine/comm/quantize.py); gathered()
        # (export, generate, handing the module back) stays exact
        self.quantize = quantize
        self.pool: Optional[BufferPool] = None  # the engine's (bucket table's): the gather buffers come from it
        self.units = units
        self.root = units[-1]
        self.device = device
        self.store = store
        self.group = group
        self.order_check = OrderCheck.parse(order_check)
        # units gathered ahead (0: none); prefetch needs a trusted order
        self.prefetch = int(prefetch) if self.order_check is OrderCheck.STRICT else 0
        self.reshard_after_forward = reshard_after_forward
        self.compute_dtype = compute_dtype
        self.world_size = C.world_size(group)
        self.rank = C.rank(group)
        self.unit_of: dict[int, Unit] = {id(p): u for u in units for p in u.params}
        self._order: list[int] = []
        self.order_state = OrderState.RECORDING  # [Note: order recording] in lifecycle.py
        self._pos = 0
        self._gathered_depth = 0  # nesting of gathered() blocks: > 0 holds every unit UNSHARDED
        self.peak_gathered_bytes = 0
        self.load_stats = None  # pretrained weights read into the shards: the bytes held (pretrained_source.py)
        self._held = 0
        self.prefetches = 0
        self.in_flight = self.peak_in_flight = 0  # units whose all-gather is issued and not yet waited for
        self._handles: list[Any] = []
        self._recompute_gathered: set[int] = set()  # units a recompute gathered (activations.py)
        # called as a unit's backward begins: this backward's end must release what it gathers even when
        # none of the engine's parameters gets a gradient (setup.py, PartitionedParams._backward_begins)
        self.on_backward: Optional[Callable[[], None]] = None
        self.eval_only = False  # no step of this engine agrees on the store's I/O: evaluation does (setup.py)
        self._shard_all()
        self._install_hooks()

    # -- shards -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _shard_all(self) -> None:
        """Cut this rank's slices (fp32 for now: masters are taken from them) and free the full params."""
        if has_meta_params(self.module) and marked(self.module):  # each rank reads its own slices
            self.load_stats = fill_shards(self.module, self.units, self.device, self._install_shard)
            return
        if has_meta_params(self.module):  # shard-as-you-build: never hold the whole model
            materialize(self.module, self.units[:-1], self.device, self.init_group, self._shard_unit)
            self._shard_unit(self.root)
            return
        for u in self.units:
            self._shard_unit(u)

    @torch.no_grad()
    def _shard_unit(self, u: Unit) -> None:
        if not u.params:
            return
        full = [p.detach().float() for p in u.params]
        packed = u.layout.pack_rank_major(full, torch.float32)
        self._install_shard(u, packed.view(self.world_size, -1)[self.rank].clone())
        u.layout.done_with(packed)

    def _install_shard(self, u: Unit, chunk: torch.Tensor) -> None:
        """``chunk``: this rank's fp32 slices of the unit, rank-major, into the store (``u.shard``); the
        parameters keep no storage."""
        self.store.install(u, chunk)
        for p in u.params:
            # own storage of exactly the param's size, so releasing frees exactly it
            dtype = self.compute_dtype if (self.compute_dtype and p.is_floating_point()) else p.dtype
            empty = torch.empty(p.shape, dtype=dtype, device=self.device)
            if p.is_meta:  # read from a checkpoint: never had values (keep the Parameter object: optimizers hold it)
                torch.utils.swap_tensors(p, nn.Parameter(empty, p.requires_grad))
            else:
                p.data = empty
            p.data.untyped_storage().resize_(0)
        u.nbytes_full = [p.numel() * p.element_size() for p in u.params]

    def cast_shards(self, dtype: torch.dtype) -> None:
        """Drop the flat shards to the compute dtype once masters have been taken from them."""
        for u in self.units:
            if u.shard is not None and u.shard.dtype != dtype:
                self.store.cast(u, dtype)

    def shard_bytes(self) -> int:
        """Bytes of this rank's unit shards, wherever they are (where: the store's ``bytes_by_location``)."""
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units if u.shard is not None)

    def gathered_bytes(self) -> int:
        """Bytes of full parameters held now, counting all-gather buffers still in flight (kept as a
        running count: this is asked at every gather)."""
        return self._held

    # -- gather / release -----------------------------------------------------------------------------
    def _launch_gather(self, u: Unit, exact: bool = False) -> None:
        if u.state is not UnitState.SHARDED or not u.params:
            return
        if self._announcing():
            self._check_same_unit(u)
        self._launch_gather_unannounced(u, exact)

    def _launch_gather_unannounced(self, u: Unit, exact: bool = False) -> None:
        send = self.store.send_of(u)
        if self.store.failure is not None and self.eval_only and self.world_size == 1:
            self.store.gather_done(u)  # no peer waits in this gather: stop before computing on what it read
            self.raise_store_failure()
        quantized = self.quantize and not exact
        if self.world_size == 1 and not quantized:  # one rank: the shard is the whole gathered buffer
            u.inflight = (C.done(), send, False)
        else:
            n = self.world_size * send.numel()  # [Note: kept communication buffers]
            out = self.pool.take(n, send.dtype, self.device) if self.pool is not None else torch.empty(
                n, dtype=send.dtype, device=self.device)
            gather = Q.all_gather_int8 if quantized else C.all_gather
            u.inflight = (gather(out, send, group=self.group, async_op=True), out, True)
            self._held += out.numel() * out.element_size()
        u.move(UnitState.GATHERING)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._held)

    def _announcing(self) -> bool:
        """Whether a gather is preceded by the unit-index all-gather: while the training order is not
        yet verified, always with order_check="always", and in eval mode (see [Note: evaluation join])."""
        if self.order_check is OrderCheck.OFF or self.world_size == 1:
            return False
        return self.order_check is OrderCheck.ALWAYS or self.order_state is not OrderState.VERIFIED or not self.module.training

    def _check_same_unit(self, u: Unit) -> None:
        if self.world_size == 1:
            return
        agreed_unit(announce(u.index, self.world_size, self.group, self.device), self._describe)

    def _describe(self, index: int) -> str:
        return self.units[index].name if 0 <= index < len(self.units) else f"unit {index}"

    def join(self) -> int:
        """Evaluation: this rank has no more forwards; serve the other ranks' gathers until all are done.

        Every rank must call it once at the end of its evaluation work. Afterwards every unit is released
        on every rank (persistent ones too), so the ranks leave in the same state. Returns the number of
        gathers served.
        """
        if self.world_size == 1 or self.order_check is OrderCheck.OFF:
            self.raise_store_failure()
            return 0

        def serve(index: int) -> None:
            u = self.units[index]
            if u.gathered:  # kept by this rank (persistent) while the others released it: re-gather
                self.release(u, force=True)
            self._launch_gather_unannounced(u)
            self._finish_gather(u)
            self.release(u, force=True)

        served = serve_until_all_joined(self.world_size, self.group, self.device, self._describe, serve)
        self.release_all(include_persistent=True)
        self.raise_store_failure()
        return served

    def raise_store_failure(self) -> None:
        """A store read that failed on any rank since the last agreement stops every rank with one error (every
        rank calls this at the end of its evaluation: :meth:`join`; no collective for a store without I/O). A
        gather whose read failed ran on whatever its buffer held, so the evaluation's outputs since are not
        trusted."""
        try:
            agree_on_io([self.store], self.group, self.device,
                        lost="the evaluation's outputs since the failure are not trusted")
        finally:
            self.store.failure = None  # one error per failure

    def _finish_gather(self, u: Unit) -> None:
        if u.state is not UnitState.GATHERING:
            return
        work, out, own = u.inflight  # own: a gather buffer of its own (not the shard itself, one rank)
        work.wait()
        for p, n in zip(u.params, u.nbytes_full):
            p.data.untyped_storage().resize_(n)
        u.layout.unpack_rank_major(out, [p.data for p in u.params])
        self.store.gather_done(u)  # after the unpack: with one rank ``out`` may be the store's own buffer
        u.inflight = None
        if self.pool is not None and own:  # unpacked into the parameters' storage: nothing reads it any more
            self.pool.give(out)
        self.in_flight -= 1
        u.move(UnitState.UNSHARDED)
        self._held += u.full_bytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._held)
        if own:
            self._held -= out.numel() * out.element_size()  # the gather buffer is dropped on return

    def use_pool(self, pool: BufferPool) -> None:
        """Take each gather's output buffer, and each unit's padded-parameter staging, from ``pool``."""
        self.pool = pool
        for u in self.units:
            if u.layout is not None:  # a unit without parameters (the root, often) has no layout
                u.layout.pool = pool

    def gather(self, u: Unit) -> None:
        self._launch_gather(u)
        self._finish_gather(u)

    def release(self, u: Unit, force: bool = False) -> None:
        if self._gathered_depth or (u.persistent and not force):
            return
        self._finish_gather(u)  # a gather in flight completes before its storage can be dropped
        if u.state is UnitState.UNSHARDED:
            for p in u.params:
                p.data.untyped_storage().resize_(0)
            u.move(UnitState.SHARDED)
            self._held -= u.full_bytes

    def release_all(self, include_persistent: bool = False) -> None:
        for u in self.units:
            self.release(u, force=include_persistent)

    # -- step boundaries ------------------------------------------------------------------------------
    def end_of_backward(self) -> None:
        self.guard.end_probe()
        self._recompute_gathered.clear()
        for u in self.units:
            self._finish_gather(u)
        self.release_all()
        # the root stays whole through forward and backward; between backward and the next forward
        # (optimizer step, next micro-batch's data loading) only shards need to exist
        self.release(self.root, force=True)
        self.store.drop_reads()
        self._pos = 0
        if self._order:
            self._order_done()

    def after_step(self) -> None:
        """Shards changed: every gathered copy is stale. Verify the recorded order once."""
        self.release_all(include_persistent=True)
        self.store.spill()  # the publish wrote the new values, a whole view may have read them back
        self._pos = 0
        if self._order and self.order_state is not OrderState.VERIFIED:
            self._order_done()
            self._verify_order()

    def _verify_order(self) -> None:
        digest = zlib.crc32(bytes(str(self._order), "ascii"))
        mine = torch.tensor([len(self._order), digest], dtype=torch.int64, device=self.device)
        allv = torch.empty(2 * self.world_size, dtype=torch.int64, device=self.device)
        C.all_gather(allv, mine, group=self.group)
        if (allv.view(-1, 2) != mine).any():
            raise RankDivergenceError(
                f"ZeRO-3 ranks recorded different unit orders in their first step (rank {self.rank}: "
                f"{[self.units[i].name for i in self._order]}). Every rank must run the same modules."
            )
        self.order_state = self.order_state.check(OrderState.VERIFIED)

    def _order_done(self) -> None:
        if self.order_state is OrderState.RECORDING:
            self.order_state = self.order_state.check(OrderState.RECORDED)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold every parameter whole for a block (generate(), export): no collective inside."""
        if self._gathered_depth == 0:
            if self.quantize:  # units gathered for compute hold rounded values: gather them exactly
                self.release_all(include_persistent=True)
            for u in self.units:
                self._launch_gather(u, exact=True)
                if self.store.gathers_one_at_a_time:  # one unit's shard in the store's buffer at a time
                    self._finish_gather(u)
            for u in self.units:
                self._finish_gather(u)
        self._gathered_depth += 1
        try:
            yield
        finally:
            self._gathered_depth -= 1
            if self._gathered_depth == 0:
                self.release_all(include_persistent=True)
