"""How a ZeroEngine is assembled: layout -> groups; plan -> optimizer kinds, stores, reducer, stage-3 hooks.

The engine's constructor is one call of :func:`assemble`, which sets every attribute the engine has, in the
order the parts depend on each other, and chooses once what a step calls (:class:`StepParts`), so
``ZeroEngine.step`` reads no feature flag ([Note: sharding plan] for what the plan decides,
[Note: optimizer kinds] for the kinds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .grads import clip_routes
from .comm import collectives as C
from .comm.comm_report import StepTraffic
from .config import ZeroConfig
from .engine_state import EngineMode, StepCounters
from .grads import grad_norm as GN
from .grads.bucket_table import BucketMaker
from .grads.buffer_sync import BufferBroadcast
from .grads.reducer import GradReducer
from .layout.groups import engine_groups, tensor_parallel_mesh
from .memory.activations import activation_memory
from .module_routes import install_module_zero_grad
from .optim import param_groups as PG
from .optim.kinds import Kind, KindSetup, kind_of
from .optim.low_precision import check_low_precision
from .optim.onebit import local_models as LM
from .optim.optimizer_routes import install_optimizer_methods
from .optim.publish import PublishQueue
from .placement.io_agreement import agree_on_io
from .plan import ShardingPlan
from .stage3.deferred_init import compute_device, has_meta_params
from .stage3.setup import PartitionedParams, stage3_config


@dataclass(frozen=True)
class StepParts:
    """What ``ZeroEngine.step`` calls, chosen once: whether the gradients are checked for overflow, who decides
    (and counts) a skip, and which optimizer labels the step's traffic in comm_report."""

    overflow: Callable[[Any], bool]  # (optimizer or None) -> a non-finite gradient on some rank
    skip: Callable[[bool], bool]  # overflow -> this step is skipped (the scaler, else the engine's counter)
    phase: Callable[[], Optional[str]]  # the coming step's traffic label, asked before it steps
    loss_scale: Callable[[], float]  # the scale the gradients carry (1 without a scaler)


def assemble(engine: Any, module, optimizer, config: Optional[ZeroConfig], compute_dtype, loss_scaler,
             check_finite: bool, group, device, device_mesh) -> None:
    """Every part of ``engine`` (see ZeroEngine.__init__ for the arguments)."""
    engine.config = cfg = config or ZeroConfig()
    engine.plan = plan = ShardingPlan.of(cfg)  # what the stage means, read below ([Note: sharding plan])
    engine.module = module
    engine.optimizers = optimizers = PG.as_optimizer_list(optimizer)
    engine.optimizer = optimizers[0] if optimizers else None
    engine.mode = EngineMode.TRAIN if optimizers else EngineMode.EVAL_ONLY
    train = engine.mode is EngineMode.TRAIN
    engine.compute_dtype, engine.loss_scaler = compute_dtype, loss_scaler
    engine.counters = StepCounters.of(loss_scaler)  # the one count of skipped steps (engine_state.py)
    engine.check_finite = check_finite or loss_scaler is not None
    _layout(engine, cfg, plan, group, device, device_mesh)
    kinds = [kind_of(o) for o in optimizers]  # asked once ([Note: optimizer kinds])
    setup = KindSetup(plan, cfg, optimizers, engine.tensor_parallel, loss_scaler)
    for kind, opt in zip(kinds, optimizers):  # one clear error before anything is sharded
        kind.check(opt, setup)
    check_low_precision(cfg, compute_dtype, optimizers, kinds)  # [Note: low-precision optimizer states]
    per_opt = PG.managed_params(module, optimizers)
    if not has_meta_params(module):  # a meta model is broadcast unit by unit as it is built
        engine.sync_module_states()
    part = engine._partitioned = _partition(engine, cfg, plan, device, train)
    cfg = engine.config
    _stores(engine, cfg, plan, per_opt, kinds)
    engine.reducer = _reducer(engine, cfg, plan, kinds) if train else None
    engine.publisher = PublishQueue(module) if plan.overlap_publish and train else None  # publish.py
    if train:
        install_optimizer_methods(optimizers, engine.add_param_group, engine.zero_grad,
                                  lambda opt: engine.sharded_for(opt).local_state_view())
        install_module_zero_grad(module, engine.zero_grad_params)
        clip_routes.track(engine)  # torch.nn.utils.clip_grad_norm_ on its parameters ([Note: torch's clipping routed])
    if part is not None:
        part.release_by_buckets(engine.table, lambda: engine.reducer is not None and engine.reducer.in_backward)
    engine.last_step_skipped = False
    engine.mean_swap = LM.MeanSwap(engine)  # 0/1 Adam: the ranks' mean model during evaluation inside fit
    engine._buffers = BufferBroadcast(module, engine.group, cfg.broadcast_buffers, eval_only=not train)
    engine._traffic = StepTraffic(engine.group)  # comm_report(): the collectives of the last step
    engine.activations = activation_memory(  # None: no checkpointing / offload
        module, cfg, part.units if part is not None else None)
    engine._step_parts = _step_parts(engine, kinds)


