"""The 1-bit family's optimizer kind (1-bit Adam, 0/1 Adam): COMMUNICATING ([Note: optimizer kinds],
engine/optim/kinds/communicating.py), with the combinations it refuses and its stage-1 shard binding.

At stage 0 the optimizer steps whole parameters that it updates identically on every rank (the exchange's
result is the same everywhere). At stage 1 (1-bit Adam only) it steps master slices
([Note: 1-bit Adam at stage 1], sharded.py). Stages 2-3 are refused: the compressed phase needs each rank's
whole local gradient, which they never hold (their point); 0/1 Adam at stage 1 too: its local steps move each
rank's parameters by its own gradient, which one owner per master slice cannot do. See docs/onebit_adam.md.
"""

from __future__ import annotations

from typing import Any

from ..kinds import KindSetup, register_optimizer_kind
from ..kinds.communicating import Communicating
from .adam import OneBitAdam
from .base import CompressedAdamBase
from .sharded import ShardBinding


class CompressedAdamKind(Communicating):
    def check(self, optimizer: Any, setup: KindSetup) -> None:
        check_composes(setup.optimizers, setup.plan, setup.config, setup.tensor_parallel, setup.loss_scaler)

    def shard_binding(self, sharded: Any) -> ShardBinding:
        return ShardBinding(sharded)


register_optimizer_kind(CompressedAdamBase, CompressedAdamKind())


def compressed(optimizers: list) -> list[CompressedAdamBase]:
    return [o for o in optimizers if isinstance(o, CompressedAdamBase)]


def check_composes(optimizers: list, plan: Any, config: Any, tensor_parallel: Any, loss_scaler: Any) -> None:
    """One clear error for every combination a compressed optimizer does not compose with."""
    found = compressed(optimizers)
    if not found:
        return
    name = type(found[0]).__name__
    allowed = ('Allowed: ZeroStrategy(stage=0) / strategy="zero0" (DDP layout) for OneBitAdam and ZeroOneAdam, '
               'ZeroStrategy(stage=1) / strategy="zero1" (optimizer state sharded) for OneBitAdam; any world '
               'size, precision "32-true" or "bf16-mixed", gradient accumulation and clipping, as the only '
               'optimizer, without optimizer offload or hybrid sharding.')
    why = None
    if plan.shards_grads:
        why = (f"ZeRO stage {plan.stage} shards the gradients, and {name}'s compressed phase forms each rank's "
               "own momentum from its whole local gradient (reduced nowhere), which that stage never holds")
    elif plan.shards_optimizer_state and not isinstance(found[0], OneBitAdam):
        why = (f"ZeRO stage {plan.stage} gives every master slice one owner, and {name}'s local steps move "
               "each rank's parameters by its own gradient between synchronizations")
    elif plan.shards_optimizer_state and (plan.placement.steps_on_host or config.shard_group_size is not None):
        why = (f"{name} at ZeRO stage {plan.stage} exchanges over the shard group with its state on the compute "
               "device: optimizer offload and hybrid sharding (shard_group_size) are not built for it")
    elif len(optimizers) > 1:
        why = f"{name} decides when the engine reduces gradients, which would starve the other optimizers"
    elif loss_scaler is not None:
        why = (f"fp16 loss scaling decides skips from the gradient norm, which {name}'s compressed phase never "
               "has averaged (ranks would disagree on skipping)")
    elif tensor_parallel is not None:
        why = f"{name} exchanges whole local tensors over the world, not DTensor pieces over data_parallel"
    if why is not None:
        raise ValueError(f"{name} does not compose with this setup: {why}. {allowed}")
