"""Optimizer kinds: how an optimizer steps, asked once per optimizer when an engine is built.

[Note: optimizer kinds]
ZeRO can hand an optimizer three things, and which one decides everything the engine does around its step:

    kind           steps                                   the engine around it
    ELEMENTWISE    flat master shards (any stage)          reduce(-scatter) in backward, masters' .grad = shards
    WHOLE_TENSOR   whole parameters                        stage 0: the masters are whole; stages 1-3: each
                                                           parameter stepped whole on its owner rank, gathered
                                                           and scattered per bucket ([Note: owner-rank step])
    COMMUNICATING  brings its own exchange (1-bit family)  asks it before every reduction whether to reduce;
                                                           binds it to the group and (stage 1) its slices

``kind_of(optimizer)`` answers from the registry (registry.py): a registered family base class (by
``isinstance``: 1-bit Adam and 0/1 Adam register ``CompressedAdamBase``, engine/optim/onebit/kind.py), else the
exact class: torch's elementwise optimizers and those declared with :func:`register_shardable_optimizer`
are ELEMENTWISE, everything else WHOLE_TENSOR (a subclass may override ``step()`` with a whole-tensor rule,
so ``issubclass`` admits nothing): the owner-rank step is right for any per-parameter update, the shard step
only for an elementwise one, so an undeclared class takes the step that is always right. The builder asks it once and hands each optimizer's kind to its
``ShardedOptimizer``; the constructor, the step, checkpoints and comm_report call the kind's methods
(base.py) and hold no optimizer-specific call. A new kind is one file here and one line in ``registry.py``.
"""

from __future__ import annotations

from .base import Kind, KindSetup, OptimizerKind
from .registry import (
    check_shardable,
    kind_of,
    per_rank_state,
    register_optimizer_kind,
    register_shardable_optimizer,
    register_whole_tensor_optimizer,
)

__all__ = [
    "Kind",
    "KindSetup",
    "OptimizerKind",
    "check_shardable",
    "kind_of",
    "per_rank_state",
    "register_optimizer_kind",
    "register_shardable_optimizer",
    "register_whole_tensor_optimizer",
]