def _layout(engine, cfg, plan, group, device, device_mesh) -> None:
    """[Note: one parallel layout] (layout/dims.py): hybrid sharding's shard / replicate groups, the stage-3
    reduce-scatter group, the TP view; ``world`` (the group, or the mesh's data-parallel dim) broadcasts."""
    module = engine.module
    if device_mesh is None and cfg.tensor_parallel_size is not None and C.world_size(group) > 1:
        where = torch.device(device) if device is not None else compute_device(module)
        device_mesh = tensor_parallel_mesh(where.type, cfg.tensor_parallel_size)
    train = engine.mode is EngineMode.TRAIN
    engine.groups = groups = engine_groups(cfg, plan, train, group, device_mesh, module)
    engine.tensor_parallel = groups.tensor
    engine.group = groups.world
    engine.shard_group, engine.replicate_group = groups.shard, groups.replicate
    engine.world_size = C.world_size(engine.shard_group)  # the ranks a parameter is sharded over
    engine.rank = C.rank(engine.shard_group)


def _partition(engine, cfg, plan, device, train) -> Optional[PartitionedParams]:
    """Stage 3's partitioned parameters (stage3/setup.py), else None; the engine's config gains stage 3's
    adjustments."""
    if not plan.shards_params:
        return None
    engine.config = cfg = stage3_config(cfg, len(engine.optimizers))
    return PartitionedParams(engine.module, cfg, engine.world_size, engine.rank, engine.compute_dtype, device,
                             engine.shard_group, engine.group, eval_only=not train)


def _stores(engine, cfg, plan, per_opt, kinds) -> None:
    """The bucket table, each optimizer's ShardedOptimizer over its rows (masters cut from the fp32 values
    before the module drops to the compute dtype), each kind bound to its ShardedOptimizer; then the cast."""
    part, compute_dtype = engine._partitioned, engine.compute_dtype
    maker = BucketMaker(engine.world_size, engine.rank, cfg.bucket_bytes, plan.shards_optimizer_state,
                        part.units if part is not None else None)
    engine.table = maker.table(engine.module, per_opt)
    if part is not None:  # the unit gathers borrow from the buckets' pool too
        part.partitioner.use_pool(engine.table.pool)
    engine.opts = PG.OptimizerSet(engine.optimizers, per_opt, engine.table, maker, PG.shard_optimizers(
        engine.optimizers, engine.table, plan, cfg, compute_dtype, engine.tensor_parallel,
        part.partitioner.store if part is not None else None, engine.group, kinds))
    engine.shardeds = engine.opts.shardeds
    engine.params = engine.opts.params  # managed, optimizer by optimizer; add_param_group appends
    engine.sharded = engine.shardeds[0] if engine.shardeds else None
    for kind, s in zip(kinds, engine.shardeds):
        kind.bind(s, engine.shard_group)
    if compute_dtype is not None and compute_dtype != torch.float32:
        engine.module.to(compute_dtype)  # params (released ones too) and floating buffers, like module.half()
        if part is not None and engine.mode is EngineMode.TRAIN:
            part.partitioner.cast_shards(compute_dtype)
            engine.table.repoint_sources()  # new shard tensors: publish into them, not the fp32 originals
        for k, s in enumerate(engine.shardeds):  # a bf16 master is its bf16 parameter slice from now on
            s.alias_low_precision_masters([r.sources for r in engine.table.of_optimizer(k)] if part is not None
                                          else None)
    if part is not None:  # the shards where they live between uses (NVMe: their file) now
        part.partitioner.store.spill()
        agree_on_io([part.partitioner.store], engine.group, part.partitioner.device)


def _reducer(engine, cfg, plan, kinds) -> GradReducer:
    """The reducer over the table's rows; a communicating kind's probe decides when it reduces nothing."""
    part = engine._partitioned
    probes = [p for p in (k.local_grads(o) for k, o in zip(kinds, engine.optimizers)) if p is not None]
    return GradReducer(
        list(engine.table.rows), plan, cfg.reduce_dtype, engine.groups.reduce,
        on_bucket_complete=part.bucket_complete if part is not None else None,
        on_end_of_backward=part.end_of_backward if part is not None else engine.ensure_published,
        replicate_group=engine.replicate_group,
        mode="int8" if cfg.quantize_grads else C.grad_reduce_mode(cfg.grad_reduce, engine.groups.reduce),
        **(dict(local_grads=probes[0]) if probes else {}))


def _step_parts(engine, kinds) -> StepParts:
    def norm_not_finite(optimizer) -> bool:
        return not bool(torch.isfinite(GN.total_sq_norm(engine.shard_sq_norms(optimizer))))

    labelled = [(k, o) for k, o in zip(kinds, engine.optimizers) if k.kind is Kind.COMMUNICATING]
    scaler = engine.loss_scaler
    return StepParts(
        overflow=norm_not_finite if engine.check_finite else (lambda optimizer: False),
        # whoever decides the skip records it in engine.counters: the scaler, else the engine itself (its
        # counters as they are then: a precision plugin hands the engine its own after construction)
        skip=scaler.update if scaler is not None else (lambda overflow: engine.counters.record(overflow)),
        phase=(lambda: labelled[0][0].phase(labelled[0][1])) if labelled else (lambda: None),
        loss_scale=(lambda: float(scaler.scale)) if scaler is not None else (lambda: 1.0))
