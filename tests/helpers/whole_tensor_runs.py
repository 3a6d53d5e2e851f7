"""Whole-tensor optimizers (Muon + AdamW, Adafactor, a LAMB-style trust ratio written here) on zoo models, under
ZeroEngine or under torch DDP with the same optimizers: same seed, same per-rank batches, accumulation with
``no_sync``, global-norm clipping across every optimizer, a LambdaLR schedule on each.

The reference never calls lightning_zero: it is DDP's all-reduced gradients and the optimizers' own step on
whole parameters, which is what the owner-rank step must reproduce.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero import muon_split
from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.zoo_models import ZOO

ACCUM, CLIP = 2, 0.5


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019, Algorithm 2) written from the paper: Adam's direction r = m_hat / (sqrt(v_hat) + eps)
    plus weight decay, scaled per tensor by the trust ratio ||w|| / ||r + wd * w||."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros(())
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                t = st["step"].item()
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                r = (st["exp_avg"] / (1 - b1**t)) / ((st["exp_avg_sq"] / (1 - b2**t)).sqrt() + g["eps"])
                u = r + g["weight_decay"] * p
                w_norm, u_norm = p.norm(), u.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones(()))
                p.add_(u * trust, alpha=-g["lr"])


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch's Muon orthogonalization (torch/optim/_muon.py) computed in fp32 instead of bf16: the same
    algorithm at the precision an fp32 comparison needs (in bf16 a last-bit difference of a gradient, such as a
    different summation order of the clip norm, moves the update by ~1e-3 relative, at ZeRO stage 0 too)."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def fp32_newton_schulz() -> None:
    """Make torch's Muon orthogonalize in fp32 in this process (forked ranks inherit it)."""
    import torch.optim._muon as muon

    muon._zeropower_via_newtonschulz = newton_schulz_fp32


def make_optimizers(model: torch.nn.Module, which: str) -> list:
    if which == "muon_adamw":
        hidden, rest = muon_split(model)
        return [torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.01)]
    if which == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    if which == "lamb":
        return [Lamb(model.parameters(), lr=1e-2)]
    raise ValueError(which)


def run(rank: int, name: str, which: str, cfg: Optional[ZeroConfig], steps: int = 3, clip: Optional[float] = CLIP,
        accum: int = ACCUM, compute_dtype: Optional[torch.dtype] = None) -> dict:
    """Losses, pre-clip norms, the final fp32 state dict and (ZeRO) per-optimizer state bytes; ``cfg=None``: DDP."""
    from lightning_zero import register_whole_tensor_optimizer

    register_whole_tensor_optimizer(Lamb)
    builder, make_batch, loss_fn = ZOO[name]
    torch.manual_seed(0)
    model = builder()
    opts = make_optimizers(model, which)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1.0 + s)) for o in opts]
    engine = ZeroEngine(model, opts, cfg, compute_dtype=compute_dtype) if cfg is not None else None
    runner = model if engine is not None else DDP(model, find_unused_parameters=True)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(accum):
            last = micro == accum - 1
            ctx = torch.enable_grad() if last else (engine.no_sync() if engine is not None else runner.no_sync())
            with ctx:
                if engine is not None:
                    engine.prepare_forward()
                loss = loss_fn(runner, make_batch(step * accum + micro, rank)).float() / accum
                loss.backward()
            losses.append(loss.item())
        if engine is not None:
            if clip is not None:
                norms.append(engine.clip_grad_norm_(clip).item())
            engine.step()
        else:
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            for o in opts:
                o.step()
                o.zero_grad()
        for s in scheds:
            s.step()
    out = {"losses": losses, "norms": norms}
    if engine is not None:
        out["state_bytes"] = [s.state_bytes() for s in engine.shardeds]
        engine.restore_fp32_module()
        engine.remove(hand_back=False)
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out
