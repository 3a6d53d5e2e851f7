"""DeepSpeed's batch rule as a translation applies it (``deepspeed_config.py``):
``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size``.

[Note: DeepSpeed's batch rule]
DeepSpeed (``DeepSpeedConfig._set_batch_related_parameters``, then ``_batch_assertion``) derives what a config
leaves out: the accumulation from the total and the micro-batch (total // micro // world), the micro-batch
from the total and the accumulation (total // world // accumulation), the total from the other two, and from
the total alone accumulation 1 and micro-batch total // world; then it asserts the product. Every derivation
that divides the total needs the world size, which a translation knows only from ``world_size``
(``--world-size``): without it such a config is refused, naming the world sizes that keep the total, never
translated as if each rank were the whole world (the micro-batch alone would make the total micro x ranks).
When the config gives all three, the world size they imply is checked against ``world_size``, or returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .deepspeed_auto import DeepSpeedConfigError


@dataclass(frozen=True)
class BatchSizes:
    micro: Optional[int]  # per rank, the DataLoader's batch_size (None: the setting beside it stays)
    accumulation: Optional[int]  # None: not set (the Trainer's own)
    world_size: Optional[int]  # the world size train_batch_size was divided by (None: no total to keep)
    total: Optional[int]


def _worlds(quotient: int, limit: int = 12) -> str:
    """The world sizes that divide ``quotient`` (the total over the fixed factors), for the error."""
    ws = [w for w in range(1, quotient + 1) if quotient % w == 0]
    return ", ".join(map(str, ws[:limit])) + (f", ... {ws[-1]}" if len(ws) > limit else "")


def deepspeed_batch(total: Optional[int], micro: Optional[int], accumulation: Optional[int],
                    world_size: Optional[int], open_keys: tuple = ()) -> BatchSizes:
    """The micro-batch and accumulation a run on ``world_size`` ranks needs for the config's batch sizes
    ([Note: DeepSpeed's batch rule]). ``open_keys``: the batch keys left "auto" (HF fills them from its
    arguments); with an explicit total they cannot be derived, so that is refused."""
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise DeepSpeedConfigError(f"world size {world_size!r}: allowed a positive integer (--world-size N).")
    if total is None:  # DeepSpeed derives the total from the others: nothing to keep
        return BatchSizes(micro, accumulation, None, None)
    if open_keys:
        raise DeepSpeedConfigError(
            f"train_batch_size={total} with {' and '.join(open_keys)} \"auto\": HF fills those from its arguments, "
            f"so the total cannot be kept here. Allowed: give them as numbers (or as auto={{...}} from Python), or "
            f"train_batch_size \"auto\".")
    if micro is not None and accumulation is not None:
        implied, rem = divmod(total, micro * accumulation)
        if rem or not implied:
            raise DeepSpeedConfigError(
                f"train_batch_size={total} is not train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps"
                f" {accumulation} x a world size. Allowed: train_batch_size a multiple of {micro * accumulation}.")
        if world_size is not None and world_size != implied:
            raise DeepSpeedConfigError(
                f"train_batch_size={total} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                f"{accumulation} x world size {world_size} (DeepSpeed's rule). Allowed: world size {implied}.")
        return BatchSizes(micro, accumulation, implied, total)
    fixed = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation}
    fixed = {k: v for k, v in fixed.items() if v is not None}
    factor = micro or accumulation or 1
    derived = "gradient_accumulation_steps" if micro else "train_micro_batch_size_per_gpu" if accumulation else \
        "train_micro_batch_size_per_gpu (accumulation 1)"
    given = "".join(f" with {k}={v}" for k, v in fixed.items())
    if total % factor:
        raise DeepSpeedConfigError(f"train_batch_size={total} is not a multiple of {next(iter(fixed))}={factor}. "
                                   f"Allowed: train_batch_size a multiple of {factor}.")
    if world_size is None:
        raise DeepSpeedConfigError(
            f"train_batch_size={total}{given} leaves {derived} to the world size (DeepSpeed: train_batch_size = "
            f"micro-batch x accumulation x world size). Allowed: --world-size N (from Python: world_size=N) with N "
            f"one of {_worlds(total // factor)}.")
    rest, rem = divmod(total // factor, world_size)
    if rem or not rest:
        raise DeepSpeedConfigError(
            f"train_batch_size={total}{given} does not split over world size {world_size} (DeepSpeed: "
            f"train_batch_size = micro-batch x accumulation x world size). Allowed: world size one of "
            f"{_worlds(total // factor)}.")
    if micro:
        return BatchSizes(micro, rest, world_size, total)
    return BatchSizes(rest, accumulation or 1, world_size, total)
