"""The estimator's NVMe lines (``*_offload_nvme`` rows): the host ring of the optimizer's NVMe step, and the
bytes the scratch files move per step, which is what the disks must sustain.

What moves is what the engine issues (counted against it in tests/test_estimate.py): the optimizer's
masters + state are read and written once by the step (engine/nvme_states.py); at stage 3 with the
parameter shards on NVMe (engine/stage3/nvme_params.py) each shard is read by its unit's forward gather
and again by its backward gather (a ring slot is free for the next read once its gather completes) -- but
the root's and the last unit's, kept gathered from forward into backward -- and written once by the step's
publish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .estimate import ModelInfo, Row

MiB = 2**20


def nvme_ring_bytes(info: ModelInfo, offload, shards: int, k: int, bucket_mb: float, buffers: int = 3) -> float:
    """Host bytes of the NVMe step's ring (engine/nvme_states.py): ``buffers`` slots, each one bucket's shard
    of masters + state (a parameter larger than the cap gets a bucket of its own)."""
    if offload != "nvme":
        return 0.0
    bucket = min(info.trainable, max(bucket_mb * MiB / 4, info.largest_param, info.largest_unit))
    return buffers * (4 + k) * bucket / shards


def nvme_step_bytes(info: ModelInfo, states: dict, stage: int, offload, shards: int, mixed: bool) -> float:
    """Bytes one rank's scratch files move per training step: the masters + state read and written once by
    the step; at stage 3 each parameter shard read by its forward gather and again by its backward gather
    (the root unit's and the last unit's once: they stay gathered into backward) and written once by the publish
    (engine/stage3/nvme_params.py; counted in tests/test_estimate.py). Units kept through backward
    (persistent, ``reshard_after_forward=False``) are read once: fewer bytes than this."""
    if offload != "nvme":
        return 0.0
    params = states["params"] if stage == 3 else 0.0
    kept = min(params, (2 if mixed else 4) * (info.root_unit + info.last_unit) / shards)
    return 2 * (states["nvme"] - params) + 3 * params - kept


def nvme_bandwidth_line(rows: list[Row], ranks_per_node: int, step_time: float) -> str:
    """What the disk must sustain per node at ``step_time`` seconds a step (:func:`nvme_step_bytes`)."""
    from .estimate import _gib

    parts = [f"{r.setting} {_gib(r.nvme_moved_per_step)} GiB/rank/step = "
             f"{r.nvme_moved_per_step * ranks_per_node / step_time / 1e9:.2f} GB/s per node" for r in rows]
    return (f"NVMe/rank: masters + optimizer state (+ stage 3's parameter shards) in the scratch files; each step "
            f"reads and writes the optimizer's once, reads each parameter shard twice (forward and backward "
            f"gathers; the root unit and the last unit once) and writes it once, so at a {step_time:g} s step the disks need: "
            + "; ".join(parts) + " (sequential read + write; host/rank of those rows includes the optimizer's "
            "ring of 3 buffers).")
