"""How the engine composes with a compressed optimizer (1-bit Adam, 0/1 Adam): the combinations refused,
the reducer's probe, the process group bound, the phase a step ran in (comm_report).

Design note
-----------
The seam is one question the reducer asks before every reduction, ``optimizer.uses_local_grads()``: while it
is True the backward launches no collective and the step hands the optimizer this rank's own gradients; the
optimizer exchanges its momentum itself. The optimizer steps whole parameters that it updates identically on
every rank (the exchange's result is the same everywhere), which is stage 0's layout. Sharded stages are
refused: their master shards would need every rank's whole local gradient and the whole frozen variance to
apply the 1-bit-averaged momentum, and publishing the updated shards would cost an uncompressed all-gather
per step (half of DDP's bytes), undoing the 1/32; see docs/onebit_adam.md.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .base import CompressedAdamBase


def compressed(optimizers: list) -> list[CompressedAdamBase]:
    return [o for o in optimizers if isinstance(o, CompressedAdamBase)]


def check_composes(optimizers: list, stage: int, config: Any, tensor_parallel: Any, loss_scaler: Any) -> None:
    """One clear error for every combination a compressed optimizer does not compose with."""
    found = compressed(optimizers)
    if not found:
        return
    name = type(found[0]).__name__
    allowed = ('Allowed: ZeroStrategy(stage=0) / strategy="zero0" (DDP layout, any world size), precision '
               '"32-true" or "bf16-mixed", gradient accumulation and clipping, as the only optimizer.')
    why = None
    if stage != 0:
        why = (f"ZeRO stage {stage} shards the optimizer state, and {name}'s compressed phase updates whole "
               "parameters from the 1-bit-averaged momentum over the whole frozen variance (a sharded "
               "update would need an uncompressed parameter all-gather per step, half of DDP's bytes)")
    elif len(optimizers) > 1:
        why = f"{name} decides when the engine reduces gradients, which would starve the other optimizers"
    elif loss_scaler is not None:
        why = (f"fp16 loss scaling decides skips from the gradient norm, which {name}'s compressed phase never "
               "has averaged (ranks would disagree on skipping)")
    elif tensor_parallel is not None:
        why = f"{name} exchanges whole local tensors over the world, not DTensor pieces over data_parallel"
    if why is not None:
        raise ValueError(f"{name} does not compose with this setup: {why}. {allowed}")


def bind_group(optimizers: list, group: Optional[Any]) -> None:
    """The engine's data-parallel group is the exchange's, unless the user chose one."""
    for o in compressed(optimizers):
        if o.process_group is None:
            o.process_group = group


def local_grads_probe(optimizers: list) -> Optional[Callable[[], bool]]:
    """What the reducer asks before reducing (None: no compressed optimizer, nothing to ask)."""
    found = compressed(optimizers)
    if not found:
        return None
    opt = found[0]
    return opt.uses_local_grads


def step_phase(optimizers: list) -> Optional[str]:
    """The phase the coming step runs in ("warmup" / "compressed"), None without a compressed optimizer."""
    found = compressed(optimizers)
    return found[0].phase() if found else None
