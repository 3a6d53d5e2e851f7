"""What the estimator knows of a model: its parameter sizes (:class:`ModelInfo`, from a module or a T5's
dimensions) and the byte units its tables print."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch import nn

from .t5_dims import T5Dims

GiB = 2**30
MiB = 2**20


def gib(x: Optional[float]) -> str:
    """Bytes as the estimator's tables print them: GiB, or MiB with an ``M`` below 0.01 GiB."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x / GiB:.2f}" if x >= 0.01 * GiB else f"{x / MiB:.2f}M"


@dataclass
class ModelInfo:
    """Parameter sizes the estimate needs (element counts)."""

    numel: int
    trainable: int
    sizes: list[int] = field(default_factory=list)  # per parameter (padding); empty: treat as one tensor
    trainable_sizes: list[int] = field(default_factory=list)
    largest_param: int = 0
    largest_unit: int = 0  # stage 3: the biggest unit (0: unknown)
    root_unit: int = 0  # stage 3: parameters outside every unit
    last_unit: int = 0  # stage 3: the unit forward runs last (kept gathered into its backward): the last registered
    name: str = "model"
    t5: Optional[T5Dims] = None

    def padded(self, world_size: int, trainable: bool) -> int:
        sizes = self.trainable_sizes if trainable else self.sizes
        if not sizes:
            return math.ceil((self.trainable if trainable else self.numel) / world_size)
        return sum(math.ceil(n / world_size) for n in sizes)


def info_from_module(module: nn.Module, unit_classes: Optional[Sequence] = None, unit_mb: Optional[float] = None,
                     name: Optional[str] = None) -> ModelInfo:
    """Sizes of a module (a meta-device module works: nothing is allocated); units as the engine's default
    policy chooses them (``unit_classes`` / ``unit_mb`` override, as in ZeroConfig)."""
    from ..engine.stage3.units import build_units

    params = list(module.parameters())
    sizes = [p.numel() for p in params]
    train = [p.numel() for p in params if p.requires_grad]
    units = build_units(module, 1, 0, unit_classes, max(1, int(unit_mb * MiB)) if unit_mb is not None else None)
    numels = [sum(p.numel() for p in u.params) for u in units]
    return ModelInfo(sum(sizes), sum(train), sizes, train, max(sizes, default=0), max(numels[:-1], default=0),
                     numels[-1], numels[-2] if len(numels) > 1 else 0, name or type(module).__name__)


def info_from_t5(dims: T5Dims) -> ModelInfo:
    blocks = [dims.block_numel(False, i == 0) for i in range(dims.num_layers)]
    blocks += [dims.block_numel(True, i == 0) for i in range(dims.dec_layers)]
    emb = dims.vocab_size * dims.d_model
    return ModelInfo(dims.numel, dims.numel, largest_param=max(emb, dims.d_model * dims.d_ff),
                     largest_unit=max(blocks), root_unit=dims.root_numel, last_unit=blocks[-1], name=dims.name,
                     t5=dims)
