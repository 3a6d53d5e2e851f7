"""Moved to ``lightning_zero.lightning.strategy``; this module keeps the old import path working."""

from .lightning.strategy import ZeroStrategy  # noqa: F401
