"""Which kind each optimizer is ([Note: optimizer kinds]): the one table ``kind_of`` reads."""

from __future__ import annotations

from typing import Any

import torch

from .base import KindSetup, OptimizerKind
from .elementwise import ELEMENTWISE
from .whole_tensor import WholeTensor

_ELEMENTWISE: set[type] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
}
_WHOLE_TENSOR: set[type] = set()  # declared so by their authors (stage 0 only, for now)
_FAMILIES: dict[type, OptimizerKind] = {}  # base class -> kind, matched by isinstance (communicating families)

WHOLE_TENSOR = WholeTensor(lambda: _ELEMENTWISE)


def register_shardable_optimizer(cls: type) -> type:
    """Declare a custom optimizer class elementwise, hence safe to run on shards. Usable as decorator."""
    _WHOLE_TENSOR.discard(cls)
    _ELEMENTWISE.add(cls)
    return cls


def register_whole_tensor_optimizer(cls: type) -> type:
    """Declare a custom optimizer class whole-tensor (its update reads whole tensors): stage 0 steps it on
    whole parameters; stages 1-3 refuse it with the error that names what is allowed. Usable as decorator."""
    _ELEMENTWISE.discard(cls)
    _WHOLE_TENSOR.add(cls)
    return cls


def register_optimizer_kind(base: type, kind: OptimizerKind) -> None:
    """Every instance of ``base`` (subclasses included) is of ``kind``: a family that brings its own step
    protocol (the 1-bit family, engine/optim/onebit/kind.py)."""
    _FAMILIES[base] = kind


def kind_of(optimizer: Any) -> OptimizerKind:
    """How ``optimizer`` steps (see the Note); asked once per optimizer by the builder."""
    for base, kind in _FAMILIES.items():
        if isinstance(optimizer, base):
            return kind
    # exact classes only: a subclass may override step() with a whole-tensor rule (LAMB written as
    # ``class Lamb(torch.optim.Adam)``), which issubclass would admit and which trains wrong on shards
    return ELEMENTWISE if type(optimizer) in _ELEMENTWISE else WHOLE_TENSOR


def check_shardable(optimizer: Any, stage: int) -> None:
    """The kind's check alone (no engine): one clear error if ``optimizer`` cannot run at ``stage`` with the
    default config."""
    from ...config import ZeroConfig
    from ...plan import ShardingPlan

    config = ZeroConfig(stage=stage)
    kind_of(optimizer).check(optimizer, KindSetup(ShardingPlan.of(config), config, [optimizer]))


def per_rank_state(optimizer: Any) -> tuple[str, ...]:
    """The state entries of ``optimizer`` that differ by rank (checkpoints write one row per rank)."""
    return tuple(kind_of(optimizer).per_rank_state(optimizer))
