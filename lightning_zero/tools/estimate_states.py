"""The estimator's rows: each preset's sharding plan, and the model states and transient buffers one rank
holds under it.

Every number here comes from the plan ([Note: sharding plan], ``engine/plan.py``): what is sharded, whether
full gradients are kept, how updated masters are published; where bytes live from its placement
([Note: placement], ``engine/placement/placement.py``). The stage number and the offload knob of a row are labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from ..engine.config import PRESETS
from ..engine.memory.floors import rank_model_states
from ..engine.placement.placement import Location, Placement
from ..engine.plan import Publish, ShardingPlan
from .model_sizes import MiB, ModelInfo

# (stage, offload) -> conf/strategy preset; offload = optimizer offload (+ param shards at stage 3), a label
SETTINGS: dict[tuple[int, Union[bool, str]], str] = {(kw["stage"], kw.get("offload_optimizer", False)): name
                                                     for name, kw in PRESETS.items()}
# preset -> its plan, placement included: the one table the estimator's rows are built from
SETTING_PLANS: dict[str, ShardingPlan] = {
    name: ShardingPlan.for_stage(kw["stage"], placement=Placement.from_knobs(
        kw.get("offload_optimizer", False), kw.get("offload_params", False)))
    for name, kw in PRESETS.items()}


def setting_plan(stage: int, offload: Union[bool, str]) -> ShardingPlan:
    """The plan of the preset labelled (stage, optimizer offload)."""
    try:
        return SETTING_PLANS[SETTINGS[(stage, offload)]]
    except KeyError:
        raise ValueError(f"No preset has stage {stage!r} with offload_optimizer={offload!r}. Allowed: "
                         + ", ".join(f"{s} with {o!r} ({n})" for (s, o), n in SETTINGS.items()) + ".") from None


def holds_full_grads(plan: ShardingPlan, accumulating: bool) -> bool:
    """Full-size gradients after a backward: unless the plan shards them every micro-batch; a sharded
    optimizer without sharded gradients reduces each bucket during backward, unless accumulating."""
    return not plan.shards_grads and (accumulating or not plan.shards_optimizer_state)


def plan_state_bytes(info: ModelInfo, plan: ShardingPlan, world_size: int, mixed: bool, state_bytes: int = 8,
                     accumulating: bool = True) -> dict[str, float]:
    """Bytes of params, grads, master and optimizer state one rank holds under ``plan``, and how many are on
    the host and in NVMe scratch files.

    Same kinds as :class:`~lightning_zero.engine.memory.report.MemoryReport` (``grads`` here includes the
    reduced shards), measured after a backward. ``accumulating``: gradient accumulation (``no_sync``), where
    stage 1 keeps full gradients (the stage-1 floor); without it stage 1 reduces each bucket during backward
    and holds gradient shards, like stage 2. The engine's own model
    (:func:`~lightning_zero.engine.memory.floors.rank_model_states`, which the floors use too) with the shards as the
    engine pads them.
    """
    return rank_model_states(plan, world_size, mixed, info.numel, info.trainable, state_bytes,
                             full_grads=holds_full_grads(plan, accumulating),
                             param_shard=info.padded(world_size, False), grad_shard=info.padded(world_size, True))


def model_state_bytes(info: ModelInfo, stage: int, offload: Union[bool, str], world_size: int, mixed: bool,
                      state_bytes: int = 8, accumulating: bool = True) -> dict[str, float]:
    """:func:`plan_state_bytes` of the preset labelled (``stage``, ``offload``): the optimizer (master +
    state) on the host (``True``) or in NVMe files (``"nvme"``); at stage 3 the parameter shards too."""
    return plan_state_bytes(info, setting_plan(stage, offload), world_size, mixed, state_bytes, accumulating)


def buffer_bytes(info: ModelInfo, plan: ShardingPlan, world_size: int, mixed: bool, bucket_mb: float = 25.0,
                 accumulating: bool = False, overlap_publish: bool = False) -> dict[str, float]:
    """Transient device buffers on top of the model states: during backward and at the optimizer step."""
    p = 2 if mixed else 4
    if not plan.shards_params:
        # the cap is checked against the fp32 parameters at wrap time; one parameter never splits
        cap = max(bucket_mb * MiB / 4, info.largest_param)
        bucket = p * min(info.trainable, cap)
        # reduced during backward: the full gradients of the bucket being filled beside the two in flight
        backward = 2 * bucket + (0 if holds_full_grads(plan, accumulating) else bucket)
        step = 0.0
        if plan.publish is Publish.ALL_GATHER:
            # the step all-gathers at most two buckets at a time: send + gathered buffers of each; overlapped
            # with the next forward (engine/optim/publish.py) every bucket is in flight until its forward: the bound
            whole = p * (info.padded(world_size, True) * world_size + info.padded(world_size, True))
            step = whole if overlap_publish else min(2 * (bucket + bucket / world_size), whole)
        return {"backward": backward, "step": float(step)}
    unit = info.largest_unit or min(info.trainable, 8 * MiB / 4)  # unknown units: the default unit_mb
    root = info.root_unit
    backward = p * (root + 4 * unit)  # root + current + prefetched unit, its grads and reduce buffer
    backward = max(backward, p * 3 * root)  # end of backward: the root's grads and reduce buffer
    return {"backward": float(backward), "step": 0.0}


def step_slice_numel(info: ModelInfo, plan: ShardingPlan, world_size: int, bucket_mb: float = 25.0) -> float:
    """Elements of the largest bucket slice one rank steps at a time: the bucket cap (checked against the fp32
    parameters; one parameter never splits) or, at stage 3, the largest unit's row (the root's too), cut over
    the ranks where the plan shards the optimizer state. Under bf16 states or masters the step widens this
    slice to fp32 (``floors.low_precision_step_bytes``)."""
    if plan.shards_params:
        bucket = max(info.largest_unit or min(info.trainable, 8 * MiB / 4), info.root_unit)
    else:
        bucket = min(info.trainable, max(bucket_mb * MiB / 4, info.largest_param))
    return math.ceil(bucket / world_size) if plan.shards_optimizer_state else float(bucket)


def host_step_grads(plan: ShardingPlan, trainable: float, shards: int) -> float:
    """Host bytes of the fp32 gradient copies a host-side optimizer step reads (the reduced shards where the
    placement keeps them)."""
    return plan.placement.book(grad_shards=4 * trainable / shards)[Location.HOST]


@dataclass
class Row:
    setting: str
    stage: int  # labels: the preset's stage and optimizer offload
    offload: Union[bool, str]
    states: dict
    buffers: dict
    activations: Optional[float]
    peak_device: float
    host_per_rank: float
    cpu_ram_per_node: float
    fits: Optional[bool] = None
    nvme_per_rank: float = 0.0  # *_offload_nvme: masters + state (+ stage 3's parameter shards) in the scratch files
    nvme_moved_per_step: float = 0.0  # bytes those files move per step (nvme_step_bytes)
    nvme_ring: float = 0.0  # host bytes of the optimizer's NVMe ring (nvme_ring_bytes), part of host_per_rank
    nvme_optimizer: float = 0.0  # the masters + optimizer state that ring streams
    states_world: Optional[dict] = None  # hybrid sharding: the same setting's model states at K = world size
    plan: ShardingPlan = ShardingPlan.for_stage(0)  # what the numbers come from
