"""A small model holding every case ZeRO must get right, and its deterministic data; a tied-weight model cut into
stage-3 units for the tests of the pieces on their own."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 11, 6


class ParityNet(nn.Module):
    """Tied embedding/output, odd sizes, a 1-element param, frozen, never-used and sometimes-used params, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied input/output embedding, as in T5 and GPT-2
        self.fc1 = nn.Linear(DIM, 13)  # 78 + 13 elements: not divisible by 2 or 4
        self.fc2 = nn.Linear(13, DIM)
        self.tiny = nn.Parameter(torch.tensor([0.7]))  # smaller than the world size
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3)  # never gets a gradient
        self.sometimes = nn.Linear(DIM, DIM)  # used on some ranks and steps only
        self.register_buffer("gain", torch.linspace(0.5, 1.5, DIM))

    def forward(self, tokens: torch.Tensor, use_sometimes: bool = False) -> torch.Tensor:
        h = self.frozen(self.emb(tokens) * self.gain)
        h = h + self.fc2(torch.tanh(self.fc1(h))) * self.tiny
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


class Block(nn.Module):
    """One stage-3 unit (``unit_classes=[Block]``): a single linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class TiedBlocks(nn.Module):
    """Two Block units and a root holding a tied embedding / head weight (one parameter, two modules)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def make_model(seed: int = 0) -> ParityNet:
    torch.manual_seed(seed)
    return ParityNet()


def batch(step: int, rank: int, micro: int = 0, size: int = 4, seq: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, VOCAB, (size, seq), generator=g)


def loss_fn(model: nn.Module, tokens: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
    logits = model(tokens[:, :-1], use_sometimes)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def param_groups(model: nn.Module, lr: float = 0.05):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": lr * 0.5}]


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(param_groups(model), lr=0.05, betas=(0.9, 0.95))
    if kind == "sgd":
        return torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)
    if kind.startswith("onebit:"):  # 1-bit Adam with AdamW's settings above, "onebit:<freeze_step>"
        from lightning_zero.optim import OneBitAdam

        return OneBitAdam(param_groups(model), lr=0.05, betas=(0.9, 0.95), freeze_step=int(kind.split(":")[1]))
    if kind.startswith("zeroone:"):  # 0/1 Adam, "zeroone:<var_freeze_step>": local steps soon after, the interval
        from lightning_zero.optim import ZeroOneAdam  # between synchronizations 1, 1, 2, 2, 4, 4, ... (clipped at 4)

        return ZeroOneAdam(param_groups(model), lr=0.05, betas=(0.9, 0.95), var_freeze_step=int(kind.split(":")[1]),
                           var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
    raise ValueError(kind)


def memory_mlp() -> nn.Module:
    """Odd-sized linears whose model states are large enough for the memory tests to measure."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 301), nn.GELU(), nn.Linear(301, 257), nn.GELU(), nn.Linear(257, 63))


def steps_beside_reference(engine, model, ref, ref_opt, steps: int, use=lambda step: True) -> None:
    """``steps`` one-rank steps of ``engine`` (over ``model``) and of the plain ``ref_opt`` (over ``ref``) on the
    same batches; ``use(step)``: whether the sometimes-used layer runs."""
    for step in range(steps):
        loss_fn(model, batch(step, 0), use(step)).backward()
        engine.step()
        loss_fn(ref, batch(step, 0), use(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
