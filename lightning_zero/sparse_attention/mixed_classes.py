"""Attention classes made by mixing a swap-in class into the model's own (``type(name, (mixin, base), ...)``).

[Note: mixed classes that pickle] A swapped T5 attention keeps its HF class as a base, so ``isinstance`` checks,
HF's own code and the state dict see the model's class. Such a class is made once per base and, for the stock
bases (transformers' ``T5Attention``, or a class made here from it), gets a fixed module-level name: pickle finds
a class by its module and name, and a spawned worker unpickles the model before anything here ran, so the
module's ``__getattr__`` builds the class on that lookup (:meth:`MixedClasses.by_name`).
"""
from __future__ import annotations

from typing import Callable, Optional


class MixedClasses:
    """The classes ``(mixin, base)`` of one module: ``stock()`` maps each stock base to its module-level name; any
    other base gets ``prefix + base.__name__``."""

    def __init__(self, mixin: type, namespace: dict, prefix: str, stock: Callable[[], dict]) -> None:
        self.mixin, self.namespace, self.prefix, self.stock = mixin, namespace, prefix, stock
        self._made: dict[type, type] = {}

    def of(self, base: type) -> type:
        """The mixed class over ``base`` (``base`` itself when it is one already)."""
        if issubclass(base, self.mixin):
            return base
        if base not in self._made:
            stock = self.stock()
            name = stock.get(base, f"{self.prefix}{base.__name__}")
            cls = type(name, (self.mixin, base), {"__module__": self.namespace["__name__"],
                                                  "__doc__": self.mixin.__doc__})
            cls.__qualname__ = name
            self._made[base] = cls
            if base in stock:
                self.namespace[name] = cls
        return self._made[base]

    def by_name(self, name: str) -> Optional[type]:
        """The stock class named ``name`` (made now), or None: the module's ``__getattr__``."""
        for base, stock_name in self.stock().items():
            if stock_name == name:
                return self.of(base)
        return None
