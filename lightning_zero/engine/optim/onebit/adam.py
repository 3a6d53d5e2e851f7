"""1-bit Adam (Tang et al. 2021, arXiv:2102.02888; DeepSpeed's ``OnebitAdam``), on the engine's collectives.

``freeze_step`` steps of plain AdamW on the all-reduced gradient (the engine reduces as for any optimizer:
the warmup equals ``torch.optim.AdamW`` under DDP). From then on the variance is frozen and every step is:
this rank's momentum updated with its *own* gradient, the momenta averaged by the error-compensated 1-bit
all-reduce (exchange.py), the parameters updated with the averaged momentum over the frozen variance. The
engine reduces no gradient then (``uses_local_grads``): the step's only traffic is the compressed exchange.

Differences from DeepSpeed's, stated: bias correction is applied (``bias_correction=True``, as AdamW; the
variance's correction freezes with it; DeepSpeed accepts the flag and never applies it -- pass False for its
update); there is no silent first "initialization" step that updates the moments but not the parameters;
weight decay is AdamW's decoupled one (DeepSpeed's ``update += wd * p`` is the same arithmetic); one
exchange carries every parameter (DeepSpeed: two collectives per tensor); scales are per (tensor, chunk)
instead of per tensor; the error buffers are checkpointed per rank instead of reset on load.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .base import CompressedAdamBase


class OneBitAdam(CompressedAdamBase):
    """1-bit Adam. ``freeze_step``: steps of full-precision AdamW before the variance freezes and the
    momentum exchange becomes 1-bit (DeepSpeed's default 100000; set it to ~the LR warmup, e.g. 15-25% of
    training). ``group``: the data-parallel process group (default: the world; the engine's own group
    under ZeroStrategy)."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True, group: Optional[Any] = None) -> None:
        if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 1:
            raise ValueError(f"Invalid freeze_step {freeze_step!r}: allowed an int >= 1 (the variance must have "
                             "seen gradients before it freezes).")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction))
        super().__init__(params, defaults, group)
        self.freeze_step = freeze_step

    def uses_local_grads(self) -> bool:
        return self.steps_taken() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss, compressed, params, owner = self._begin_step(closure)
        if not compressed:  # AdamW on the reduced gradient, parameters without one skipped (as torch)
            for k, (p, g) in enumerate(zip(params, owner)):
                if p.grad is None:
                    continue
                st = self.init_state(p, k)
                st["exp_avg"].lerp_(p.grad, 1 - g["betas"][0])
                st["exp_avg_sq"].mul_(g["betas"][1]).addcmul_(p.grad, p.grad, value=1 - g["betas"][1])
                st["var_step"] += 1
                self._update(p, g, st)
            return loss
        states = [self.init_state(p, k) for k, p in enumerate(params)]
        if self.shards is None:  # stage 0: this rank's momentum is the state itself (replaced below)
            momenta = [st["exp_avg"] for st in states]
        else:  # stage 1: the whole averaged momentum, kept at one bit ([Note: 1-bit Adam at stage 1])
            momenta = self.whole_momentum.whole(self.layout(), states, self.shards.specs(params),
                                                self.steps_taken() - 1, self.process_group,
                                                [self.has_gradient(g, st) for g, st in zip(owner, states)])
        for w, g, grad in zip(momenta, owner, self.local_grads()):
            w.mul_(g["betas"][0]).add_(grad, alpha=1 - g["betas"][0])
        for g, st, m in zip(owner, states, self.exchange(momenta)):
            # the same averaged momentum on every rank; one bit cannot say zero, so an element without a
            # gradient (an embedding row never seen, GPT-2's key bias: gradient scale below eps) would move
            # by +-lr * scale / eps: it keeps momentum 0 and stays as it is ([Note: elements without a
            # gradient] in base.py; DeepSpeed asks the user for this mask, ``exp_avg_mask``)
            st["exp_avg"].copy_(m.mul_(self.has_gradient(g, st)))
        for p, g, st in zip(params, owner, states):
            if st["var_step"] > 0:  # never stepped in warmup: no variance (the mask above zeroed its momentum)
                self._update(p, g, st)
        return loss

    @staticmethod
    def _update(p: torch.Tensor, g: dict, st: dict) -> None:
        """AdamW's update (torch's single-tensor arithmetic) with the variance as it stands (frozen or not)."""
        st["step"] += 1
        lr, (b1, b2), eps = g["lr"], g["betas"], g["eps"]
        if g["weight_decay"]:
            p.mul_(1 - lr * g["weight_decay"])
        if g["bias_correction"]:
            bc1 = 1 - b1 ** float(st["step"])
            bc2_sqrt = math.sqrt(1 - b2 ** float(st["var_step"]))
            denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(eps)
            p.addcdiv_(st["exp_avg"], denom, value=-lr / bc1)
        else:
            p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(eps), value=-lr)
