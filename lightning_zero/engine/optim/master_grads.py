"""The gradient side of a :class:`~.optimizer.ShardedOptimizer`: the step's gradients handed to the masters
(as the optimizer's kind takes them, [Note: optimizer kinds]), their norm, clipping and scaling, and the
per-step bookkeeping that a ``zero_grad`` resets.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm import collectives as C
from ..layout import tensor_parallel as TP


def _grad_dtype(m: torch.Tensor) -> torch.dtype:
    """fp32 for a bf16 master too ([Note: low-precision optimizer states]: its ``grad_dtype``)."""
    return getattr(m, "grad_dtype", None) or m.dtype


class MasterGrads:
    """Mixed into ShardedOptimizer, which provides ``masters``, ``buckets``, ``plan``, ``kind``, ``states``,
    ``device``, ``master_device``, ``tp_group`` / ``tp_size`` and ``frozen_at_setup`` / ``check_not_unfrozen``."""

    def reset_step_state(self) -> None:
        """Per-step bookkeeping of this optimizer's gradients (several optimizers step independently)."""
        self.grads_final = False
        # a communicating kind's local phase at stage 1: nothing was reduced, and the optimizer takes this
        # rank's whole local gradients (fp32, keyed by master) instead of slices (kinds/communicating.py)
        self.whole_grads: dict[int, torch.Tensor] = {}
        self.takes_whole = False
        self.clip_coef: Optional[float] = None
        self.clip_value: Optional[float] = None
        self.sq_norm: Optional[torch.Tensor] = None

    def finalize(self, reducer, names) -> None:
        """This step's gradients taken, once (``names()``: {id(param): name}, for an error message only)."""
        if self.grads_final:
            return
        if self.frozen_at_setup:
            self.check_not_unfrozen(names)
        self.take_reduced_grads(reducer)

    def take_reduced_grads(self, reducer) -> None:
        """Complete the reductions of this optimizer's buckets and hand the step's gradients to the masters,
        as the optimizer's kind takes them ([Note: optimizer kinds]; parameters no rank used keep
        ``grad=None``, as under DDP)."""
        rows = reducer.finalize(self.buckets)
        self.kind.take_grads(self, rows, reducer.takes_local_grads())

    def take_rows(self, rows: list) -> None:
        """Point the masters' ``.grad`` at the reduced gradients of ``rows`` ((BucketRow, used mask) each):
        stage 0's whole gradients in ``param.grad``, else this rank's slice of the row's shard (its host copy
        when the step runs on the host)."""
        grads: list[list[Optional[torch.Tensor]]] = []
        for row, mask in rows:
            b, used = row.bucket, mask.tolist()
            if not self.plan.shards_optimizer_state:  # stage 0: the all-reduced whole gradients
                grads.append([TP.local_grad(p) if u else None for p, u in zip(b.params, used)])
                continue
            flat = row.step_grads()
            views = b.local_views(flat) if flat is not None else [None] * len(b.params)
            grads.append([v if u else None for v, u in zip(views, used)])
        self.assign_grads(grads)
        self.grads_final = True

    def assign_grads(self, grads: list[list[Optional[torch.Tensor]]]) -> None:
        """Point each master's ``.grad`` at its reduced gradient (fp32, on the master's device)."""
        for row, grow in zip(self.masters, grads):
            for m, g in zip(row, grow):
                if g is None:
                    m.grad = None
                elif g.dtype == _grad_dtype(m) and g.device == m.device:
                    m.grad = g.view_as(m)
                else:
                    m.grad = g.to(device=m.device, dtype=_grad_dtype(m), non_blocking=True).view_as(m)
        self.states.grads_landed(self.device)  # a host step: the device->host copies have landed

    def grads(self) -> list[torch.Tensor]:
        if self.takes_whole:
            return [self.whole_grads[id(m)] for row in self.masters for m in row if id(m) in self.whole_grads]
        return [m.grad for row in self.masters for m in row if m.grad is not None]

    def local_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's master gradients (fp32). Non-finite if any grad is."""
        grads = self.grads()
        if not grads:
            return torch.zeros((), device=self.master_device)
        squares = torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2)
        if self.tp_group is not None:
            weights = [TP.norm_weight(p, self.tp_size) for row, b in zip(self.masters, self.buckets)
                       for m, p in zip(row, b.params) if m.grad is not None]
            squares = squares * torch.tensor(weights, dtype=squares.dtype, device=squares.device)
        return squares.sum()

    def global_sq_norm(self, group=None, device: Optional[torch.device] = None) -> torch.Tensor:
        """Sum of squares of the whole gradient over all ranks, once per step (``sq_norm``): the shards of
        stages 1-3 are disjoint, so their squares add (one all-reduce, on ``device``: the compute device)."""
        if self.sq_norm is None:
            sq = self.local_sq_norm()
            if self.plan.shards_optimizer_state and not self.takes_whole:  # whole local grads: this rank's own
                sq_dev = sq.to(device if device is not None else sq.device)
                C.all_reduce(sq_dev, group=group)
                sq = sq_dev.to(sq.device)
            if self.tp_group is not None:  # the TP pieces add up; a replicated one counts once (weighted 1/T)
                sq_dev = sq.to(device if device is not None else sq.device)
                C.all_reduce(sq_dev, group=self.tp_group)
                sq = sq_dev.to(sq.device)
            self.sq_norm = sq
        return self.sq_norm

    def unscale_and_clip(self, inv_scale: float) -> None:
        """One multiply for the loss scale and the clip coefficient, then the value clip, if any."""
        self.scale_grads(inv_scale * (self.clip_coef if self.clip_coef is not None else 1.0))
        if self.clip_value is not None:
            self.clamp_grads(self.clip_value)

    def scale_grads(self, coef: float) -> None:
        grads = self.grads()
        if grads and coef != 1.0:
            torch._foreach_mul_(grads, coef)

    def clamp_grads(self, value: float) -> None:
        for g in self.grads():
            g.clamp_(-value, value)

    def clear_grads(self) -> None:
        self.whole_grads, self.takes_whole = {}, False
        for row in self.masters:
            for m in row:
                m.grad = None
