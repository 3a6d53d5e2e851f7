"""The same strategy and precision plugin for the ``pytorch_lightning`` distribution.

``strategy.py`` and ``precision.py`` name Lightning only through ``_distribution.lightning_import``, so
importing the two files again under ``building_on("pytorch_lightning")`` gives classes whose bases are
``pytorch_lightning``'s own (what its Trainer and registry accept), with one source for both.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

from ._distribution import PYTORCH_LIGHTNING, building_on

_HERE = Path(__file__).parent


def _import_variant(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"{__package__}._pl_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    with building_on(PYTORCH_LIGHTNING):
        spec.loader.exec_module(module)
    return module


def register_pytorch_lightning() -> bool:
    """Register zero* names in ``pytorch_lightning``'s registry when that distribution is installed."""
    if importlib.util.find_spec(PYTORCH_LIGHTNING) is None:
        return False
    from pytorch_lightning.strategies import StrategyRegistry

    _import_variant("precision")  # the strategy variant below takes its ZeroPrecision from here
    _import_variant("strategy").ZeroStrategy.register_strategies(StrategyRegistry)
    return True
