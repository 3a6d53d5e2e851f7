"""1-bit Adam for N simulated workers in one process: the reference the distributed optimizer is held to.

Its own Adam arithmetic (AdamW with bias correction during warmup; then each worker's momentum from its own
gradient, the momenta averaged by ``exchange.reference_all_reduce`` -- the compression kernels, tested on
their own -- and the update over the frozen variance)."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_zero.engine.optim.onebit.exchange import ChunkLayout, reference_all_reduce

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


def takes_part(v: torch.Tensor, var_steps: int) -> torch.Tensor:
    """The elements with a gradient: variance above zero and a bias-corrected scale reaching eps ([Note:
    elements without a gradient] in engine/optim/onebit/base.py)."""
    scale = v.sqrt() / math.sqrt(1 - BETAS[1] ** float(var_steps)) if var_steps else v.sqrt()
    return (v > 0) & (scale >= EPS)


def reference_run(world: int, steps: int, freeze_step: int) -> tuple[list[list[float]], list[torch.Tensor]]:
    """(losses per step per worker, final parameters) of 1-bit Adam over ``world`` simulated workers.

    Written with the same tensor operations, in the same order, as torch's single-tensor AdamW (``lerp_``,
    ``addcmul_``, ``addcdiv_``) and the gradients averaged in rank order (``((g0 + g1) + g2 ...) / N``, which
    is the engine's stage-1 reduction on gloo -- each row divided by N, a power of two, then summed in rank
    order): a distributed run whose reduction sums in that order must equal it bit for bit (stage 1); stage
    0's ring all-reduce at 4 ranks sums in another order (last-ulp differences)."""
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
                    m[k].lerp_(g, 1 - b1)
                    v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
                var_steps = t
            else:  # each worker's own momentum, averaged by the 1-bit exchange, masked where no gradient
                local = [layout.to_rows([m[k].clone().mul_(b1).add_(grads[r][k], alpha=1 - b1)
                                         for k in range(len(params))]) for r in range(world)]
                avg = layout.from_rows(reference_all_reduce(layout, local, werr, serr))
                m = [a[: p.numel()].view_as(p).mul_(takes_part(vk, var_steps)) for a, p, vk in zip(avg, params, v)]
            for p, mk, vk in zip(params, m, v):
                p.mul_(1 - LR * WD)
                denom = (vk.sqrt() / math.sqrt(1 - b2 ** float(var_steps))).add_(EPS)
                p.addcdiv_(mk, denom, value=-LR / (1 - b1 ** float(t)))
    return losses, [p.detach().clone() for p in params]


def zero_one_reference(world: int, steps: int, var_freeze_step: int, var_update_scaler: int,
                       local_step_scaler: int, local_step_clipper: int, lr: float) -> list[list[float]]:
    """0/1 Adam for ``world`` simulated workers (each its own model copy: local steps make them differ):
    the losses per step per worker. Variance bias-corrected by its update count, no weight decay."""
    b1, b2 = BETAS
    models = [tiny_net() for _ in range(world)]
    params = [list(m.parameters()) for m in models]
    n = len(params[0])
    m = [[torch.zeros_like(p) for p in params[0]] for _ in range(world)]
    v = [torch.zeros_like(p) for p in params[0]]
    u = [[torch.zeros_like(p) for p in params[0]] for _ in range(world)]
    layout = ChunkLayout([p.numel() for p in params[0]], world, torch.device("cpu"))

    def fresh_errors():
        return [torch.zeros(world, layout.columns) for _ in range(world)], [torch.zeros(1, layout.columns)
                                                                           for _ in range(world)]

    werr, serr = fresh_errors()

    def one_bit_mean(per_worker):  # per_worker[r][k] -> the averaged tensors, masked where no gradient
        rows = [layout.to_rows(vals) for vals in per_worker]
        out = layout.from_rows(reference_all_reduce(layout, rows, werr, serr))
        return [o[: v[k].numel()].view_as(v[k]) * takes_part(v[k], var_steps) for k, o in enumerate(out)]

    var_interval, var_counter, local_interval, local_counter, lrs, frozen, var_steps = 1, 0, 1, 0, 0.0, False, 0
    losses = []
    for t in range(1, steps + 1):
        grads, row = [], []
        for r in range(world):
            models[r].zero_grad()
            loss = loss_of(models[r], r, t)
            loss.backward()
            row.append(loss.item())
            grads.append([p.grad.clone() for p in params[r]])
        losses.append(row)
        with torch.no_grad():
            def denom(k):
                return v[k].sqrt() / math.sqrt(1 - b2 ** var_steps) + EPS if var_steps else v[k].sqrt() + EPS
            if not frozen:
                if t % var_interval == 0:
                    g = [sum(grads[r][k] for r in range(world)) / world for k in range(n)]
                    for k in range(n):
                        v[k] = (v[k] * b2).addcmul_(g[k], g[k], value=1 - b2)
                    var_steps += 1
                else:
                    g = one_bit_mean(grads)
                for r in range(world):
                    for k in range(n):
                        m[r][k] = b1 * m[r][k] + (1 - b1) * g[k]
                        params[r][k].sub_(m[r][k] / denom(k), alpha=lr)
                if t % var_interval == 0:
                    var_counter += 1
                    if var_counter == var_update_scaler:
                        var_counter, var_interval = 0, var_interval * 2
            else:
                lrs += lr
                for r in range(world):
                    for k in range(n):
                        m[r][k] = b1 * m[r][k] + (1 - b1) * grads[r][k]
                        step = (m[r][k] / denom(k)) * -lr
                        params[r][k].add_(step)
                        u[r][k] += step
                if t % local_interval == 0:
                    avg = one_bit_mean([[u[r][k] * denom(k) for k in range(n)] for r in range(world)])
                    for r in range(world):
                        for k in range(n):
                            params[r][k].sub_(u[r][k]).add_(avg[k] / denom(k))
                            m[r][k] = -avg[k] / lrs
                            u[r][k] = torch.zeros_like(u[r][k])
                    lrs = 0.0
                local_counter += 1
                if local_counter == local_step_scaler:
                    local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
            if t > var_freeze_step and not frozen:
                frozen = True
                werr, serr = fresh_errors()
    return losses
