"""ZeroEngine: one object that turns a module + optimizer into a ZeRO training step (stages 0-3).

Design note
-----------
The engine imports nothing from Lightning; it is usable from plain torch.distributed::

    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2))
    for batch in loader:
        loss = model(batch).sum()
        loss.backward()            # gradients are reduced (and sharded) during backward
        engine.step()              # master shards step, full params are rebuilt, grads cleared

The engine composes its parts and only its builder (builder.py) writes into it: the plan ([Note: sharding
plan], plan.py), the optimizers' kinds ([Note: optimizer kinds]), the bucket table and optimizers
(bucket_table.py, param_groups.py), the reducer, the publish, stage 3's partitioned parameters
(stage3/setup.py). Path of one step: docs/ARCHITECTURE.md, "One training step".
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from . import full_state as FS
from .builder import assemble
from .grads import clip_routes, grad_clear as GC, grad_norm as GN
from .layout import tensor_parallel as TP
from .module_routes import remove_module_zero_grad
from .optim import param_groups as PG
from .optim.optimizer_routes import remove_optimizer_methods
from .config import ZeroConfig
from .engine_state import EngineMode
from .memory.report import MemoryReport, measure_model_states
from .placement.io_agreement import agree_on_io, make_resident_on_every_rank
from .optim.optimizer import ShardedOptimizer
from .optim.publish import publish_chunk, publish_masters
from .comm.comm_report import CommReport
from .stage3.partition import ParamPartitioner
from .optim.onebit import local_models as LM


class ZeroEngine:
    """ZeRO stages 0-3 for one module and its optimizer(s) on plain torch.distributed: gradient hooks that
    reduce(-scatter) during backward, fp32 master shards stepped by the user's optimizer, parameters published
    (or, at stage 3, partitioned into units gathered around their use). ``backward`` / ``step`` / ``no_sync`` /
    ``clip_grad_norm_`` are the training API; see docs/ARCHITECTURE.md for the path of one step."""

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
        device_mesh: Optional[Any] = None,
    ) -> None:
        """``optimizer=None`` builds an evaluation-only engine (stage 3 still partitions parameters); a list
        of optimizers over disjoint parameter sets gives each its own shards (``step(opt)``, see param_groups).
        ``device``: where compute happens (default: where the parameters are; needed for a meta model).
        ``device_mesh``: tensor parallelism, a 2-D ("data_parallel", "tensor_parallel") DeviceMesh whose TP dim
        the module was parallelized over: ZeRO shards each local piece over the DP dim (tensor_parallel.py);
        without one, ``config.tensor_parallel_size=T`` takes the process's (N // T, T) mesh (groups.py)."""
        assemble(self, module, optimizer, config, compute_dtype, loss_scaler, check_finite, group, device,
                 device_mesh)  # builder.py: every part, chosen once from the plan and the optimizers' kinds

    @property
    def partitions_params(self) -> bool:
        """Parameters live as stage-3 unit shards (until the module is handed back whole)."""
        return self._partitioned is not None

    @property
    def partitioner(self) -> Optional[ParamPartitioner]:
        """Stage 3's :class:`~.stage3.partition.ParamPartitioner` while the module is partitioned, else None."""
        return self._partitioned.partitioner if self._partitioned is not None else None

    @property
    def buckets(self) -> list:
        """Every gradient bucket in launch order (the bucket table's)."""
        return self.table.buckets

    @property
    def skipped_steps(self) -> int:  # a view of self.counters, which checkpoints read and write
        return self.counters.skipped_steps

    def activation_context(self):
        """Where a training step's saved activations go (host memory with ``offload_activations``); the root
        module's forward enters it by itself, Lightning's ``training_step`` through the strategy."""
        return self.activations.context() if self.activations is not None else contextlib.nullcontext()

    def ensure_published(self) -> None:
        """``overlap_publish``: complete the last step's parameter all-gathers now (publish.py); else a no-op."""
        if self.publisher is not None:
            self.publisher.ensure()

    def gathered_params(self) -> contextlib.AbstractContextManager:
        """Hold full parameters for a block of code (stage 3; below: the last step's publish completed)."""
        self.ensure_published()  # nothing pending at stage 3 (no publish queue)
        return self._partitioned.gathered() if self._partitioned is not None else contextlib.nullcontext()

    def join(self) -> int:
        """End of this rank's evaluation work (stage 3): serve the gathers of ranks that still have batches
        until every rank has called it ([Note: evaluation join]). A no-op below stage 3. With
        ``offload_params="nvme"`` a parameter read that failed on any rank raises here, on every rank."""
        return self.partitioner.join() if self.partitions_params else 0

    @property
    def bucket_params(self) -> list[nn.Parameter]:
        """Managed parameters in master order (optimizer by optimizer, bucket by bucket)."""
        return [p for _, b in self.master_rows() for p in b.params]

    def master_rows(self, shardeds=None) -> list[tuple[list[torch.Tensor], Any]]:
        """(masters, bucket) of every bucket of ``shardeds`` (default: all optimizers)."""
        self.ensure_published()  # whole-model views read (or write) what a pending publish writes
        chosen = self.shardeds if shardeds is None else shardeds
        for s in chosen:  # NVMe offload: the masters (and state) back in memory until the next step
            s.make_resident()
        return [(row, b) for s in chosen for row, b in zip(s.masters, s.buckets)]

    def sharded_for(self, optimizer) -> ShardedOptimizer:  # param_groups.OptimizerSet
        return self.opts.sharded_for(optimizer)

    def sync_module_states(self) -> None:
        """Make every rank start from rank 0's parameters and buffers (as DDP does at wrap time)."""
        TP.broadcast_module_states(self.module, self.group)  # tensor parallel: local pieces, over DP

    def prepare_forward(self) -> None:
        """Before a training/eval step: rank 0's buffers when DDP's forward would broadcast them
        ([Note: buffer broadcast]); stage 3: the root unit (Lightning calls ``training_step``, not ``forward``:
        root parameters it uses are gathered here, not in a hook)."""
        if self._buffers.due(self.reducer):
            self._buffers.sync()
        if self.publisher is not None:  # the root's own parameters: a training_step may use them directly
            self.publisher.wait_for_module(self.module)
        if self.partitions_params:
            self.partitioner.begin_forward()

    def sync_buffers(self) -> None:
        self._buffers.sync()

    # -- backward-side controls ---------------------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally (no collective in stages 0-1) for non-boundary micro-batches."""
        return self.reducer.no_sync()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return self._step_parts.loss_scale()

    # -- step-side ----------------------------------------------------------------------------------
    # ``optimizer``: the one to act on (several optimizers step independently); None = all of them.
    def finalize_grads(self, optimizer=None) -> None:
        """Complete reductions and point the masters' ``.grad`` at this rank's reduced gradients."""
        self.ensure_published()  # before the step writes masters that may alias the parameters
        for s in self.opts.select(optimizer):
            s.finalize(self.reducer, lambda: PG.param_names(self.module))

    def shard_sq_norms(self, optimizer=None) -> list[torch.Tensor]:
        """Per sharded optimizer, the squared norm of its whole gradient, cached for the step (grad_norm.py)."""
        out, device = [], self.params[0].device if self.params else None
        for s in self.opts.select(optimizer):
            self.finalize_grads(s.optimizer)
            out.append(s.global_sq_norm(self.shard_group, device))  # over the shard group: replicas agree
        return out

    def set_grad_sq_norm(self, total: torch.Tensor) -> None:
        """This step's squared norm is ``total`` (a pipeline's, over every stage), for clipping and overflow."""
        GN.impose_sq_norm(self.shardeds, total)

    def global_grad_norm(self, optimizer=None) -> torch.Tensor:
        """2-norm of the (unscaled) gradient over all ranks' shards: DDP's ``clip_grad_norm_`` total."""
        return GN.total_sq_norm(self.shard_sq_norms(optimizer)).sqrt() / self.loss_scale

    def clip_grad_norm_(self, max_norm: float, optimizer=None) -> torch.Tensor:
        """Clip by the global norm; the multiply is fused with unscaling in :meth:`step`."""
        total = self.global_grad_norm(optimizer)
        coef = GN.clip_coef(total, max_norm)
        for s in self.opts.select(optimizer):
            s.clip_coef = coef
        return total

    def clip_grad_value_(self, clip_value: float, optimizer=None) -> None:
        for s in self.opts.select(optimizer):
            s.clip_value = float(clip_value)

    def step(self, optimizer=None) -> bool:
        """Step the optimizer on the master shards and publish the new parameters.

        Returns False when the step was skipped because a gradient was non-finite on some rank
        (only when a loss scaler or ``check_finite`` is active); every rank then skips together.
        """
        self.finalize_grads(optimizer)
        parts = self._step_parts  # chosen once by the builder: no feature flag read here
        phase = parts.phase()  # comm_report's label of this step (a communicating kind's phase)
        inv_scale = 1.0 / parts.loss_scale()  # the scale the gradients carry; the skip decision may change it
        skip = self.last_step_skipped = parts.skip(parts.overflow(optimizer))
        if not skip:
            for s in self.opts.select(optimizer):
                s.unscale_and_clip(inv_scale)
                s.step(self._publish_chunk)  # a streaming state store (NVMe) publishes each bucket as stepped
            self.publish_params(optimizer, streamed=False)
        self._agree_on_io(optimizer)
        self.zero_grad(optimizer)
        self.table.pool.drop_free()  # the step's buffers: none kept until the next ([Note: kept communication buffers])
        self._traffic.step_done(phase)
        return not skip

    def _stores(self, shardeds) -> list:
        """The state stores of ``shardeds`` and, while partitioned, the parameter-shard store."""
        return [s.states for s in shardeds] + ([self.partitioner.store] if self.partitions_params else [])

    def _agree_on_io(self, optimizer=None) -> None:
        """An I/O error of a store on one rank (NVMe: the step's reads / writes, the parameter shards' reads in
        forward and backward) stops every rank with one error (placement/io_agreement.py); no collective when
        no store does I/O that can fail."""
        agree_on_io(self._stores(self.opts.select(optimizer)), self.group,
                    self.params[0].device if self.params else None)
        if self.partitions_params:
            self.partitioner.store.failure = None

    def make_states_resident(self) -> None:
        """Before a whole view every rank takes (saves): masters, state and stage 3's shards in memory (NVMe: read
        back; any rank's failed read one error on all, [Note: verified scratch reads]); bf16 masters widened."""
        make_resident_on_every_rank(self._stores(self.shardeds), self.group,
                                    self.params[0].device if self.params else None)
        self.master_form(wide=True)

    def master_form(self, wide: bool) -> None:  # bf16 masters as their fp32 hi + lo (saves, loads), or bf16 again
        for s in self.shardeds:
            s.widen_masters() if wide else s.narrow_masters()

    def publish_params(self, optimizer=None, streamed: bool = True) -> None:
        """Copy the updated masters into the module's parameters, as the plan publishes (publish.py).
        ``streamed=False``: leave out the optimizers whose state store streams the step (NVMe), which
        published each bucket as it was stepped."""
        chosen = [s for s in self.opts.select(optimizer) if streamed or not s.states.streams]
        publish_masters(self.master_rows(chosen), self.plan, self.table, self.partitioner,
                        self.publisher, self.shard_group, self.plan.placement.steps_on_host,
                        self.config.quantize_weights)

    def _publish_chunk(self, row: list[torch.Tensor], bucket) -> None:
        publish_chunk(row, bucket, self.plan, self.table, self.shard_group, self.config.quantize_weights,
                      self.partitioner)

    def zero_grad(self, optimizer=None, set_to_none: bool = True) -> None:
        """Clear the gradients of ``optimizer`` (default: every one), reduced ones included; torch's
        ``set_to_none`` ([Note: clearing reduced gradients], grad_clear.py)."""
        if self.mode is EngineMode.EVAL_ONLY:
            return
        GC.clear_optimizers(self.opts.select(optimizer), self.reducer, optimizer is None, set_to_none)

    def zero_grad_params(self, params, set_to_none: bool = True) -> None:
        """``module.zero_grad()`` of the engine's module or a submodule (module_routes.py): the gradients of
        ``params`` only -- whole optimizers as their own ``zero_grad``, part of one in place."""
        if self.mode is EngineMode.EVAL_ONLY:
            return
        GC.clear_params(self.shardeds, self.reducer, params, set_to_none)

    def add_param_group(self, optimizer, group: dict) -> None:
        """``optimizer.add_param_group(group)`` after setup (installed on the user's optimizer; param_groups.py)."""
        self.opts.add_param_group(optimizer, group, self.module, self.reducer, self._partitioned)

    # -- accounting -----------------------------------------------------------------------------------
    def comm_report(self) -> CommReport:
        """Bytes this rank put on the wire in the last ``step()`` (forward, backward, step), by collective
        and group (see comm_report.py)."""
        return self._traffic.report()

    def memory_report(self) -> MemoryReport:
        """The tensor bytes this rank holds now, by kind (exact: tests compare them with the floors)."""
        managed = {id(p) for p in self.params}
        frozen = [p for p in self.module.parameters() if id(p) not in managed]  # tied ones once
        report = measure_model_states(self.params, self.shardeds, self.reducer, self.partitioner, frozen)
        report.comm_buffers = self.table.pool.nbytes
        return report

    # -- whole-model views: plain functions in full_state.py --------------------------------------------
    def full_master_params(self) -> list[torch.Tensor]:
        """fp32 full value of every managed parameter on every rank, in :attr:`bucket_params` order (what
        checkpoints and the module handed back take, not the module's rounded copies). Collective."""
        self.master_form(wide=True)
        full = FS.full_master_params(self.master_rows(), self.plan.shards_optimizer_state, self.shard_group)
        self.master_form(wide=False)
        return full

    def restore_fp32_module(self) -> None:
        """Hand the module back whole, in fp32, with the master values (end of training). Stage 3
        un-partitions it for good (as DeepSpeed's ``zero_to_fp32``): the engine is spent."""
        if self.partitions_params:
            self._unpartition()
        elif self.compute_dtype not in (None, torch.float32):
            FS.to_fp32_module(self.module, self.bucket_params, self.full_master_params())

    def average_rank_models(self) -> bool:
        """0/1 Adam between synchronizations: every rank's parameters (and its rank-local optimizer state)
        replaced by the ranks' mean, the one model training stands for ([Note: the ranks' own models],
        onebit/local_models.py). False, and no collective, when the ranks hold one model. Collective."""
        return LM.average_rank_models(self)

    def _unpartition(self) -> None:
        masters = dict(zip(map(id, self.bucket_params), self.full_master_params()))  # {} if EVAL_ONLY
        FS.unpartition(self.module, self.partitioner, masters)
        self.partitioner.store.close()  # the module is whole: the shards' store is spent (NVMe: its file)
        if self.mode is EngineMode.TRAIN:
            self.reducer.remove_hooks()
        self._partitioned = None

    def load_masters_from_module(self) -> None:
        """Cut each master from the module's whole parameter (after training, the module handed back may
        have been changed by the user). No collective."""
        if self.partitions_params or self.mode is EngineMode.EVAL_ONLY:
            raise RuntimeError("load_masters_from_module needs a detached engine (module whole, masters present).")
        FS.load_masters_from_module(self.bucket_params, self.master_items())

    def param_names(self) -> list[str]:
        """Fully-qualified name of each managed parameter, in bucket order (first name of a tied one)."""
        return FS.param_names(self.module, self.bucket_params)

    def master_items(self) -> list[tuple[str, torch.Tensor, Any, torch.Size]]:
        """(name, master, spec, full shape) per managed parameter, in bucket order. ``master``: this rank's
        fp32 slice ``[spec.lo, spec.hi)`` of the flattened parameter (stage 0: all of it); write, publish."""
        return FS.master_items(self.master_rows(), self.param_names()) if self.mode is EngineMode.TRAIN else []

    def unmanaged_shard_items(self) -> list[tuple[str, torch.Tensor, Any, torch.Size]]:
        """Stage 3: (name, unit-shard slice, spec, shape) of each parameter without a master; else empty."""
        if not self.partitions_params:
            return []
        self.partitioner.store.make_resident()  # NVMe: read back until the next step (checkpoints write / load)
        return FS.unmanaged_shard_items(self.module, self.partitioner.units, set(map(id, self.bucket_params)))

    def load_full_state_dict(self, state_dict, strict: bool = True) -> None:
        """A full state dict into the module, the masters and (stage 3) the unit shards; then published."""
        if self.partitions_params:
            self.partitioner.store.make_resident()  # NVMe: written back at the publish's end (after_step)
        FS.load_full_state_dict(self.module, state_dict, strict, self.partitions_params,
                                self.master_items() + self.unmanaged_shard_items())
        if self.mode is EngineMode.TRAIN:
            self.publish_params()
        elif self.partitions_params:
            self.partitioner.after_step()

    def optimizer_state_dict(self, optimizer=None) -> dict:
        """The full state of ``optimizer`` (default: the first) as a plain optimizer saves it. Collective."""
        TP.check_no_full_optimizer_state(self.tensor_parallel)
        return (self.sharded_for(optimizer) if optimizer is not None else self.sharded).full_state_dict(self.shard_group)

    def load_optimizer_state_dict(self, state: dict, optimizer=None) -> None:
        """Load a full optimizer state (from any world size or stage) into this rank's shards."""
        TP.check_no_full_optimizer_state(self.tensor_parallel)
        (self.sharded_for(optimizer) if optimizer is not None else self.sharded).load_full_state_dict(state)

    def remove(self, hand_back: bool = True, keep_states: bool = False) -> None:
        """Detach hooks; a stage-3 module is first handed back whole (see restore_fp32_module), unless
        ``hand_back=False``: after a failure other ranks may be gone, and that collective would hang.
        ``keep_states=True``: the optimizers' NVMe scratch files stay, so the detached engine can still save
        its masters and optimizer state, until :meth:`release_states` ([Note: NVMe states outlive teardown],
        engine/placement/nvme_states.py); else they are removed here."""
        params_store = self.partitioner.store if self.partitions_params else None  # closed once handed back
        if self.activations is not None:
            self.activations.remove()
            self.activations = None
        if self.partitions_params:
            self._partitioned.remove()
            if hand_back:
                self._unpartition()
            else:
                self.partitioner.remove_hooks()
                self._partitioned = None
        if self.mode is EngineMode.TRAIN:
            self.reducer.remove_hooks()
            remove_optimizer_methods(self.optimizers)
            remove_module_zero_grad(self.module)
            clip_routes.untrack(self)
        if self.publisher is not None:
            self.publisher.remove(wait=hand_back)
            self.publisher = None
        if not keep_states:
            self.release_states()
        if params_store is not None:  # the module is whole or the run failed: the shards' store is spent either way
            params_store.close()

    def spill_states(self) -> None:
        """What a whole view read back given up again (NVMe: written out and freed; bf16 masters narrowed)."""
        for s in self.shardeds:
            s.spill()

    def release_states(self) -> None:
        """The optimizers' state stores let go (NVMe: the scratch files removed; idempotent): a detached
        engine's masters and optimizer state are gone after it, it can no longer save them."""
        for s in self.shardeds:
            s.close()
