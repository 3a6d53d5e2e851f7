"""WHOLE_TENSOR: an update that reads whole tensors (LAMB / LARS trust ratios, Adafactor's factored moments,
Muon, Shampoo) computes something else on a shard ([Note: optimizer kinds]). Stage 0 steps whole parameters,
so any closure-free rule works there; stages 1-3 refuse it until the owner-rank step exists."""

from __future__ import annotations

from typing import Any

import torch

from .base import Kind, KindSetup, OptimizerKind


class WholeTensor(OptimizerKind):
    kind = Kind.WHOLE_TENSOR

    def __init__(self, allowed: Any) -> None:
        self._allowed = allowed  # () -> the elementwise classes, named in the error

    def check(self, optimizer: Any, setup: KindSetup) -> None:
        plan = setup.plan
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS re-evaluates the loss through a closure inside step(), which ZeRO's step (reduce, step, "
                "gather) cannot interleave with. Allowed: optimizers whose step() needs no closure "
                "(SGD, Adam, AdamW, ...)."
            )
        if not plan.shards_optimizer_state:
            return  # whole parameters on every rank (stage 0): any closure-free optimizer works
        cls, stage = type(optimizer), plan.stage
        names = sorted(c.__name__ for c in self._allowed())
        raise ValueError(
            f"{cls.__name__} cannot run on parameter shards: ZeRO stage {stage} needs an elementwise optimizer "
            f"(each element's update depends only on its own gradient and state). Allowed: {', '.join(names)} "
            "(exactly these classes: a subclass may change step()). Use stage=0, or, if your optimizer is "
            f"elementwise, declare it with lightning_zero.register_shardable_optimizer({cls.__name__})."
        )
