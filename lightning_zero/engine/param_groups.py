"""Which optimizer owns which parameters: several optimizers, and parameter groups added after setup.

Design note
-----------
The engine may manage several optimizers over disjoint parameter sets (a GAN's generator and
discriminator). Each gets its own :class:`~.optimizer.ShardedOptimizer` and its own buckets -- a bucket
never spans two optimizers -- so ``engine.step(opt)`` finalizes, steps, publishes and clears exactly that
optimizer's buckets. All buckets share one :class:`~.reducer.GradReducer` (one numbering, one launch
order): stages 0-2 order them by the registration position of their parameters (reverse, as backward
produces gradients), stage 3 by unit, so in-order launching works as with one optimizer.

``optimizer.add_param_group(group)`` after setup (Lightning's ``BaseFinetuning`` unfreezing a backbone)
is intercepted on the user's optimizer object: the group names module parameters, which become new
buckets (stage 3: new per-unit gradient buckets; the parameters already live in their unit's shard)
with master shards cut from their current values, appended to the reducer and to that optimizer; the
existing buckets, masters and optimizer state are untouched. Every rank must make the same call (as
under DDP), so the new collectives line up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from .buckets import build_buckets
from .optimizer import ShardedOptimizer
from .stage3.units import grad_buckets_for_units

if TYPE_CHECKING:  # pragma: no cover
    from .engine import ZeroEngine


def as_optimizer_list(optimizer) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    opts = list(optimizer)
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise TypeError(f"Expected a torch.optim.Optimizer or a non-empty list of them; got {optimizer!r}.")
    return opts


def param_names(module: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    return names


def managed_params(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[list[nn.Parameter]]:
    """Per optimizer, its trainable module parameters in registration order; refuses stray tensors, a
    parameter listed twice, and a parameter held by two optimizers."""
    in_module = {id(p) for p in module.parameters()}
    owner: dict[int, int] = {}
    names = param_names(module)
    for k, opt in enumerate(optimizers):
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        stray = set(ids) - in_module
        if stray:
            raise ValueError(
                f"The optimizer holds {len(stray)} tensor(s) that are not parameters of the module; "
                "ZeRO can only shard parameters of the module it wraps."
            )
        if len(ids) != len(set(ids)):
            raise ValueError("A parameter appears more than once in the optimizer's param_groups.")
        for i in ids:
            if i in owner:
                raise ValueError(_shared_error(names[i], owner[i], k))
            owner[i] = k
    return [[p for p in module.parameters() if p.requires_grad and owner.get(id(p)) == k]
            for k in range(len(optimizers))]


def _shared_error(name: str, a: int, b: int) -> str:
    return (f"Parameter '{name}' is in optimizer {a} and optimizer {b}. ZeRO shards each optimizer's "
            "parameters separately, so every parameter may belong to one optimizer only. Allowed: "
            "optimizers over disjoint parameter sets (e.g. a GAN's generator and discriminator).")


def build_optimizer_buckets(engine: "ZeroEngine", per_opt: list[list[nn.Parameter]], units=None):
    """Buckets of every optimizer in one launch order. Returns (buckets, owner optimizer index per bucket,
    stage 3: unit-shard sources per bucket, unit per bucket)."""
    items = []  # (order key, optimizer index, bucket, sources, unit)
    if units is not None:
        backward = list(reversed(units[:-1])) + [units[-1]]
        pos = {id(u): i for i, u in enumerate(backward)}
        for k, params in enumerate(per_opt):
            bs, srcs, owner = grad_buckets_for_units(units, params, engine.world_size, engine.rank)
            items += [((pos[id(u)], k), k, b, s, u) for b, s, u in zip(bs, srcs, owner)]
    else:
        order = {id(p): i for i, p in enumerate(engine.module.parameters())}
        for k, params in enumerate(per_opt):
            for b in build_buckets(params, engine.world_size, engine.rank, engine.config.bucket_bytes,
                                   sharded=engine.config.stage >= 1):
                items.append(((-order[id(b.params[0])], k), k, b, None, None))
    items.sort(key=lambda it: it[0])
    for i, it in enumerate(items):
        it[2].index = i
    buckets = [it[2] for it in items]
    return buckets, [it[1] for it in items], [it[3] for it in items], [it[4] for it in items]


def shard_optimizers(optimizers, buckets, bucket_opt: list[int], sources, cfg, compute_dtype) -> list[ShardedOptimizer]:
    """One :class:`ShardedOptimizer` per optimizer over its own buckets (``bucket_opt``: owner per bucket)."""
    out = []
    for k, opt in enumerate(optimizers):
        mine = [i for i, o in enumerate(bucket_opt) if o == k]
        out.append(ShardedOptimizer(opt, [buckets[i] for i in mine], cfg.stage, cfg.offload_optimizer, compute_dtype,
                                    [sources[i] for i in mine] if sources is not None else None,
                                    # qwZ rounds the gathered parameters: an fp32 master may not alias them
                                    separate_masters=cfg.quantize_weights and cfg.stage in (1, 2),
                                    fused_on_cpu=cfg.offload_kernel == "fused"))
    return out


def install_optimizer_methods(engine: "ZeroEngine") -> None:
    """Route each managed optimizer's ``add_param_group`` and ``zero_grad`` through the engine (instance
    attributes): torch's would add module parameters next to masters, or clear only the masters' ``.grad``
    while the reduced gradient shards of that optimizer's buckets live on."""
    for opt in engine.optimizers:
        opt.add_param_group = lambda group, _opt=opt: add_param_group(engine, _opt, group)
        opt.zero_grad = lambda set_to_none=True, _opt=opt: engine.zero_grad(_opt)


