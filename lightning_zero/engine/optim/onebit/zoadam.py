"""0/1 Adam (Lu et al. 2022, arXiv:2202.06009; DeepSpeed's ``ZeroOneAdam``), on the engine's collectives.

Before ``var_freeze_step`` the variance is updated only at steps ``t`` with ``t % var_interval == 0`` (on the
all-reduced gradient, which the engine reduces at exactly those steps); ``var_interval`` starts at 1 and
doubles after every ``var_update_scaler`` such updates. At the other steps the gradient is averaged by the
1-bit error-compensated all-reduce (exchange.py) and only the momentum moves. After ``var_freeze_step`` the
variance is frozen and ranks take *local steps*: momentum and parameters move with this rank's own gradient,
the accumulated update ``u`` is exchanged (1-bit) every ``local_step_interval`` steps, which restarts the
momentum from the average; ``local_step_interval`` starts at 1 and doubles every ``local_step_scaler`` steps,
up to ``local_step_clipper``. Between synchronizations the ranks' parameters differ (the algorithm's point).

Unlike DeepSpeed's, the error buffers are zeroed when the variance freezes (they held the gradients'
compression error, not the updates'). As DeepSpeed's: weight decay inside
the update (AdamW's decoupled arithmetic). ``bias_correction=True`` (the default) corrects the
variance's bias by its number of updates (the momentum's is left out: the local steps rebuild the momentum
from the accumulated update, which assumes none); ``False`` is DeepSpeed's update. The policy counters live in the param groups (checkpointed).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import CompressedAdamBase

_POLICY = dict(var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0,
               var_frozen=False)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Invalid {name} {value!r}: allowed an int >= 1.")
    return value


class ZeroOneAdam(CompressedAdamBase):
    """0/1 Adam with DeepSpeed's knobs and defaults (``var_freeze_step=100000``, ``var_update_scaler=16``,
    ``local_step_scaler=32678``, ``local_step_clipper=16``). ``group``: the data-parallel process group."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, bias_correction: bool = True, group: Optional[Any] = None) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction))
        super().__init__(params, defaults, group)
        self.var_freeze_step = _positive_int("var_freeze_step", var_freeze_step)
        self.var_update_scaler = _positive_int("var_update_scaler", var_update_scaler)
        self.local_step_scaler = _positive_int("local_step_scaler", local_step_scaler)
        self.local_step_clipper = _positive_int("local_step_clipper", local_step_clipper)

    def policy(self) -> dict:
        """The phase counters (one copy, in the first param group; every group mirrors it)."""
        g = self.param_groups[0]
        for k, v in _POLICY.items():
            g.setdefault(k, v)
        return g

    def rank_local_state(self) -> tuple[str, ...]:
        # from the variance freeze on, each rank's parameters, momentum and accumulated update move by its own
        # gradient; a synchronization brings them together only up to rounding (the local steps are undone
        # by a subtraction), so they stay per rank: [Note: the ranks' own models] (local_models.py)
        if self.param_groups and self.policy()["var_frozen"] and self._world() > 1:
            return ("exp_avg", "momentum_accumulator")
        return ()

    def uses_local_grads(self) -> bool:
        pol = self.policy()
        return bool(pol["var_frozen"]) or (self.steps_taken() + 1) % pol["var_interval"] != 0

    @torch.no_grad()
    def step(self, closure=None):
        pol = self.policy()
        loss, local, params, owner = self._begin_step(closure)
        full_precision = not local  # the engine all-reduced this step's gradients
        t = self.steps_taken()
        states = [self.init_state(p, k, extra=("momentum_accumulator",)) for k, p in enumerate(params)]
        if not pol["var_frozen"]:
            if full_precision:
                grads = [self.grad_or_zero(p) for p in params]
                for g, st, grad in zip(owner, states, grads):
                    st["exp_avg_sq"].mul_(g["betas"][1]).addcmul_(grad, grad, value=1 - g["betas"][1])
                    st["var_step"] += 1
            else:  # 1 bit cannot say 0: elements without a gradient get none ([Note: elements without a gradient])
                grads = [x.mul_(self.has_gradient(g, st)) for x, g, st in
                         zip(self.exchange([self.grad_or_zero(p) for p in params]), owner, states)]
            for p, g, st, grad in zip(params, owner, states, grads):
                st["exp_avg"].mul_(g["betas"][0]).add_(grad, alpha=1 - g["betas"][0])
                st["step"] += 1
                p.sub_(self._update(p, g, st), alpha=g["lr"])
            if full_precision:
                pol["var_counter"] += 1
                if pol["var_counter"] == self.var_update_scaler:
                    pol["var_counter"], pol["var_interval"] = 0, pol["var_interval"] * 2
        else:
            pol["lrs"] += owner[0]["lr"] if owner else 0.0
            for p, g, st in zip(params, owner, states):
                st["exp_avg"].mul_(g["betas"][0]).add_(self.grad_or_zero(p), alpha=1 - g["betas"][0])
                st["step"] += 1
                upd = self._update(p, g, st).mul_(-g["lr"])
                p.add_(upd)
                st["momentum_accumulator"].add_(upd)
            if t % pol["local_step_interval"] == 0:  # synchronize: undo the local steps, apply the average
                denoms = [self._denom(g, st) for g, st in zip(owner, states)]
                for p, st, d in zip(params, states, denoms):
                    p.sub_(st["momentum_accumulator"])
                    st["momentum_accumulator"].mul_(d)
                avg = self.exchange([st["momentum_accumulator"] for st in states])
                for p, g, st, d, u in zip(params, owner, states, denoms, avg):
                    u.mul_(self.has_gradient(g, st))
                    st["exp_avg"].copy_(u).div_(-pol["lrs"])
                    p.add_(u / d)
                    st["momentum_accumulator"].zero_()
                pol["lrs"] = 0.0
            pol["local_step_counter"] += 1
            if pol["local_step_counter"] == self.local_step_scaler:
                pol["local_step_counter"] = 0
                pol["local_step_interval"] = min(self.local_step_clipper, pol["local_step_interval"] * 2)
        if t > self.var_freeze_step and not pol["var_frozen"]:
            pol["var_frozen"] = True
            # the exchanged quantity changes from gradients to accumulated updates (about lr times smaller):
            # the gradients' compression error would swamp the first updates' exchange (measured: the loss
            # jumps 4 orders of magnitude at the first synchronization), so the error memory starts afresh
            for st in states:
                st["worker_error"].zero_()
                st["server_error"].zero_()
        return loss

    @staticmethod
    def _denom(g: dict, st: dict) -> torch.Tensor:
        """``sqrt(v / (1 - beta2^k)) + eps``, ``k`` the variance updates so far (``bias_correction=False``:
        DeepSpeed's ``sqrt(v) + eps``; with a short variance phase it makes steps several times too long)."""
        v = st["exp_avg_sq"]
        k = float(st["var_step"])
        if g["bias_correction"] and k > 0:
            return (v.sqrt() / (1 - g["betas"][1] ** k) ** 0.5).add_(g["eps"])
        return v.sqrt().add_(g["eps"])

    @classmethod
    def _update(cls, p: torch.Tensor, g: dict, st: dict) -> torch.Tensor:
        """DeepSpeed's ``exp_avg / denom + weight_decay * p`` (a new tensor)."""
        upd = st["exp_avg"] / cls._denom(g, st)
        if g["weight_decay"]:
            upd.add_(p, alpha=g["weight_decay"])
        return upd
