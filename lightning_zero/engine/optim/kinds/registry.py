"""Which kind each optimizer is ([Note: optimizer kinds]): the one table ``kind_of`` reads."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..owner_step import newton_schulz_cost, numel_cost
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
# declared whole-tensor, with the owner balance's cost of a parameter's step where it is not its numel
_WHOLE_TENSOR: dict[type, Callable[[tuple], int]] = {torch.optim.Muon: newton_schulz_cost}
_FAMILIES: dict[type, OptimizerKind] = {}  # base class -> kind, matched by isinstance (communicating families)

WHOLE_TENSOR = WholeTensor(lambda: _WHOLE_TENSOR)


def register_shardable_optimizer(cls: type) -> type:
    """Declare a custom optimizer class elementwise, hence safe to run on shards. Usable as decorator."""
    _WHOLE_TENSOR.pop(cls, None)
    _ELEMENTWISE.add(cls)
    return cls


def register_whole_tensor_optimizer(cls: Optional[type] = None, *, cost: Optional[Callable[[tuple], int]] = None):
    """Declare a custom optimizer class whole-tensor (its update reads whole tensors): stage 0 steps it on
    whole parameters, stages 1-3 on each parameter's owner rank ([Note: owner-rank step]). ``cost(shape)``:
    what one parameter's step costs, which the owners balance (default: its numel). Any class that is not
    declared elementwise is whole-tensor already; declaring it names its cost. Usable as decorator, with or
    without ``cost``."""
    def declare(c: type) -> type:
        _ELEMENTWISE.discard(c)
        if cost is not None or c not in _WHOLE_TENSOR:
            _WHOLE_TENSOR[c] = cost if cost is not None else numel_cost
        return c

    return declare(cls) if cls is not None else declare


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
