"""Process groups the engine needs besides the user's: made once per process, shared by every engine.

[Note: why a group is never re-created]
Lightning builds a new engine for each entry point (fit, validate, test, ...) in the same process, and
a torchrun/SLURM job runs them all in one process. Stage 3 issues its reduce-scatters on a group of its
own. Creating it with ``new_group(ranks, use_local_synchronization=True)`` (needed when only the
members of a subgroup call it) names it by a hash, ``_hash_ranks_to_str``: ``sha1("0_1_..._" +
str(len(_world.pg_names)))``. Destroying that group removes it from ``_world.pg_names``, so the next
engine's group gets the *same* name, hence the same ``PrefixStore(f"{name}/", default_store)``. The
store still holds the destroyed group's rendezvous keys (gloo's full-mesh addresses, NCCL's unique id):
a rank that arrives first reads its peers' *old* entries and connects to listeners that are gone, so
it hangs or fails in ``connectFullMesh`` while its peers, which found the fresh keys, wait for it
elsewhere (2/10 runs at 2 ranks, every run at 4). The same holds across torchrun restart attempts, which
share one store: there the default group's own store is per attempt ([Note: torchrun restarts],
engine/elastic.py), and every group here derives its store from it. Hence: one group per (default group, set of ranks),
made on first use and handed to every later engine; nothing here destroys it per engine. It goes away
with the default group: ``destroy_process_group()`` destroys every group, and a cached group that is no
longer registered (or belongs to an earlier default group) is made afresh under the new one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from .collectives import name_group

_GROUPS: dict[tuple, tuple[Any, Any]] = {}  # (id(default pg), ranks) -> (default pg, group)
_HYBRID: dict[tuple, tuple[Any, tuple]] = {}  # (id(default pg), shard group size) -> (default pg, groups)
_MESHES: dict[tuple, tuple[Any, Any]] = {}  # (id(default pg), device type, shape, names) -> (default pg, mesh)


def _registered(group: Any) -> bool:
    return group in dist.distributed_c10d._world.pg_names


def reduce_scatter_group(group: Optional[Any] = None) -> Any:
    """The stage-3 reduce-scatter group over the ranks of ``group`` (default: WORLD), made once.

    Only the members of ``group`` call this (a subgroup's peers may never get here).
    """
    default = dist.distributed_c10d._get_default_group()
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (id(default), ranks)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is default and _registered(hit[1]):
        return hit[1]
    for k in [k for k, (pg, g) in _GROUPS.items() if pg is not default or not _registered(g)]:
        del _GROUPS[k]  # left over from a destroyed default group: drop the reference, nothing to destroy
    whole = len(ranks) == dist.get_world_size()
    # every rank calls for the whole world: a counter-named group (names never repeat); a subgroup needs
    # local synchronization (only members call), named by the hash above -- safe because it is made once
    made = dist.new_group(list(ranks), use_local_synchronization=not whole)
    name_group(made, "stage3_reduce")  # how stats and comm_report() name it
    _GROUPS[key] = (default, made)
    return made


def cached_groups() -> int:
    """How many groups and meshes this process holds (for tests: later engines must not add any)."""
    return len(_GROUPS) + len(_HYBRID) + len(_MESHES)


def device_mesh(device_type: str, shape: tuple, names: Optional[tuple] = None) -> Any:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)`` made once per (default group, layout):
    each call of torch's makes a new group per mesh dimension (sockets and threads that live as long as the
    default group; ~30 file descriptors per 2-D gloo mesh at 2 ranks), and a Trainer builds its mesh in
    every ``setup_environment``. Collective over the world the first time, as init_device_mesh is."""
    from torch.distributed.device_mesh import init_device_mesh

    default = dist.distributed_c10d._get_default_group()
    key = (id(default), device_type, tuple(shape), tuple(names) if names else None)
    hit = _MESHES.get(key)
    if hit is not None and hit[0] is default and all(_registered(hit[1].get_group(d)) for d in range(hit[1].ndim)):
        return hit[1]
    for k in [k for k, (pg, _) in _MESHES.items() if pg is not default]:
        del _MESHES[k]  # an earlier default group's: destroyed with it
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names) if names else None)
    _MESHES[key] = (default, mesh)
    return mesh


class HybridGroups:
    """Hybrid sharding's groups: ``shard`` (K consecutive ranks: shards, gathers, norms), ``replicate``
    (the ranks at the same position in every shard group: one all-reduce of each gradient shard) and
    ``reduce_scatter`` (stage 3: the shard group's reduce-scatters, apart from its gathers).
    Without hybrid sharding ``shard`` is the engine's group and ``replicate`` is None."""

    def __init__(self, shard: Any, replicate: Any = None, reduce_scatter: Any = None) -> None:
        self.shard, self.replicate, self.reduce_scatter = shard, replicate, reduce_scatter


def check_shard_group_size(size: Optional[int], world: int) -> int:
    """The shard group size for a world of ``world`` ranks (``None`` = the world); one clear error."""
    if size is None:
        return world
    if not 1 <= size <= world or world % size:
        allowed = ", ".join(str(k) for k in range(1, world + 1) if world % k == 0)
        raise ValueError(f"shard_group_size={size} does not divide the world of {world} rank(s) into equal shard "
                         f"groups. Allowed: {allowed} or None (the whole world).")
    return size


def hybrid_groups(size: Optional[int], group: Optional[Any] = None) -> HybridGroups:
    """The groups of hybrid sharding with shard groups of ``size`` consecutive ranks, made once per process
    (see [Note: why a group is never re-created]): every rank creates every group, in one order, as
    counter-named groups (no local synchronization, so no reused names). Collective over the world."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    size = check_shard_group_size(size, world)
    if size == world:
        return HybridGroups(group)
    if group is not None and dist.get_process_group_ranks(group) != list(range(world)):
        raise ValueError("shard_group_size needs the engine to run on the default (world) process group; "
                         "got a subgroup. Allowed: group=None with shard_group_size, or no shard_group_size.")
    default = dist.distributed_c10d._get_default_group()
    key = (id(default), size)
    hit = _HYBRID.get(key)
    if hit is not None and hit[0] is default and all(_registered(g) for g in hit[1] if g is not None):
        return HybridGroups(*hit[1])
    me = dist.get_rank()
    mine: list = [None, None, None]
    blocks = [list(range(s, s + size)) for s in range(0, world, size)]
    for ranks in blocks:
        g = dist.new_group(ranks)
        mine[0] = g if me in ranks else mine[0]
    for pos in range(size):
        ranks = list(range(pos, world, size))
        g = dist.new_group(ranks)
        mine[1] = g if me in ranks else mine[1]
    if size > 1:
        for ranks in blocks:
            g = dist.new_group(ranks)
            mine[2] = g if me in ranks else mine[2]
    for g, name in zip(mine, ("shard", "replicate", "shard")):
        if g is not None:
            name_group(g, name)
    for k in [k for k, (pg, _) in _HYBRID.items() if pg is not default]:
        del _HYBRID[k]  # an earlier default group's: destroyed with it
    _HYBRID[key] = (default, tuple(mine))
    return HybridGroups(*mine)
