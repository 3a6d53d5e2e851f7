"""Every process group and device mesh of the parallel layout ([Note: one parallel layout], layout.py), made
once per process in one cache and shared by every engine, strategy and checkpoint writer.

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
engine/layout/elastic.py), and every group here derives its store from it. Hence: each group (and mesh: torch's
``init_device_mesh`` makes a group per dim, ~30 file descriptors per 2-D gloo mesh at 2 ranks) is made on
first use under the current default group and handed to every later caller; nothing here destroys one per
engine. They go away with the default group: ``destroy_process_group()`` destroys every group, and an entry
made under an earlier default group, or whose groups are no longer registered, is made afresh.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch.distributed as dist

from . import tensor_parallel as TP
from ..comm.collectives import name_group, world_size
from .dims import EngineGroups, ParallelDims, PipelineLayout

# (kind, key) -> (the default group it was made under, the value, its groups); the one cache of this process
_MADE: dict[tuple, tuple[Any, Any, tuple]] = {}


def _registered(group: Any) -> bool:
    return group in dist.distributed_c10d._world.pg_names


def _once(kind: str, key: tuple, build: Callable[[], Any], groups_of: Callable[[Any], Iterable[Any]]) -> Any:
    """``build()`` once per (default group, ``kind``, ``key``); ``groups_of(value)``: the groups it holds."""
    default = dist.distributed_c10d._get_default_group()
    hit = _MADE.get((kind, key))
    if hit is not None and hit[0] is default and all(_registered(g) for g in hit[2]):
        return hit[1]
    for k in [k for k, (pg, _, gs) in _MADE.items() if pg is not default or not all(_registered(g) for g in gs)]:
        del _MADE[k]  # made under a destroyed default group: drop the reference, nothing to destroy
    value = build()
    _MADE[(kind, key)] = (default, value, tuple(g for g in groups_of(value) if g is not None))
    return value


def forget_groups() -> None:
    """Drop every cached group and mesh (at exit, after ``destroy_process_group``: elastic.py)."""
    _MADE.clear()


def cached_groups() -> int:
    """How many groups and meshes this process holds (for tests: later engines must not add any)."""
    return len(_MADE)


def reduce_scatter_group(group: Optional[Any] = None) -> Any:
    """The stage-3 reduce-scatter group over the ranks of ``group`` (default: WORLD).

    Only the members of ``group`` call this (a subgroup's peers may never get here)."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    def build() -> Any:
        # every rank calls for the whole world: a counter-named group (names never repeat); a subgroup needs
        # local synchronization (only members call), named by the hash above -- safe because it is made once
        made = dist.new_group(list(ranks), use_local_synchronization=len(ranks) != dist.get_world_size())
        name_group(made, "stage3_reduce")  # how stats and comm_report() name it
        return made

    return _once("stage3_reduce", ranks, build, lambda g: (g,))


def checkpoint_group(group: Optional[Any] = None) -> Any:
    """A gloo group over the ranks of ``group`` (default: the world) for checkpoint writes that run beside
    training, in a background thread ([Note: asynchronous checkpoint saves], checkpoint/async_save.py):
    collectives of two threads on one group would interleave. gloo whatever the training backend, as DCP's own
    async save advises: it moves only small objects (plans, file lists, agreement) between host buffers. The
    members of ``group`` call it (every rank, for the world)."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    def build() -> Any:
        made = dist.new_group(list(ranks), backend="gloo",
                              use_local_synchronization=len(ranks) != dist.get_world_size())
        name_group(made, "checkpoint")
        return made

    return _once("checkpoint", ranks, build, lambda g: (g,))


def device_mesh(device_type: str, shape: tuple, names: Optional[tuple] = None) -> Any:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)`` (collective over the world the first
    time, as init_device_mesh is); a Trainer asks for its mesh in every ``setup_environment``."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(names) if names else None
    return _once("mesh", (device_type, tuple(shape), names),
                 lambda: init_device_mesh(device_type, tuple(shape), mesh_dim_names=names),
                 lambda mesh: [mesh.get_group(d) for d in range(mesh.ndim)])


def group_mesh(device_type: str, group: Any) -> Any:
    """A 1-D mesh over an existing group (a pipeline stage's data-parallel group): no group is made, but a
    mesh per checkpoint would be a new object each time; keyed by the group's identity."""
    from torch.distributed.device_mesh import DeviceMesh

    return _once("group_mesh", (device_type, id(group)), lambda: DeviceMesh.from_group(group, device_type),
                 lambda _: (group,))


def tensor_parallel_mesh(device_type: str, size: int, world: Optional[int] = None) -> Any:
    """The ("data_parallel", "tensor_parallel") mesh of shape (N // T, T) for ``tensor_parallel_size=T``
    (``world``: N, checked before any collective; default: the default group's size)."""
    world = dist.get_world_size() if world is None else world
    ParallelDims(tensor=size).check_world(world, ("tensor",))
    return device_mesh(device_type, (world // size, size), (TP.DP_DIM, TP.TP_DIM))


def _hybrid(size: int, dp_sets: tuple) -> tuple:
    """Every rank creates every group, in one order, as counter-named groups (no local synchronization,
    so no reused names): shard groups (K consecutive data-parallel ranks), replicate groups (the same position
    in every shard group), then the shard groups' own reduce-scatter groups; each kind inside every
    data-parallel rank set of ``dp_sets`` (the world; with tensor parallelism the mesh's T data-parallel
    groups, [Note: one parallel layout]). Collective over the world."""
    me = dist.get_rank()
    mine: list = [None, None, None]
    blocks = [list(dp[s : s + size]) for dp in dp_sets for s in range(0, len(dp), size)]
    across = [list(dp[pos::size]) for dp in dp_sets for pos in range(size)]
    for slot, rank_sets in ((0, blocks), (1, across), (2, blocks if size > 1 else [])):
        for ranks in rank_sets:
            g = dist.new_group(ranks)
            mine[slot] = g if me in ranks else mine[slot]
    for g, name in zip(mine, ("shard", "replicate", "shard")):
        if g is not None:
            name_group(g, name)
    return tuple(mine)


def hybrid_groups(size: Optional[int], group: Optional[Any] = None, tensor: Optional[Any] = None) -> tuple:
    """(shard, replicate, reduce-scatter) groups of hybrid sharding with shard groups of ``size`` consecutive
    data-parallel ranks; ``(group, None, None)`` when one shard group spans the data-parallel ranks.
    ``tensor``: the engine's TP view (``group`` is then its data-parallel group): the groups are cut inside
    each of the mesh's data-parallel groups."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    ParallelDims(shard=size, tensor=tensor.tp_size if tensor is not None else None).check_world(world, ("shard",))
    dp_sets = tensor.dp_rank_sets if tensor is not None else (tuple(range(world)),)
    if size is None or size == len(dp_sets[0]):
        return group, None, None
    if tensor is None and group is not None and dist.get_process_group_ranks(group) != list(range(world)):
        raise ValueError("shard_group_size needs the engine to run on the default (world) process group; "
                         "got a subgroup. Allowed: group=None with shard_group_size, or no shard_group_size.")
    return _once("hybrid", (size, dp_sets), lambda: _hybrid(size, dp_sets), lambda gs: gs)


def pipeline_layout(num_stages: int) -> PipelineLayout:
    """The ``(P, D)`` layout and its groups for P = ``num_stages``: one data-parallel group per stage (its D
    replicas) and one pipeline group per replica (its P stages). Collective over the world the first time."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    check_pipeline_size(num_stages, world)
    if world == 1:
        return PipelineLayout(1, 1, 0, None, None)
    me, dp = dist.get_rank(), world // num_stages

    def build() -> PipelineLayout:
        mine: dict[str, Any] = {}
        for kind, rank_sets in (("dp", [list(range(s * dp, (s + 1) * dp)) for s in range(num_stages)]),
                                ("pp", [list(range(d, world, dp)) for d in range(dp)])):
            for ranks in rank_sets:
                g = dist.new_group(ranks)
                if me in ranks:
                    mine[kind] = g
        name_group(mine["dp"], "data_parallel")
        name_group(mine["pp"], "pipeline_parallel")
        return PipelineLayout(num_stages, dp, me, mine["pp"], mine["dp"])

    return _once("pipeline", (num_stages,), build, lambda lay: (lay.pp_group, lay.dp_group))


def sequence_group(size: int) -> Any:
    """This rank's sequence-parallel group: ``size`` (S) consecutive ranks sharing one batch ([Note: sequence
    parallelism over ZeRO], dims.py). Every rank creates every group, in one order, as counter-named groups (no
    local synchronization, so no reused names); collective over the world the first time. None when S is 1."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    ParallelDims(sequence=size).check_world(world, ("sequence",))
    if size == 1:
        return None
    me = dist.get_rank()

    def build() -> Any:
        mine = None
        for start in range(0, world, size):
            g = dist.new_group(list(range(start, start + size)))
            mine = g if start <= me < start + size else mine
        name_group(mine, "sequence")
        return mine

    return _once("sequence", (size,), build, lambda g: (g,))


def check_pipeline_size(num_stages: Any, world: int) -> int:
    """``num_stages`` (P) must be an int dividing the world size; one clear error naming the allowed ones."""
    ParallelDims(pipeline=num_stages).check_world(world, ("pipeline",))
    return num_stages


def engine_groups(config: Any, plan: Any, trains: bool, group: Optional[Any], mesh: Optional[Any],
                  module: Any) -> EngineGroups:
    """The groups of one engine (layout.py :class:`EngineGroups`) from its config, its sharding plan and what
    it was given: ``group`` (a subgroup to run on; None: the world), ``mesh`` (tensor parallelism's 2-D mesh).
    Hybrid groups apply where the plan shards optimizer state; a training engine that shards parameters gets
    stage 3's own reduce-scatter group."""
    dims = ParallelDims(config.shard_group_size, tensor=_mesh_size(mesh, config),
                        sequence=config.sequence_parallel_size)
    dims.check(config.stage, knobs={"tensor": "device_mesh"} if mesh is not None else None)
    tensor = TP.tensor_parallel_view(mesh, group, module)
    if tensor is not None:  # ZeRO (shards, broadcasts) runs over the data-parallel dim only
        group = tensor.dp_group
    dims.check_world(world_size(group) * (tensor.tp_size if tensor is not None else 1), ("shard", "sequence"))
    shard, replicate, reduce = (hybrid_groups(config.shard_group_size, group, tensor) if plan.shards_optimizer_state
                                else (group, None, None))
    if plan.shards_params and trains and world_size(shard) > 1 and reduce is None:
        reduce = reduce_scatter_group(group)  # apart from the unit gathers: they interleave differently per rank
    return EngineGroups(world=group, shard=shard, replicate=replicate, reduce=reduce or shard, tensor=tensor)


def _mesh_size(mesh: Optional[Any], config: Any) -> Optional[int]:
    if mesh is None:
        return config.tensor_parallel_size
    size = TP.mesh_tp_size(mesh)
    if config.tensor_parallel_size is not None and config.tensor_parallel_size != size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} but the device_mesh's "
                         f"{TP.TP_DIM!r} dim has {size} rank(s). Allowed: the same T in both, or only the mesh.")
    return size
