"""The parallel layout: one job's parallel dims, checked once, and the groups one engine works over.

[Note: one parallel layout]
A job's world of N ranks is a grid ``(pipeline P) x (data parallel D) x (sequence S) x (tensor T)``, row-major:
the tensor dim varies fastest (a TP group is T consecutive ranks, as torch's ``init_device_mesh`` lays out
``(N // T, T)``), the pipeline dim slowest (rank ``r`` holds pipeline stage ``r // D``). Data parallelism
is itself ``replicate x shard`` under hybrid sharding: ZeRO shards within groups of ``shard`` consecutive
data-parallel ranks and replicates across them. With T > 1 the data-parallel ranks of one tensor position
``t`` are T apart in the world (rank ``d * T + t``), so the hybrid groups are cut inside each of the mesh's
data-parallel groups (shard group: data-parallel ranks ``[s, s + K)``, world ranks ``t + T * [s, s + K)``)
and K must divide ``N / T``, not N; the ranks of one TP group hold different pieces at the same place of
the same shard layout. :class:`ParallelDims` is that grid's sizes as the user
gives them (``shard_group_size``, ``tensor_parallel_size``, ``sequence_parallel_size``: fields of :class:`~.config.ZeroConfig`, so the
Trainer strategy, the Fabric strategy, Hydra and the engine read one config; ``pipeline_parallel_size``:
ZeroPipelineStrategy's and PipelineZero's own, with its schedule knobs), validated here and nowhere else: against
:data:`COMPOSED` / :data:`COMPOSE` (which pairs of dims combine and how, which do not and why) and
:data:`STAGES_WITH` (which ZeRO stages a dim takes), then against the world size once it is known.

[Note: sequence parallelism over ZeRO]
The sequence dim S (``sequence_parallel_size``) cuts the data-parallel ranks into groups of S consecutive ranks
that share one batch and split each of its sequences along the length (Ulysses: lightning_zero/sequence_parallel/,
an all-to-all around every attention). The engine does not know about it: every rank of a group returns the
*whole* sequence's loss L, built from autograd-correct collectives (the partial losses' all-reduce, whose
backward is an all-reduce), so each rank's gradient is S times its part of dL, and ZeRO's average over all
D * S ranks gives (1 / D) * sum over the D batches -- DDP's gradient on whole sequences. Hence parameters,
gradients and optimizer state are sharded over the D * S ranks together at every stage (as ALST does), hybrid
sharding and offload need nothing more, and a checkpoint does not depend on S: it resumes at any other S. The
sampler splits the data by the group's index (``rank // S``), not by rank.

Every process group and device mesh the dims need is made once per process by engine/layout/groups.py (one cache,
[Note: why a group is never re-created]); :class:`EngineGroups` is what one engine receives of them: the
group it broadcasts over, the group it shards over, the stage-3 reduce-scatter group, the replicate group
and the tensor-parallel view (FSDP2's ``FSDPMeshInfo`` / ``HSDPMeshInfo`` value). A new parallel dim is a
field here, a row in each table, its groups in groups.py and what the engine does over them.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

DIMS = ("shard", "tensor", "pipeline", "sequence")
KNOBS = {"shard": "shard_group_size", "tensor": "tensor_parallel_size", "pipeline": "pipeline_parallel_size",
         "sequence": "sequence_parallel_size"}
WHAT = {"shard": "hybrid sharding", "tensor": "tensor parallelism", "pipeline": "pipeline parallelism",
        "sequence": "sequence parallelism"}
_MEANING = {"shard": "ranks per shard group, e.g. the GPUs of a node", "tensor": "ranks per tensor-parallel group",
            "pipeline": "the stages of one pipeline", "sequence": "ranks splitting one sequence"}

_SPLIT = {"shard": " into equal shard groups", "tensor": "", "pipeline": " into pipelines of equal length",
          "sequence": " into equal sequence-parallel groups"}


def _all_of(ranks: int, world: int) -> str:
    return " or None (the whole world)." if ranks == world else f" or None (all {ranks} data-parallel ranks)."


#: pairs of dims that combine, each with how (every pair of DIMS is in exactly one of COMPOSED and COMPOSE)
COMPOSED: dict[tuple[str, str], str] = {
    ("shard", "tensor"): "hybrid sharding's shard and replicate groups are cut inside each data-parallel group of "
                         "the tensor-parallel mesh; K divides the N / T data-parallel ranks",
    ("shard", "sequence"): "ZeRO shards over the data-parallel x sequence-parallel ranks together; the shard "
                           "groups need not line up with the sequence groups (the gradient sum is over all ranks)",
}
#: pairs of dims that do not combine (yet), each with the reason
COMPOSE: dict[tuple[str, str], str] = {
    ("shard", "pipeline"): "each pipeline stage already shards over its own data-parallel group",
    ("tensor", "pipeline"): "a pipeline stage's engine runs on a 1-D data-parallel group",
    ("tensor", "sequence"): "the tensor-parallel ranks already split every attention's heads; Ulysses would split "
                            "those heads again over a second group of the same batch",
    ("pipeline", "sequence"): "a pipeline's stages pass each micro-batch's whole activations between them; a "
                              "sequence-sharded micro-batch would need every stage's groups cut again",
}
#: the ZeRO stages each dim takes, and why not the others
STAGES_WITH: dict[str, tuple[tuple[int, ...], str]] = {
    "tensor": ((0, 1, 2), "stage 3 would gather DTensor pieces inside its units"),
    "pipeline": ((0, 1, 2), "each pipeline stage holds its own parameters whole"),
}


def _is_size(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def divisors(world: int) -> str:
    return ", ".join(str(k) for k in range(1, world + 1) if world % k == 0)


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the dims a job asks for; None: the dim is not used (shard: the whole data-parallel world)."""

    shard: Optional[int] = None
    tensor: Optional[int] = None
    pipeline: Optional[int] = None
    sequence: Optional[int] = None

    @classmethod
    def of(cls, config: Any, pipeline: Optional[int] = None) -> "ParallelDims":
        """A :class:`~.config.ZeroConfig`'s dims, with ``pipeline`` (P: the pipeline's own argument)."""
        return cls(config.shard_group_size, config.tensor_parallel_size, pipeline, config.sequence_parallel_size)

    @property
    def used(self) -> tuple[str, ...]:
        return tuple(d for d in DIMS if getattr(self, d) is not None)

    def check(self, stage: int, knobs: Optional[dict] = None) -> None:
        """Types, the combinations of :data:`COMPOSE` and the stages of :data:`STAGES_WITH`: one clear error.
        ``knobs``: how the caller names a dim (the engine says ``device_mesh`` for a mesh it was given)."""
        knobs = {**KNOBS, **(knobs or {})}
        for dim in self.used:
            value = getattr(self, dim)
            if not _is_size(value):
                raise ValueError(f"{knobs[dim]} must be an int >= 1 that divides the world size ({_MEANING[dim]}) "
                                     f"or None (no {WHAT[dim]}); got {value!r}.")
        for (a, b), why in COMPOSE.items():
            if a in self.used and b in self.used:
                raise ValueError(f"{self._shown(a, knobs)} ({WHAT[a]}) cannot be combined with {self._shown(b, knobs)} "
                                 f"({WHAT[b]}): {why}. Allowed: one of {knobs[a]} and {knobs[b]}, or neither.")
        for dim in self.used:
            if dim in STAGES_WITH and stage not in STAGES_WITH[dim][0]:
                stages, why = STAGES_WITH[dim]
                raise ValueError(f"ZeRO stage {stage} cannot be combined with {WHAT[dim]} ({knobs[dim]}): {why}. "
                                 f"Allowed stages with {WHAT[dim]}: {', '.join(map(str, stages))}.")

    def _shown(self, dim: str, knobs: dict) -> str:
        value = getattr(self, dim)
        return f"{knobs[dim]}={value!r}" if knobs[dim] == KNOBS[dim] else knobs[dim]  # a mesh: by its name

    def check_world(self, world: int, dims: tuple[str, ...] = DIMS) -> None:
        """Each used dim (of ``dims``) divides the world of ``world`` ranks; one error naming the allowed sizes.
        With tensor parallelism the shard dim splits the data-parallel ranks (``world // T``), not the world."""
        for dim in sorted(dims, key=lambda d: d != "tensor"):  # T first: the shard dim's ranks depend on it
            value = getattr(self, dim)
            ranks, where = world, f"the world of {world} rank(s)"
            if dim == "shard" and _is_size(self.tensor) and self.tensor > 1 and world % self.tensor == 0:
                ranks = world // self.tensor
                where = f"the {ranks} data-parallel rank(s) (world {world} / tensor_parallel_size {self.tensor})"
            if value is not None and (not _is_size(value) or value > ranks or ranks % value):
                raise ValueError(f"{KNOBS[dim]}={value!r} does not divide {where}{_SPLIT[dim]}. "
                                 f"Allowed: {divisors(ranks)}" + (_all_of(ranks, world) if dim == "shard" else "."))


class PipelineLayout:
    """This rank's place in the ``(P, D)`` pipeline layout and its two groups (engine/layout/groups.py makes them)."""

    def __init__(self, num_stages: int, dp_size: int, rank: int, pp_group: Any, dp_group: Any) -> None:
        self.num_stages, self.dp_size = num_stages, dp_size
        self.stage_index, self.dp_rank = divmod(rank, dp_size)
        self.pp_group, self.dp_group = pp_group, dp_group

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


@dataclass(frozen=True)
class EngineGroups:
    """The groups one engine works over (FSDP2's mesh info as one typed value).

    ``world``: buffer and module-state broadcasts (the engine's group, or the TP mesh's data-parallel dim);
    ``shard``: shards, gathers, norms; ``replicate``: hybrid sharding's all-reduce of each gradient shard
    (None without); ``reduce``: where gradient buckets are reduced (stage 3 with several ranks: a group of
    its own, apart from the unit gathers; else ``shard``); ``tensor``: the engine's view of a TP mesh."""

    world: Any
    shard: Any
    replicate: Any = None
    reduce: Any = None
    tensor: Any = None
