"""The Lightning adapter: the only part of lightning_zero that imports Lightning.

``strategy.py`` (the Trainer strategy) + ``engine_side.py`` (its model side) + ``checkpoint_strategy.py`` (what
its checkpoint hooks write) + ``precision.py`` (the precision plugin) drive the engine; ``optimizers.py`` binds Lightning's optimizers to it,
``callback_checks.py`` refuses callbacks that cannot see sharded state, ``lightning_io.py`` lets
``load_from_checkpoint`` read the checkpoint directories and ``checkpoint_io.py`` (``ZeroCheckpointIO``) the
other strategies. Only the ``lightning`` distribution is supported (not the
separate ``pytorch_lightning`` copy). ``fabric_strategy.py`` + ``fabric_checkpoint.py`` +
``fabric_precision.py`` are the same engine under Fabric; ``zero_setup.py`` is what both strategies build
alike (the engine, the precision plugin, the registered names).
"""

import lightning  # noqa: F401  first: its import registers the names (lightning_zero/__init__.py) before any
# adapter module below starts, so none is half-initialized when the registration imports them all

from .precision import ZeroPrecision
from .strategy import ZeroStrategy

__all__ = ["ZeroPrecision", "ZeroStrategy"]
