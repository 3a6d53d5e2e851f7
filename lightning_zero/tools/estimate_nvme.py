"""The estimator's NVMe lines (``*_offload_nvme`` rows): the host ring of the optimizer's NVMe step, and the
bytes the scratch files move per step, which is what the disks must sustain.

What moves is what the engine issues (counted against it in tests/test_estimate.py): the optimizer's
masters + state are read and written once by the step (engine/placement/nvme_states.py); at stage 3 with the
parameter shards on NVMe (engine/placement/nvme_params.py) each shard is read by its unit's forward gather
and again by its backward gather (a ring slot is free for the next read once its gather completes) -- but
the root's and the last unit's, kept gathered from forward into backward -- and written once by the step's
publish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..engine.memory.floors import state_bytes_per_element
from ..engine.placement.placement import Location
from ..engine.plan import ShardingPlan
from .model_sizes import MiB, ModelInfo, gib

if TYPE_CHECKING:
    from .estimate_states import Row


def _bucket_numel(info: ModelInfo, bucket_mb: float) -> float:
    """Elements of the largest bucket: the cap, or a parameter (stage 3: a unit) larger than it."""
    return min(info.trainable, max(bucket_mb * MiB / 4, info.largest_param, info.largest_unit))


def _state_element_bytes(plan: ShardingPlan, k: int) -> float:
    """Master + optimizer state per element in the files: the master fp32 (4) or bf16 (2: its compensation
    term stays in host memory), the state K or, in bf16, K / 2 (``floors.py``)."""
    return (2 if plan.master_dtype == "bf16" else 4) + state_bytes_per_element(plan, k)


def nvme_optimizer_bytes(info: ModelInfo, plan: ShardingPlan, shards: int, k: int) -> float:
    """The masters + optimizer state one rank keeps in its scratch files (0 where the plan keeps them
    elsewhere)."""
    return plan.placement.book(optimizer_states=_state_element_bytes(plan, k) * info.trainable / shards)[Location.NVME]


def nvme_ring_bytes(info: ModelInfo, plan: ShardingPlan, shards: int, k: int, bucket_mb: float,
                    buffers: int = 3) -> float:
    """Host bytes of the NVMe step's ring (engine/placement/nvme_states.py): ``buffers`` slots of one bucket's shard of
    masters + state (a parameter larger than the cap gets a bucket of its own), never more than the states
    it streams (one slot per bucket when there are fewer buckets than slots; none without states on NVMe)."""
    return min(buffers * _bucket_numel(info, bucket_mb) * _state_element_bytes(plan, k) / shards,
               nvme_optimizer_bytes(info, plan, shards, k))


def nvme_pays_from(info: ModelInfo, bucket_mb: float, buffers: int = 3) -> float:
    """Trainable parameters from which the ring holds at most half the optimizer's states: ``2 x buffers``
    buckets (the ring is ``buffers`` of them; below ``buffers`` buckets it is all of the states)."""
    return 2 * buffers * max(bucket_mb * MiB / 4, info.largest_param, info.largest_unit)


def nvme_ring_line(rows: list[Row], info: ModelInfo, bucket_mb: float) -> str:
    """The optimizer ring's host bytes per rank against the states it streams, and from which size NVMe pays."""
    parts = [f"{r.setting} {r.nvme_ring / MiB:.1f} MiB of {r.nvme_optimizer / MiB:.1f} MiB" for r in rows]
    pays = nvme_pays_from(info, bucket_mb)
    verdict = ("saves at least half of them here" if info.trainable >= pays else
               f"saves {'little' if info.trainable * 2 >= pays else 'nothing'} here")
    return ("NVMe host ring/rank (in host/rank): the optimizer's step streams its masters + state through 3 "
            "buffers of one bucket each: " + "; ".join(parts) + f". NVMe offload {verdict}: it holds at most half "
            f"of them from about {pays / 1e6:.1f}M trainable parameters (6 x max(bucket {bucket_mb:g} MiB / 4 B, "
            f"the largest parameter {info.largest_param / 1e6:.1f}M" + (f", stage 3's largest unit "
                                                                         f"{info.largest_unit / 1e6:.1f}M"
                                                                         if info.largest_unit else "")
            + f")); this model has {info.trainable / 1e6:.1f}M (docs/nvme_offload.md).")


def nvme_step_bytes(info: ModelInfo, states: dict, plan: ShardingPlan, shards: int, mixed: bool) -> float:
    """Bytes one rank's scratch files move per training step: the masters + state read and written once by
    the step; at stage 3 each parameter shard read by its forward gather and again by its backward gather
    (the root unit's and the last unit's once: they stay gathered into backward) and written once by the publish
    (engine/placement/nvme_params.py; counted in tests/test_estimate.py). Units kept through backward
    (persistent, ``reshard_after_forward=False``) are read once: fewer bytes than this."""
    params = plan.placement.book(param_shards=states["params"])[Location.NVME]  # parameter shards on disk
    kept = min(params, (2 if mixed else 4) * (info.root_unit + info.last_unit) / shards)
    return 2 * (states["nvme"] - params) + 3 * params - kept


def nvme_bandwidth_line(rows: list[Row], ranks_per_node: int, step_time: float) -> str:
    """What the disk must sustain per node at ``step_time`` seconds a step (:func:`nvme_step_bytes`)."""
    parts = [f"{r.setting} {gib(r.nvme_moved_per_step)} GiB/rank/step = "
             f"{r.nvme_moved_per_step * ranks_per_node / step_time / 1e9:.2f} GB/s per node" for r in rows]
    return (f"NVMe/rank: masters + optimizer state (+ stage 3's parameter shards) in the scratch files; each step "
            f"reads and writes the optimizer's once, reads each parameter shard twice (forward and backward "
            f"gathers; the root unit and the last unit once) and writes it once, so at a {step_time:g} s step the disks need: "
            + "; ".join(parts) + " (sequential read + write; host/rank of those rows includes the optimizer's "
            "ring of 3 buffers).")


def nvme_lines(rows: list[Row], info: ModelInfo, ranks_per_node: int, step_time: float, bucket_mb: float) -> list[str]:
    """The bandwidth and ring lines of the rows with bytes in scratch files (none: no lines)."""
    on_disk = [r for r in rows if r.nvme_per_rank]
    if not on_disk:
        return []
    return [nvme_bandwidth_line(on_disk, ranks_per_node, step_time), nvme_ring_line(on_disk, info, bucket_mb)]
