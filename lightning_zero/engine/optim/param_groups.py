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

import contextlib

import logging

import torch
from torch import nn

from ..comm import collectives as C
from ..placement.host_kernels import kernel_swap_line
from ..placement.stores import make_state_store
from .low_precision import LowPrecisionStates
from .optimizer import ShardedOptimizer

_log = logging.getLogger("lightning_zero.engine")


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


def shard_optimizers(optimizers, table, plan, cfg, compute_dtype, tp=None, param_store=None,
                     group=None, kinds=None) -> list[ShardedOptimizer]:
    """One :class:`ShardedOptimizer` per optimizer over its own rows of the bucket ``table``; ``tp``: the
    tensor-parallel mesh, whose group the gradient norm also sums over; ``param_store`` (stage 3): the unit
    shards' store, whose ``readable(unit)`` is a context in which the unit's shard can be read and whose
    ``masters_may_alias`` says whether an fp32 shard may be its own master. Each optimizer gets a state store
    of its own where the plan's placement puts masters + optimizer state (``group``: the ranks that agree on
    the stores' space at setup); ``kinds``: each optimizer's kind, as the builder asked it ([Note: optimizer
    kinds])."""
    out = []
    for k, opt in enumerate(optimizers):
        rows = table.of_optimizer(k)
        scope = _bucket_scope(table, param_store.readable) if param_store is not None else None
        out.append(ShardedOptimizer(opt, [r.bucket for r in rows], plan,
                                    make_state_store(plan.placement.optimizer_states, cfg, group), compute_dtype,
                                    [r.sources for r in rows] if plan.shards_params else None,
                                    fused_on_cpu=cfg.offload_kernel == "fused",
                                    tp_group=tp.tp_group if tp is not None else None,
                                    tp_size=tp.tp_size if tp is not None else 1,
                                    alias_sources=param_store is None or param_store.masters_may_alias,
                                    source_scope=scope, kind=kinds[k] if kinds is not None else None,
                                    low_precision=LowPrecisionStates(cfg.optimizer_state_dtype, cfg.master_dtype)))
    swap = kernel_swap_line(out)
    if swap is not None and C.rank() == 0:
        _log.info(swap)
    return out


def _bucket_scope(table, unit_scope):
    """``unit_scope`` by bucket: the unit of the bucket's row in ``table``, looked up when asked, so buckets
    that ``add_param_group`` adds later (after the table took their rows) find theirs too."""
    def scope(bucket):
        unit = next((r.unit for r in table.rows if r.bucket is bucket and r.unit is not None), None)
        return unit_scope(unit) if unit is not None else contextlib.nullcontext()

    return scope


def new_group_params(module: nn.Module, shardeds: list[ShardedOptimizer], group) -> tuple[list, list]:
    """``optimizer.add_param_group(group)`` checked: ``group["params"]`` must be module parameters no
    optimizer holds yet. Returns (the group's parameters as given, the same in module order)."""
    if not isinstance(group, dict):
        raise TypeError(f"add_param_group expects a dict with a 'params' entry; got {type(group).__name__}.")
    params = group.get("params")
    params = [params] if torch.is_tensor(params) else list(params) if params is not None else []
    if isinstance(group.get("params"), set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, not a set.")
    names = param_names(module)
    held = {id(p): k for k, s in enumerate(shardeds) for g in s.group_params for p in g}
    for p in params:
        if id(p) not in names:
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
    ids = {id(p) for p in params}
    # frozen parameters of the new group are managed too (unlike frozen ones at setup, which may be a
    # LoRA base too large for masters): the group was added to be trained, and unfreezing it later must
    # work; while frozen, their bucket is skipped by the reducer and they get no gradient, so no step.
    # At stage 3 they already live in their units' shards: the new per-unit buckets are sourced from the
    # current (compute-dtype) shard, so masters start from the values in use (BucketMaker.rows).
    return params, [p for p in module.parameters() if id(p) in ids]


class OptimizerSet:
    """The engine's optimizers, each with its :class:`ShardedOptimizer` over its own rows of one bucket
    table (``maker``: how new parameters become rows), and the managed parameters in master order."""

    def __init__(self, optimizers, per_opt: list[list[nn.Parameter]], table, maker, shardeds) -> None:
        self.optimizers, self.table, self._maker, self.shardeds = optimizers, table, maker, shardeds
        self.params = [p for ps in per_opt for p in ps]

    def select(self, optimizer=None) -> list[ShardedOptimizer]:
        """The ShardedOptimizers a call concerns: all of them (``None``) or ``optimizer``'s."""
        return list(self.shardeds) if optimizer is None else [self.sharded_for(optimizer)]

    def sharded_for(self, optimizer) -> ShardedOptimizer:
        for s in self.shardeds:
            if s.optimizer is optimizer:
                return s
        raise ValueError(f"{type(optimizer).__name__} is not one of the optimizers this engine shards.")

    @torch.no_grad()
    def add_param_group(self, optimizer, group, module: nn.Module, reducer, partitioned) -> None:
        """``optimizer.add_param_group(group)`` after setup: the new rows reach the table, the reducer, the
        stage-3 releaser (``partitioned``, else None) and that optimizer's shards (see the module docstring)."""
        params, new_params = new_group_params(module, self.shardeds, group)
        if reducer.in_backward:
            raise RuntimeError("add_param_group cannot run during backward; call it between optimizer steps.")
        k = self.optimizers.index(optimizer)
        rows = self._maker.rows(new_params, k)
        new = self.table.add(rows)
        self.params.extend(new_params)
        if partitioned is not None:
            partitioned.add_rows(rows)
        reducer.add_rows(rows)
        self.shardeds[k].add_group({**group, "params": params}, new,
                                   [r.sources for r in rows] if self._maker.units is not None else None)