def remove_optimizer_methods(engine: "ZeroEngine") -> None:
    for opt in engine.optimizers:
        opt.__dict__.pop("add_param_group", None)
        opt.__dict__.pop("zero_grad", None)


@torch.no_grad()
def add_param_group(engine: "ZeroEngine", optimizer: torch.optim.Optimizer, group: dict) -> None:
    """``optimizer.add_param_group(group)`` where ``group["params"]`` are module parameters."""
    if not isinstance(group, dict):
        raise TypeError(f"add_param_group expects a dict with a 'params' entry; got {type(group).__name__}.")
    params = group.get("params")
    params = [params] if torch.is_tensor(params) else list(params) if params is not None else []
    if isinstance(group.get("params"), set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, not a set.")
    names = param_names(engine.module)
    module_ids = set(names)
    held = {id(p): k for k, s in enumerate(engine.shardeds) for g in s.group_params for p in g}
    k_new = engine.optimizers.index(optimizer)
    for p in params:
        if id(p) not in module_ids:
            raise ValueError(
                "add_param_group: a tensor that is not a parameter of the module was passed; ZeRO shards the "
                "module's parameters only (its master shards are what the optimizer holds)."
            )
        if id(p) in held:
            raise ValueError(
                f"add_param_group: parameter '{names[id(p)]}' is already in optimizer {held[id(p)]}. "
                "Allowed: parameters no optimizer holds yet (each parameter may belong to one optimizer).")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("add_param_group: a parameter appears more than once in the new group.")
    if engine.reducer.in_backward:  # installed on training engines only: there is a reducer
        raise RuntimeError("add_param_group cannot run during backward; call it between optimizer steps.")
    ids = {id(p) for p in params}
    # frozen parameters of the new group are managed too (unlike frozen ones at setup, which may be a
    # LoRA base too large for masters): the group was added to be trained, and unfreezing it later must
    # work; while frozen, their bucket is skipped by the reducer and they get no gradient, so no step
    new_params = [p for p in engine.module.parameters() if id(p) in ids]
    if engine.partitions_params:
        # the parameters already live in their units' shards: per unit, a gradient bucket of the new ones,
        # sourced from the current (compute-dtype) shard, so masters start from the values in use
        new, sources, units = grad_buckets_for_units(engine.partitioner.units, new_params, engine.world_size,
                                                     engine.rank)
    else:
        new = build_buckets(new_params, engine.world_size, engine.rank, engine.config.bucket_bytes,
                            sharded=engine.config.stage >= 1)
        sources, units = None, None
    first = len(engine.buckets)
    for i, b in enumerate(new):
        b.index = first + i
    assert engine.reducer.buckets is engine.buckets  # add_buckets below extends the one shared list
    engine._bucket_opt.extend([k_new] * len(new))
    engine.params.extend(new_params)
    if engine.partitions_params:
        engine._sources.extend(sources)
        engine._bucket_unit.extend(units)
        for b, u in zip(new, units):
            engine.releaser.add_bucket(b, u)
    engine.reducer.add_buckets(new)
    engine.shardeds[k_new].add_group({**group, "params": params}, new, sources)


def select(engine: "ZeroEngine", optimizer: Optional[torch.optim.Optimizer]):
    """The ShardedOptimizers a call concerns: all of them (``None``) or ``optimizer``'s."""
    return list(engine.shardeds) if optimizer is None else [engine.sharded_for(optimizer)]
