"""What the parameter-offload-to-NVMe tests share (tests/test_nvme_params.py, tests/test_nvme_params_errors.py)."""

from __future__ import annotations

import os

from torch import nn


class Stack(nn.Module):
    """``layers`` equal Linear units: the shards on disk are many times the ring (a few units' shards)."""

    def __init__(self, layers: int = 40, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        return self.layers(x).float().pow(2).mean()


STACK_UNITS = dict(unit_classes=["Linear"], persist_numel=0)  # every Linear a unit, none kept gathered


def swap_files(path: str) -> list[str]:
    """The scratch files left under ``path``."""
    return sorted(f for f in os.listdir(path) if f.endswith(".swap"))
