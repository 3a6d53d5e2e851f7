"""1-bit Adam for N simulated workers in one process: the reference the distributed optimizer is held to.

Its own Adam arithmetic (AdamW with bias correction during warmup; then each worker's momentum from its own
gradient, the momenta averaged by ``exchange.reference_all_reduce`` -- the compression kernels, tested on
their own -- and the update over the frozen variance)."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_zero.engine.onebit.exchange import ChunkLayout, reference_all_reduce

LR, BETAS, EPS, WD = 0.02, (0.9, 0.99), 1e-8, 0.01


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return nn.functional.mse_loss(model(x), y)


def reference_run(world: int, steps: int, freeze_step: int) -> tuple[list[list[float]], list[torch.Tensor]]:
    """(losses per step per worker, final parameters) of 1-bit Adam over ``world`` simulated workers."""
    model = tiny_net()
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    layout = ChunkLayout([p.numel() for p in params], world, torch.device("cpu"))
    werr = [torch.zeros(world, layout.columns) for _ in range(world)]
    serr = [torch.zeros(1, layout.columns) for _ in range(world)]
    losses = []
    b1, b2 = BETAS
    for t in range(1, steps + 1):
        grads, row = [], []
        for r in range(world):
            model.zero_grad()
            loss = loss_of(model, r, t)
            loss.backward()
            row.append(loss.item())
            grads.append([p.grad.clone() for p in params])
        losses.append(row)
        with torch.no_grad():
            if t <= freeze_step:  # AdamW on the averaged gradient
                for k in range(len(params)):
                    g = sum(gr[k] for gr in grads) / world
                    m[k] = b1 * m[k] + (1 - b1) * g
                    v[k] = b2 * v[k] + (1 - b2) * g * g
                var_steps = t
            else:
                local = [layout.to_rows([b1 * m[k] + (1 - b1) * grads[r][k] for k in range(len(params))])
                         for r in range(world)]
                avg = layout.from_rows(reference_all_reduce(layout, local, werr, serr))
                m = [a[: p.numel()].view_as(p) for a, p in zip(avg, params)]
            for p, mk, vk in zip(params, m, v):
                p.mul_(1 - LR * WD)
                denom = vk.sqrt() / math.sqrt(1 - b2 ** var_steps) + EPS
                p.sub_(LR / (1 - b1 ** t) * mk / denom)
    return losses, [p.detach().clone() for p in params]
