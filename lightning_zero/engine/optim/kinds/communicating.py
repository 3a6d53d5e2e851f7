"""COMMUNICATING: an optimizer that brings its own exchange ([Note: optimizer kinds]); the 1-bit family
(engine/optim/onebit/kind.py) is one.

While ``optimizer.uses_local_grads()`` is True the reducer launches nothing in backward and the step hands the
optimizer this rank's own gradients; it exchanges what it needs (compressed momentum) itself. At stage 0 it
steps whole parameters, identically on every rank. At stage 1 it steps master slices: the engine hands it
each step's whole local gradients (``ShardedOptimizer.whole_grads``) and the slices' specs through the family's
shard binding, and publishes the updated slices as for any optimizer. The protocol such an optimizer provides:
``uses_local_grads()``, ``phase()``, ``per_rank_state``, ``rank_local_state()``, ``process_group``,
``bind_shards(binding)``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...layout import tensor_parallel as TP
from .base import Kind, OptimizerKind


class Communicating(OptimizerKind):
    kind = Kind.COMMUNICATING

    def shard_binding(self, sharded: Any) -> Any:
        """What the family's optimizer is told at stage 1 about its master slices (its own class)."""
        raise NotImplementedError

    def bind(self, sharded: Any, group: Optional[Any]) -> None:
        optimizer = sharded.optimizer
        if optimizer.process_group is None:  # the engine's shard group is the exchange's, unless the user chose
            optimizer.process_group = group
        if sharded.plan.shards_optimizer_state:
            optimizer.bind_shards(self.shard_binding(sharded))

    def local_grads(self, optimizer: Any) -> Optional[Callable[[], bool]]:
        return optimizer.uses_local_grads

    def take_grads(self, sharded: Any, rows: list, local: bool) -> None:
        if local and sharded.plan.shards_optimizer_state:
            take_whole_local_grads(sharded, rows)
        else:  # stage 0's local gradients are where reduced ones would be: param.grad
            sharded.take_rows(rows)

    def phase(self, optimizer: Any) -> Optional[str]:
        return optimizer.phase()

    def per_rank_state(self, optimizer: Any) -> tuple[str, ...]:
        return tuple(optimizer.per_rank_state)

    def rank_local_state(self, optimizer: Any) -> tuple[str, ...]:
        return tuple(optimizer.rank_local_state())


def take_whole_local_grads(sharded: Any, rows: list) -> None:
    """No reduction ran: each master's ``.grad`` stays None and ``sharded.whole_grads`` holds this rank's whole
    gradient of its parameter, in fp32 as stage 0 casts it; the norm, clipping and scaling act on these (each
    rank's own, as at stage 0)."""
    sharded.clear_grads()
    for masters, (row, mask) in zip(sharded.masters, rows):
        for m, p, used in zip(masters, row.bucket.params, mask.tolist()):
            if used:
                g = TP.local_grad(p)
                sharded.whole_grads[id(m)] = g if g.dtype == torch.float32 else g.float()
    sharded.takes_whole = sharded.grads_final = True
