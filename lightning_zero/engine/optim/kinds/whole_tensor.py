"""WHOLE_TENSOR: an update that reads whole tensors (LAMB / LARS trust ratios, Adafactor's factored moments,
Muon, Shampoo) computes something else on a shard ([Note: optimizer kinds]). Stage 0 steps whole parameters,
so any closure-free rule works there; stages 1-3 step each parameter whole on its owner rank
([Note: owner-rank step], engine/optim/owner_step.py)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ...comm import collectives as C

from ...placement.stores import state_store_streams
from ..owner_step import OwnerStep, numel_cost
from .base import Kind, KindSetup, OptimizerKind

_log = logging.getLogger("lightning_zero.engine")


class WholeTensor(OptimizerKind):
    kind = Kind.WHOLE_TENSOR

    def __init__(self, costs: Callable[[], dict]) -> None:
        self._costs = costs  # () -> {class: cost(shape)}, the owner balance's cost where one was declared

    def check(self, optimizer: Any, setup: KindSetup) -> None:
        plan, name = setup.plan, type(optimizer).__name__
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS re-evaluates the loss through a closure inside step(), which ZeRO's step (reduce, step, "
                "gather) cannot interleave with. Allowed: optimizers whose step() needs no closure "
                "(SGD, Adam, AdamW, Muon, Adafactor, ...)."
            )
        if setup.tensor_parallel is not None:
            raise ValueError(
                f"{name} updates whole tensors, and tensor parallelism splits them across ranks: each rank would "
                "step its piece as if it were the whole matrix. Allowed: an elementwise optimizer (SGD, Adam, "
                f"AdamW, ...) with tensor_parallel_size, or {name} without it (any ZeRO stage)."
            )
        if plan.shards_optimizer_state and state_store_streams(plan.placement.optimizer_states):
            raise ValueError(
                f"{name} updates whole tensors, which its owner rank assembles in memory for the step; optimizer "
                "state on NVMe streams the step bucket by bucket through a ring of slices. Allowed: "
                f"{name} with its state on the device or offloaded to host memory (offload_optimizer=True)."
            )

    def bind(self, sharded: Any, group: Optional[Any]) -> None:
        if sharded.plan.shards_optimizer_state:
            sharded.owner = OwnerStep(sharded, group, self.cost_of(sharded.optimizer))
            if C.rank() == 0:
                declared = type(sharded.optimizer) in self._costs()
                _log.info(setup_line(sharded.optimizer, sharded.owner, declared))

    def cost_of(self, optimizer: Any) -> Callable[[tuple], int]:
        costs = self._costs()
        return next((c for cls, c in costs.items() if type(optimizer) is cls), numel_cost)

    def step(self, sharded: Any, run_step: Callable[[], None]) -> None:
        if sharded.owner is None:  # stage 0: the masters are whole
            run_step()
        else:
            sharded.owner.step(run_step)

    def init_state(self, sharded: Any, masters: list, zero_lr_step: Callable[[Any, list], None]) -> None:
        if sharded.owner is None:
            zero_lr_step(sharded.optimizer, masters)
        else:
            sharded.owner.init_state(masters, zero_lr_step)


def setup_line(optimizer: Any, owner: OwnerStep, declared: bool) -> str:
    """What the setup says about a whole-tensor optimizer: that it steps on owner ranks, and how even they are;
    for a class nobody declared, how to step it on shards if it is elementwise."""
    name, costs = type(optimizer).__name__, owner.cost_by_rank()
    share = max(costs) / (sum(costs) / len(costs)) if sum(costs) else 1.0
    line = (f"{name} updates whole tensors: each parameter is stepped on one owner rank (docs/optimizers.md); "
            f"the busiest rank carries {share:.2f}x the mean step cost.")
    if declared:
        return line
    return (f"{line} {name} is not declared elementwise; if it is, "
            f"lightning_zero.register_shardable_optimizer({name}) steps it on shards instead (cheaper).")
