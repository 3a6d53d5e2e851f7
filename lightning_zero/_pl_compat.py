"""The same strategy and precision plugin for the ``pytorch_lightning`` distribution.

``lightning.pytorch`` and ``pytorch_lightning`` are two copies of one code base with separate class
hierarchies and registries: a strategy built on one is rejected by the other's Trainer. Rather than
maintain two copies, the adapter modules are loaded a second time with their imports pointed at
``pytorch_lightning`` (the way Lightning itself generates ``pytorch_lightning`` from ``lightning``).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

_HERE = Path(__file__).parent


def _load_variant(name: str, source_name: str, extra: dict[str, str]) -> types.ModuleType:
    text = (_HERE / source_name).read_text()
    text = text.replace("lightning.pytorch", "pytorch_lightning")
    for old, new in extra.items():
        text = text.replace(old, new)
    module = types.ModuleType(f"lightning_zero.{name}")
    module.__package__ = "lightning_zero"
    module.__file__ = str(_HERE / source_name)
    sys.modules[module.__name__] = module
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module


def register_pytorch_lightning() -> bool:
    """Register zero* names in ``pytorch_lightning``'s registry when that distribution is installed."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return False
    from pytorch_lightning.strategies import StrategyRegistry

    _load_variant("_pl_precision", "precision.py", {})  # imported by the strategy variant below
    strategy = _load_variant("_pl_strategy", "strategy.py", {"from .precision import": "from ._pl_precision import"})
    strategy.ZeroStrategy.register_strategies(StrategyRegistry)
    return True
