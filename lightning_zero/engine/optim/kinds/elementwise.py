"""ELEMENTWISE: each element's update depends on its own gradient and state alone, so the optimizer steps flat
master shards at any stage ([Note: optimizer kinds]). Every default of :class:`~.base.OptimizerKind` is its."""

from __future__ import annotations

from .base import Kind, OptimizerKind


class Elementwise(OptimizerKind):
    kind = Kind.ELEMENTWISE


ELEMENTWISE = Elementwise()
