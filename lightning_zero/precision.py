"""Moved to ``lightning_zero.lightning.precision``; this module keeps the old import path working."""

from .lightning.precision import ZeroPrecision  # noqa: F401
