"""``OptimizerKind``: the questions the engine asks about an optimizer's step ([Note: optimizer kinds])."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional


class Kind(enum.Enum):
    ELEMENTWISE = "elementwise"
    WHOLE_TENSOR = "whole_tensor"
    COMMUNICATING = "communicating"


@dataclass(frozen=True)
class KindSetup:
    """What a kind checks an optimizer against, before anything is sharded."""

    plan: Any  # the ShardingPlan
    config: Any  # the ZeroConfig
    optimizers: list  # every optimizer of the engine
    tensor_parallel: Any = None  # the TP view, or None
    loss_scaler: Any = None


class OptimizerKind:
    """The default answers (an elementwise optimizer's); each kind overrides what differs."""

    kind: Kind = Kind.ELEMENTWISE

    def check(self, optimizer: Any, setup: KindSetup) -> None:
        """One clear error naming what is allowed if ``optimizer`` cannot run under ``setup``; raised before
        the engine shards anything."""

    def bind(self, sharded: Any, group: Optional[Any]) -> None:
        """After the optimizer's ``ShardedOptimizer`` exists: what it must know of the engine (``group``: the
        shard group its collectives run over)."""

    def local_grads(self, optimizer: Any) -> Optional[Callable[[], bool]]:
        """What the reducer asks before every reduction: True while the optimizer takes this rank's own,
        unreduced gradients. None: always reduce."""
        return None

    def take_grads(self, sharded: Any, rows: list, local: bool) -> None:
        """Hand the step's gradients to ``sharded``'s masters; ``rows``: (BucketRow, used mask) of its
        buckets, finalized by the reducer; ``local``: the reducer reduced nothing this step."""
        sharded.take_rows(rows)

    def step(self, sharded: Any, run_step: Callable[[], None]) -> None:
        """The optimizer's step on ``sharded``'s masters; ``run_step()`` runs it where the masters are (the state
        store's step)."""
        run_step()

    def init_state(self, sharded: Any, masters: list, zero_lr_step: Callable[[Any, list], None]) -> None:
        """Create the optimizer state of ``masters`` (before a checkpoint load fills it)."""
        zero_lr_step(sharded.optimizer, masters)

    def phase(self, optimizer: Any) -> Optional[str]:
        """The label of the coming step's traffic in comm_report (None: one kind of step)."""
        return None

    def per_rank_state(self, optimizer: Any) -> tuple[str, ...]:
        """State entries whose values differ by rank for good: checkpoints keep one row per rank."""
        return ()

    def rank_local_state(self, optimizer: Any) -> tuple[str, ...]:
        """State entries that differ by rank *now*, with the parameters (the ranks hold their own models);
        empty while every rank holds the same model."""
        return ()
