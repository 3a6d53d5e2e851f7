"""Helpers for the checkpoint tests: a model with a real tied-weight alias, a fork-based rank runner."""

from __future__ import annotations

import os

import torch

from tests.helpers.dist_utils import run_distributed
from tests.helpers.lightning_models import ParityModule
from tests.helpers.models import VOCAB, ParityNet, loss_fn


# ParityNet's output projection is a module sharing the embedding's weight: its state dict lists the
# parameter twice (``emb.weight`` and the alias ``head.weight``), as T5/GPT-2 do.
TiedNet = ParityNet


def make_tied(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def global_batch(step: int, size: int = 8, seq: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(4242 + step)
    return torch.randint(0, VOCAB, (size, seq), generator=g)


def train(model, engine, rank: int, world_size: int, steps: range) -> None:
    """Every step sees the same global batch whatever the world size (split evenly over the ranks)."""
    for s in steps:
        tokens = global_batch(s).chunk(world_size)[rank]
        loss_fn(model, tokens, s % 2 == 0).backward()
        engine.step()


class TiedParityModule(ParityModule):
    """ParityModule on TiedNet; also records the precision plugin's state (loss scaler) at train start."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.net = make_tied()

    def on_train_start(self) -> None:
        super().on_train_start()
        state = self.trainer.precision_plugin.state_dict()
        torch.save(state, os.path.join(self.out, f"{self.tag}precision_rank{self.global_rank}.pt"))


run_forked = run_distributed  # forked gloo ranks (tests/helpers/dist_utils.py)
