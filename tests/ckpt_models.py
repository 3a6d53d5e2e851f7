"""Helpers for the checkpoint tests: a model with a real tied-weight alias, a fork-based rank runner."""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.dist_utils import free_port
from tests.lightning_models import ParityModule
from tests.models import DIM, VOCAB, ParityNet, loss_fn


class TiedNet(ParityNet):
    """ParityNet whose output projection is a module sharing the embedding's weight: the state dict lists
    the parameter twice (``emb.weight`` and its alias ``head.weight``), as T5/GPT-2 do."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor, use_sometimes: bool = False) -> torch.Tensor:
        h = self.frozen(self.emb(tokens) * self.gain)
        h = h + self.fc2(torch.tanh(self.fc1(h))) * self.tiny
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


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


# -- ranks by fork (the parent's imports are inherited: much faster than spawn) ------------------------------------
def _entry(rank: int, world_size: int, port: int, fn, args, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"rank{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_forked(fn, world_size: int, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; return the per-rank results."""
    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.start_processes(_entry, args=(world_size, free_port(), fn, args, outdir), nprocs=world_size,
                               join=True, start_method="fork")
        except Exception:
            pass  # the rank files say what went wrong
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result")
            out = torch.load(path, weights_only=False)
            if not out["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{out['error']}")
            results.append(out["result"])
        return results
