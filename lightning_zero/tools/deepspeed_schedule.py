"""DeepSpeed's WarmupLR / WarmupDecayLR as a torch LR scheduler (what ``from_deepspeed_config`` builds)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .deepspeed_auto import DeepSpeedConfigError


class DeepSpeedWarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR (``total_num_steps=None``) and WarmupDecayLR, formula for formula.

    DeepSpeed's iteration counter starts at -1 (the first step runs at ``warmup_min_lr``); torch's
    ``last_epoch`` starts at 0, so DeepSpeed's iteration is ``last_epoch - 1``.
    """

    def __init__(self, optimizer, type: str = "WarmupLR", warmup_min_lr: float = 0.0,  # noqa: A002
                 warmup_max_lr: Optional[float] = None, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 total_num_steps: Optional[int] = None, last_epoch: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise DeepSpeedConfigError(f"warmup_type {warmup_type!r}: allowed 'log', 'linear'")
        if type == "WarmupDecayLR" and total_num_steps is None:
            raise DeepSpeedConfigError("WarmupDecayLR needs total_num_steps")
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]  # DeepSpeed: the optimizer's lr
        self.min_lr, self.max_lr = float(warmup_min_lr), float(warmup_max_lr)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type, self.total_num_steps = warmup_type, total_num_steps
        super().__init__(optimizer, last_epoch)

    def gamma(self, it: int) -> float:
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup_num_steps)
            return it / self.warmup_num_steps
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))

    def get_lr(self) -> list[float]:
        lr = self.min_lr + (self.max_lr - self.min_lr) * self.gamma(self.last_epoch - 1)
        return [lr for _ in self.optimizer.param_groups]
