"""Optimizers that do their own communication: ``OneBitAdam`` (1-bit Adam) and ``ZeroOneAdam`` (0/1 Adam).
They live in the engine (``lightning_zero.engine.optim.onebit``, no Lightning); this is their public name."""

from .engine.optim.onebit import OneBitAdam, ZeroOneAdam

__all__ = ["OneBitAdam", "ZeroOneAdam"]
