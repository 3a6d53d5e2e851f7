"""ShardingPlan: what a ZeRO stage (and its options) means, decided once from the config.

[Note: sharding plan]
The stage number is a user-facing knob; the engine's parts need capabilities. ``ShardingPlan.of(config)``
turns the one into the other in one place (as FSDP2 turns ``reshard_after_forward`` into a post-forward
mesh info once in ``_fsdp_init.py`` and then only reads that), and every part reads the capability it
needs, never ``stage == ...``:

    stage                          0           1           2           3
    shards_optimizer_state         -           x           x           x   masters are this rank's slice;
                                                                           gradients reduce-scattered into
                                                                           shards; hybrid groups apply
    shards_grads                   -           -           x           x   reduced every micro-batch, also
                                                                           under ``no_sync``
    shards_params                  -           -           -           x   a partitioner (units) and a
                                                                           backward releaser exist
    publish                        COPY        ALL_GATHER  ALL_GATHER  UNIT_SHARDS

``publish`` is how updated masters reach the module after a step: copied where a master does not alias
its whole parameter (COPY), one all-gather per bucket (ALL_GATHER; blocking or overlapped with the next
forward, ``overlap_publish``), or written into the stage-3 unit shards that units are gathered from when
next used (UNIT_SHARDS). ``separate_masters``: under a quantized all-gather publish (qwZ) the gathered
parameters are rounded, so an fp32 master may not alias them. ``optimizer_state_dtype`` / ``master_dtype``
("fp32" | "bf16", ``ZeroConfig``'s knobs as it normalizes them): what the optimizer's per-element state and
the master are kept in between steps; the memory model (``memory/floors.py``) reads them from here.

Whether parameters are partitioned *now* is engine state, not plan: a stage-3 engine hands its module back
whole at the end (``ZeroEngine.partitions_params`` turns False then); the plan says they were to be.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .placement.placement import Placement


class Publish(enum.Enum):
    COPY = "copy"
    ALL_GATHER = "all_gather"
    UNIT_SHARDS = "unit_shards"


@dataclass(frozen=True)
class ShardingPlan:
    stage: int  # kept for messages and checkpoint metadata only; the parts read the fields below
    shards_optimizer_state: bool
    shards_grads: bool
    shards_params: bool
    publish: Publish
    overlap_publish: bool = False
    separate_masters: bool = False
    # where each kind of state lives ([Note: placement], placement.py): every part asks this, not the knobs
    placement: Placement = field(default_factory=Placement)
    optimizer_state_dtype: str = "fp32"  # "fp32" | "bf16": Adam's moments, SGD's momentum between steps
    master_dtype: str = "fp32"  # "fp32" | "bf16": a bf16 master carries a bf16 compensation term beside it

    @classmethod
    def of(cls, config: Any) -> "ShardingPlan":
        """The plan of a validated :class:`~.config.ZeroConfig` (its combinations are checked there)."""
        return cls.for_stage(config.stage, overlap_publish=config.overlap_publish,
                             quantize_weights=config.quantize_weights,
                             placement=Placement.of(config, shards_params=config.stage == 3),
                             optimizer_state_dtype=config.optimizer_state_dtype, master_dtype=config.master_dtype)

    @classmethod
    def for_stage(cls, stage: int, overlap_publish: bool = False, quantize_weights: bool = False,
                  placement: Placement = Placement(), optimizer_state_dtype: str = "fp32",
                  master_dtype: str = "fp32") -> "ShardingPlan":
        """The stage's row of the table in [Note: sharding plan] (also for the estimator's what-if rows)."""
        publish = Publish.COPY if stage == 0 else Publish.UNIT_SHARDS if stage == 3 else Publish.ALL_GATHER
        gathers = publish is Publish.ALL_GATHER
        return cls(stage=stage, shards_optimizer_state=stage >= 1, shards_grads=stage >= 2,
                   shards_params=stage == 3, publish=publish, overlap_publish=overlap_publish and gathers,
                   separate_masters=quantize_weights and gathers, placement=placement,
                   optimizer_state_dtype=optimizer_state_dtype, master_dtype=master_dtype)
