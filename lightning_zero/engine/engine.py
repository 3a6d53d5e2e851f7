"""ZeroEngine: one object that turns a module + optimizer into a ZeRO training step (stages 0-3).

Design note
-----------
The engine imports nothing from Lightning; it is usable from plain torch.distributed::

    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2))
    for batch in loader:
        loss = model(batch).sum()
        loss.backward()            # gradients are reduced (and sharded) during backward
        engine.step()              # master shards step, full params are rebuilt, grads cleared

Path of one step: ``backward`` -> :class:`~.reducer.GradReducer` hooks reduce buckets as they fill ->
:meth:`step` finalizes (which parameters were used anywhere), points the masters' ``.grad`` at the
reduced shards, computes the global norm when clipping or loss scaling needs it (one all-reduce),
applies unscale and clip in one multiply, steps the user's optimizer on the masters, and publishes the
updated shards back into the module's parameters (one all-gather per bucket).

Several optimizers (a GAN): pass a list over disjoint parameter sets; each gets its own master shards
and buckets, and ``step(opt)`` / ``zero_grad(opt)`` / ``clip_grad_norm_(x, opt)`` act on that one only
(:mod:`.param_groups`, which also handles ``optimizer.add_param_group`` after setup).

Accumulation: wrap non-boundary micro-batches in :meth:`no_sync` (stages 0-1 issue no collective
there; stage 2 reduces each micro-batch into its gradient shard regardless, as DeepSpeed does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Iterator, Optional

import torch
from torch import nn

from . import collectives as C
from .stage3.deferred_init import has_meta_params
from .stage3.units import build_units
from .config import ZeroConfig
from .memory import MemoryReport
from .full_state import FullStateMixin
from .groups import reduce_scatter_group
from .optimizer import ShardedOptimizer
from .publish import PublishQueue
from .comm_report import CommReport, StepTraffic
from .stage3.partition import ParamPartitioner
from .reducer import GradReducer
from .stage3.release import BackwardReleaser
from . import param_groups as PG

_log = logging.getLogger("lightning_zero.engine")


class ZeroEngine(FullStateMixin):
    def __init__(
        self,
        module: nn.Module,
        optimizer: Any,
        config: Optional[ZeroConfig] = None,
        compute_dtype: Optional[torch.dtype] = None,
        loss_scaler: Optional[Any] = None,
        check_finite: bool = False,
        group: Optional[Any] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        """``optimizer=None`` builds an evaluation-only engine (stage 3 still partitions parameters); a list
        of optimizers over disjoint parameter sets gives each its own shards (``step(opt)``, see param_groups).

        ``device``: where compute happens (default: where the parameters are; needed for a meta model).
        """
        self.config = cfg = config or ZeroConfig()
        self.module = module
        self.optimizers = PG.as_optimizer_list(optimizer)
        optimizer = self.optimizer = self.optimizers[0] if self.optimizers else None
        self.group = group
        self.compute_dtype = compute_dtype
        self.loss_scaler = loss_scaler
        self.check_finite = check_finite or loss_scaler is not None
        self.world_size = C.world_size(group)
        self.rank = C.rank(group)
        per_opt = PG.managed_params(module, self.optimizers)
        self.params = [p for ps in per_opt for p in ps]
        if not has_meta_params(module):  # a meta model is broadcast unit by unit as it is built
            self.sync_module_states()
        mixed = compute_dtype is not None and compute_dtype != torch.float32
        self.partitioner: Optional[ParamPartitioner] = None
        sources = None
        reduce_group = group
        if cfg.stage == 3:
            if len(self.optimizers) > 1 and cfg.order_check == "strict":
                # each optimizer runs its own forward/backward: a step holds several different forward
                # sequences, which one recorded order cannot describe. Check before every gather instead.
                cfg = self.config = dataclasses.replace(cfg, order_check="always")
            units = build_units(module, self.world_size, self.rank, cfg.unit_classes, cfg.unit_bytes,
                                cfg.persist_numel)
            device = torch.device(device) if device is not None else _compute_device(module)
            if self.rank == 0:
                _log.info(units.describe())
            self.partitioner = ParamPartitioner(module, units, compute_dtype, device, cfg.offload_params, group,
                                                cfg.prefetch, cfg.order_check, quantize=cfg.quantize_weights)
            self.partitioner.guard.eval_only = not self.optimizers
            self.buckets, self._bucket_opt, sources, self._bucket_unit = PG.build_optimizer_buckets(
                self, per_opt, units)
            # releases each unit as soon as its backward is over (see release.py for units with frozen params)
            with_bucket = {id(u) for u in self._bucket_unit}
            frozen = [u for u in units if id(u) not in with_bucket and u.params and not u.persistent]
            self.releaser = BackwardReleaser(self.buckets, self._bucket_unit, self.partitioner.release, frozen)
            # reduce-scatters get their own group: they interleave with gathers differently per rank.
            # Made once per process and shared by later engines (see [Note: why a group is never
            # re-created] in groups.py); an evaluation-only engine reduces nothing and needs none.
            if self.world_size > 1 and optimizer is not None:
                reduce_group = reduce_scatter_group(group)
        else:
            self.buckets, self._bucket_opt, _, _ = PG.build_optimizer_buckets(self, per_opt)
        self._sources = sources
        # masters are cut from the fp32 values before the module drops to the compute dtype
        self.shardeds: list[ShardedOptimizer] = []
        for k, opt in enumerate(self.optimizers):
            mine = [i for i, o in enumerate(self._bucket_opt) if o == k]
            self.shardeds.append(ShardedOptimizer(
                opt, [self.buckets[i] for i in mine], cfg.stage, cfg.offload_optimizer, compute_dtype,
                [sources[i] for i in mine] if sources is not None else None,
                # qwZ rounds the gathered parameters: an fp32 master may not alias them (stages 1-2)
                separate_masters=cfg.quantize_weights and cfg.stage in (1, 2)))
        self.sharded: Optional[ShardedOptimizer] = self.shardeds[0] if self.shardeds else None
        if mixed:
            module.to(compute_dtype)  # params (released ones too) and floating buffers, like module.half()
            if self.partitioner is not None and optimizer is not None:
                self.partitioner.cast_shards(compute_dtype)
                # the shards are new tensors now: point publish_params at them, not at the fp32 originals
                self._sources = [[dict(zip(map(id, u.params), u.local_views()))[id(p)] for p in b.params]
                                 for b, u in zip(self.buckets, self._bucket_unit)]
        self.reducer: Optional[GradReducer] = None
        # stages 1-2: the publish all-gather overlaps the next forward (publish.py)
        self.publisher = (PublishQueue(module) if cfg.stage in (1, 2) and cfg.overlap_publish and optimizer
                          is not None else None)
        if optimizer is not None:
            self.reducer = GradReducer(
                self.buckets, cfg.stage, cfg.reduce_dtype, reduce_group,
                on_bucket_complete=self.releaser.bucket_complete if self.partitioner else None,
                on_end_of_backward=self._end_of_backward if self.partitioner else self.ensure_published,
                host_grads=cfg.offload_optimizer,
                mode="int8" if cfg.quantize_grads else C.grad_reduce_mode(cfg.grad_reduce, reduce_group),
            )
            PG.install_optimizer_methods(self)
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._traffic = StepTraffic(group)  # comm_report(): the collectives of the last step

    def _end_of_backward(self) -> None:
        self.partitioner.end_of_backward()
        self.releaser.reset()

    def ensure_published(self) -> None:
        """Stages 1-2 with ``overlap_publish``: complete the parameter all-gathers of the last step now
        (see publish.py for where the engine does this itself). A no-op otherwise."""
        if self.publisher is not None:
            self.publisher.ensure()

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Hold full parameters for a block of code (stage 3; below: the last step's publish completed)."""
        if self.partitioner is None:
            self.ensure_published()
            yield
            return
        with torch.no_grad(), self.partitioner.gathered():
            yield

    def join(self) -> int:
        """End of this rank's evaluation work (stage 3): serve the gathers of ranks that still have batches
        until every rank has called it ([Note: evaluation join]). A no-op below stage 3."""
        return self.partitioner.join() if self.partitioner is not None else 0

    @property
    def bucket_params(self) -> list[nn.Parameter]:
        """Managed parameters in master order: optimizer by optimizer, bucket by bucket (the order of
        full_master_params() and master_items())."""
        return [p for _, b in self.master_rows() for p in b.params]

    def master_rows(self, shardeds=None) -> list[tuple[list[torch.Tensor], Any]]:
        """(masters, bucket) of every bucket of ``shardeds`` (default: all optimizers)."""
        self.ensure_published()  # whole-model views read (or write) what a pending publish writes
        return [(row, b) for s in (self.shardeds if shardeds is None else shardeds)
                for row, b in zip(s.masters, s.buckets)]

    def sharded_for(self, optimizer) -> ShardedOptimizer:
        for s in self.shardeds:
            if s.optimizer is optimizer:
                return s
        raise ValueError(f"{type(optimizer).__name__} is not one of the optimizers this engine shards.")

    def sync_module_states(self) -> None:
        """Make every rank start from rank 0's parameters and buffers (as DDP does at wrap time)."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            tensors = [p.data for p in self.module.parameters()] + [b for b in self.module.buffers()]
            C.broadcast_flat(tensors, self.group)

    def prepare_forward(self) -> None:
        """Before a training/eval step: rank 0's buffers (training, like DDP); stage 3: the root unit.

        Lightning calls ``training_step``, not ``forward``, so root parameters used directly in a step
        must be gathered here rather than in a forward hook.
        """
        if self.module.training:
            self.sync_buffers()
        if self.publisher is not None:  # the root's own parameters: a training_step may use them directly
            self.publisher.wait_for_module(self.module)
        if self.partitioner is not None:
            self.partitioner.gather(self.partitioner.root)

    def sync_buffers(self) -> None:
        if self.world_size > 1 and self.config.broadcast_buffers:
            with torch.no_grad():
                C.broadcast_flat(list(self.module.buffers()), self.group)

    # -- backward-side controls ---------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no collective in stages 0-1) for non-boundary micro-batches."""
        prev = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = prev

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.scale) if self.loss_scaler is not None else 1.0

    # -- step-side ----------------------------------------------------------------------------------
    # ``optimizer``: the one to act on (several optimizers step independently); None = all of them.
    def finalize_grads(self, optimizer=None) -> None:
        """Complete reductions and point the masters' ``.grad`` at this rank's reduced gradients."""
        self.ensure_published()  # before the step writes masters that may alias the parameters
        for s in PG.select(self, optimizer):
            if s.grads_final:
                continue
            if s.frozen_at_setup:
                s.check_not_unfrozen(lambda: PG.param_names(self.module))
            masks = self.reducer.finalize([b.index for b in s.buckets])
            grads: list[list[Optional[torch.Tensor]]] = []
            for b, mask in zip(s.buckets, masks):
                if self.config.stage == 0:
                    row = [p.grad if used else None for p, used in zip(b.params, mask.tolist())]
                else:
                    host = self.reducer.host_shards[b.index]  # offload: already copied as the bucket completed
                    shard = host if host is not None else self.reducer.grad_shards[b.index]
                    views = b.local_views(shard) if shard is not None else [None] * len(b.params)
                    row = [v if used else None for v, used in zip(views, mask.tolist())]
                grads.append(row)
            s.assign_grads(grads)
            s.grads_final = True

    def _global_sq_norm(self, optimizer=None) -> torch.Tensor:
        total = None
        for s in PG.select(self, optimizer):
            if s.sq_norm is None:
                self.finalize_grads(s.optimizer)
                sq = s.local_sq_norm()
                if self.config.stage >= 1:  # shards are disjoint: sum their squares over ranks
                    dev = self.params[0].device if self.params else sq.device
                    sq_dev = sq.to(dev)
                    C.all_reduce(sq_dev, group=self.group)
                    sq = sq_dev.to(sq.device)
                s.sq_norm = sq
            total = s.sq_norm if total is None else total + s.sq_norm.to(total.device)
        return total if total is not None else torch.zeros(())

    def global_grad_norm(self, optimizer=None) -> torch.Tensor:
        """2-norm of the (unscaled) gradient over all ranks' shards: DDP's ``clip_grad_norm_`` total."""
        return self._global_sq_norm(optimizer).sqrt() / self.loss_scale

    def clip_grad_norm_(self, max_norm: float, optimizer=None) -> torch.Tensor:
        """Clip by the global norm; the multiply is fused with unscaling in :meth:`step`."""
        total = self.global_grad_norm(optimizer)
        coef = min(1.0, float(max_norm) / (float(total) + 1e-6)) if math.isfinite(total) else None
        for s in PG.select(self, optimizer):
            s.clip_coef = coef
        return total

    def clip_grad_value_(self, clip_value: float, optimizer=None) -> None:
        for s in PG.select(self, optimizer):
            s.clip_value = float(clip_value)

    def step(self, optimizer=None) -> bool:
        """Step the optimizer on the master shards and publish the new parameters.

        Returns False when the step was skipped because a gradient was non-finite on some rank
        (only when a loss scaler or ``check_finite`` is active); every rank then skips together.
        """
        self.finalize_grads(optimizer)
        inv_scale = 1.0 / self.loss_scale  # the scale the gradients carry; update() below may change it
        overflow = False
        if self.check_finite:
            overflow = not bool(torch.isfinite(self._global_sq_norm(optimizer)))
        if self.loss_scaler is not None:
            skip = self.loss_scaler.update(overflow)
        else:
            skip = overflow
        self.last_step_skipped = skip
        self.skipped_steps += int(skip)
        if not skip:
            for s in PG.select(self, optimizer):
                s.scale_grads(inv_scale * (s.clip_coef if s.clip_coef is not None else 1.0))
                if s.clip_value is not None:
                    s.clamp_grads(s.clip_value)
                s.step()
            self.publish_params(optimizer)
        self.zero_grad(optimizer)
        self._traffic.step_done()
        return not skip

    @torch.no_grad()
    def publish_params(self, optimizer=None) -> None:
        """Copy the updated masters into the module's parameters (all-gather in stages 1-2).

        Stage 3 only refreshes the unit shards; units are gathered again when next used. An
        evaluation-only engine has no masters: its unit shards already hold the values.
        """
        if self.sharded is None:
            if self.partitioner is not None:
                self.partitioner.after_step()
            return
        rows = self.master_rows(PG.select(self, optimizer))
        if self.partitioner is not None:
            for row, b in rows:
                for m, src in zip(row, self._sources[b.index]):
                    if m is not src:
                        src.copy_(m, non_blocking=True)
            self.partitioner.after_step()
            return
        if self.config.stage == 0:
            for row, b in rows:
                for m, p in zip(row, b.params):
                    if m is not p:
                        p.data.copy_(m.view_as(p))
            return
        if self.publisher is not None:
            self.publisher.launch(rows, self.group, self.config.offload_optimizer, self.config.quantize_weights)
            return
        pending = []
        for row, b in rows:
            # offload: the host masters are cast into a pinned host chunk, then one asynchronous
            # host->device copy per bucket (not one small, synchronous, fp32 copy per parameter)
            pending.append((b, *b.all_gather(row, b.params[0].dtype, self.group, host=self.config.offload_optimizer,
                                              async_op=True, quantized=self.config.quantize_weights)))
            if len(pending) > 2:  # two buckets in flight overlap communication without a second model copy
                self._unpack(*pending.pop(0))
        for item in pending:
            self._unpack(*item)

    @staticmethod
    def _unpack(b, work, out) -> None:
        work.wait()
        b.unpack_rank_major(out, [p.data for p in b.params])

    def zero_grad(self, optimizer=None) -> None:
        if self.reducer is None:
            return
        chosen = PG.select(self, optimizer)
        self.reducer.clear(None if optimizer is None else [b.index for s in chosen for b in s.buckets])
        for s in chosen:
            s.clear_grads()
            s.reset_step_state()

    # -- accounting -----------------------------------------------------------------------------------
    def comm_report(self) -> CommReport:
        """Bytes this rank put on the wire in the last ``step()`` (forward, backward, step), by collective
        and group (see comm_report.py)."""
        return self._traffic.report()

    def memory_report(self) -> MemoryReport:
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        part = self.partitioner
        r = MemoryReport(
            params=part.shard_bytes() + part.gathered_bytes() if part is not None else nbytes(self.params),
            grads=nbytes(p.grad for p in self.params),
            grad_shards=nbytes(self.reducer.grad_shards),
            master=sum(s.master_bytes() for s in self.shardeds),
            optimizer_state=sum(s.state_bytes() for s in self.shardeds),
        )
        if self.config.offload_optimizer:
            r.host = r.master + r.optimizer_state
        if part is not None and self.config.offload_params:
            r.host += part.shard_bytes()
        return r

    def remove(self, hand_back: bool = True) -> None:
        """Detach hooks; a stage-3 module is first handed back whole (see restore_fp32_module).

        ``hand_back=False`` skips that collective: after a failure other ranks may be gone, and waiting for
        them would turn an error into a hang. The stage-3 module then stays partitioned (unusable).
        """
        if self.partitioner is not None:
            self.releaser.remove()
            if hand_back:
                self._unpartition()
            else:
                self.partitioner.remove_hooks()
                self.partitioner = None
        if self.reducer is not None:
            self.reducer.remove_hooks()
            PG.remove_optimizer_methods(self)
        if self.publisher is not None:
            self.publisher.remove(wait=hand_back)
            self.publisher = None


def _compute_device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
