"""A model whose optimizer states are one bucket (tests/test_nvme_ring.py; ``embedded`` is an ``estimate
--module`` factory)."""

from __future__ import annotations

import torch
from torch import nn


class Embedded(nn.Module):
    """An embedding that is most of the parameters, and a small head: a small GPT-2's shape of the problem."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(4000, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, ids):
        return self.head(self.wte(ids)).float().pow(2).mean()


def embedded() -> Embedded:
    return Embedded()
