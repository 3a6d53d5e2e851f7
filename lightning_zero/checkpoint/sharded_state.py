"""The state dicts a checkpoint is made of, built from the engine's shards without gathering anything.

Masters and per-element optimizer state are flat: a DTensor ``Shard(0)`` over a 1-D mesh of the default
group on stages 1-3 (exactly the engine's ``ShardSpec`` slice; hybrid sharding: ``(Replicate(), Shard(0))``
over a 2-D mesh of the replicate x shard groups), a plain 1-D tensor on stage 0. Tied
parameters are stored once, under their canonical (first) name, with the other names as aliases.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..engine.comm import collectives as C
from ..engine.layout.groups import device_mesh, group_mesh
from ..engine.optim.onebit import local_models as LM
from . import tp_state as TS
from ..engine.optim.kinds import per_rank_state

def _mesh(device_type: str, shard_size: int, group=None):
    """The default group's mesh: 1-D, or (hybrid sharding) 2-D ("replicate", "shard") with shard groups of
    ``shard_size`` consecutive ranks -- the engine's groups, so DCP writes each slice from one replica only.
    ``group``: a sub-group the engine shards over (a pipeline stage's data-parallel group), 1-D over it.
    Made once per process (engine/layout/groups.py): each new mesh would make new groups."""
    if group is not None:
        return group_mesh(device_type, group)
    world = dist.get_world_size()
    if shard_size == world:
        return device_mesh(device_type, (world,))
    return device_mesh(device_type, (world // shard_size, shard_size), ("replicate", "shard"))


def _flat(t: torch.Tensor, spec, group=None) -> torch.Tensor:
    """The 1-D global view of a master-shaped tensor: a DTensor Shard(0) slice (hybrid: replicated over the
    shard groups; ``group``: over that sub-group), or a plain 1-D tensor."""
    t = t.detach()
    if spec.world_size == 1:  # stage 0, or shard groups of one rank: every rank holds the whole tensor
        return t.view(-1) if t.is_contiguous() else t.reshape(-1)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    world = dist.get_world_size(group)
    placements = [Shard(0)] if spec.world_size == world else [Replicate(), Shard(0)]
    return DTensor.from_local(t.view(-1), _mesh(t.device.type, spec.world_size, group), placements, run_check=False,
                              shape=torch.Size([spec.numel]), stride=(1,))


def per_rank(t: torch.Tensor, group=None) -> torch.Tensor:
    """A tensor that differs on every rank (1-bit Adam's error buffers, engine/optim/onebit/base.py): one row per
    rank of ``group``, a DTensor Shard(0) of the ``[N * numel]`` global tensor, so each rank writes and reads
    back its own row (a plain tensor would be saved as replicated: rank 0's only)."""
    flat = t.detach().reshape(-1)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return flat
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(flat, _mesh(flat.device.type, world, group), [Shard(0)], run_check=False,
                              shape=torch.Size([world * flat.numel()]), stride=(1,))


def _aliases(module: nn.Module, preferred: Mapping[int, str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensor entries of the state dict under their canonical names, and {alias: canonical} for tied ones."""
    canonical: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    entries = [(k, v) for k, v in module.state_dict(keep_vars=True).items() if torch.is_tensor(v)]
    for name, t in entries:  # a managed parameter keeps the engine's name even if it is listed later
        if id(t) in preferred and preferred[id(t)] == name:
            seen[id(t)] = name
    for name, t in entries:
        first = seen.setdefault(id(t), name)
        if first == name:
            canonical[name] = t.detach()
        else:
            aliases[name] = first
    return canonical, aliases


def _canonical(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """:func:`_aliases` with every parameter under its ``named_parameters`` name (the engine's names)."""
    return _aliases(module, {id(p): n for n, p in module.named_parameters()})


def _managed(engine) -> dict[str, tuple[torch.Tensor, Any, torch.Size]]:
    """Tensors saved and loaded as flat shards: fp32 masters, and (stage 3) the unit-shard slices of
    parameters without a master, which are never whole in the module."""
    if engine is None:
        return {}
    items = list(engine.master_items()) + list(engine.unmanaged_shard_items())
    return {n: (m, spec, shape) for n, m, spec, shape in items}


# -- state dicts handed to Lightning (and to dcp.save) ---------------------------------------------------
def sharded_model_state(module: nn.Module, engine=None, group=None) -> dict[str, torch.Tensor]:
    """Model tensors for DCP: fp32 masters (flattened, DTensor-sharded on stages >= 1) + buffers/frozen.
    ``group``: the sub-group the engine shards over, when not the default group (pipeline stages)."""
    if engine is not None:  # NVMe: a damaged read stops every rank here, not one rank inside the save
        engine.make_states_resident()
    managed = _managed(engine)
    canonical, _ = _canonical(module)
    entry = _entry_fn(engine, module, group)
    mean = LM.mean_masters(engine)  # 0/1 Adam between synchronizations: the model is the ranks' mean
    return {n: (entry(mean.get(id(managed[n][0]), managed[n][0]), n, managed[n][1]) if n in managed else t)
            for n, t in canonical.items()}


def _entry_fn(engine, module: nn.Module, group=None):
    """How a master-shaped tensor is written: flat (:func:`_flat`), or per parameter in full parameter
    coordinates with tensor parallelism (tp_state.py)."""
    if TS.is_tp(engine):
        return TS.natural_entry_fn(engine, module)
    return lambda t, _name, spec: _flat(t, spec, group)


def sharded_optimizer_state(engine, optimizer=None, group=None) -> dict[str, Any]:
    """Optimizer state keyed by parameter name: per-element tensors flattened like the masters.
    ``optimizer``: which of the engine's optimizers (default: the first); ``group``: as for the model."""
    engine.make_states_resident()  # as sharded_model_state: every save takes this first or second
    name_of = {id(m): (n, spec) for n, (m, spec, _) in _managed(engine).items()}
    opt = engine.optimizer if optimizer is None else optimizer
    entry = _entry_fn(engine, engine.module, group)
    state: dict[str, dict] = {}
    other: dict[str, dict] = {}
    rank_keys = per_rank_state(opt)
    # 0/1 Adam's local steps: one value per tensor is the ranks' mean ([Note: the ranks' own models]); each
    # rank's own values ride beside it (rank_local.py)
    mean = LM.mean_state(engine.sharded_for(opt)) if LM.rank_local_keys(opt) else {}
    pg, sharded = group, engine.sharded_for(opt)
    owned = sharded.owner is not None  # whole state on each parameter's owner ([Note: owner-rank step])
    for group in opt.param_groups:
        for m in group["params"]:
            name, spec = name_of[id(m)]
            holder = sharded.state_holder(m)
            for k, v in (opt.state.get(holder, {}) if holder is not None else {}).items():
                if k in rank_keys:
                    state.setdefault(name, {})[k] = per_rank(v, pg)
                elif owned and torch.is_tensor(v) and v.dim() > 0 and v.shape == holder.shape:
                    state.setdefault(name, {})[k] = v.detach().reshape(-1)  # written by its owner, flat as stage 0
                elif torch.is_tensor(v) and v.dim() > 0 and v.shape == m.shape:
                    state.setdefault(name, {})[k] = entry(mean.get((id(m), k), v), name, spec)
                elif torch.is_tensor(v):
                    state.setdefault(name, {})[k] = v.detach()
                else:
                    other.setdefault(name, {})[k] = v
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(m)][0] for m in g["params"]]}
              for g in opt.param_groups]
    # the user's own parameter lists, frozen ones as None: what a plain (DDP) optimizer numbers by position
    layout = [[None if m is None else name_of[id(m)][0] for m in g] for g in sharded.group_layout]
    if owned:  # each rank holds its own parameters' entries: every rank's, merged (the first rank writes them)
        other = {n: extra for piece in C.all_gather_object(other, pg) for n, extra in piece.items()}
    return {"state": state, "param_groups": groups, "nontensor_state": other, "layout": layout,
            **({"owned_state": True} if owned else {})}
