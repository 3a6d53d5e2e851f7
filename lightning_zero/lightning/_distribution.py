"""Which Lightning distribution an adapter module builds on: ``lightning.pytorch`` or ``pytorch_lightning``.

The two are copies of one code base with separate class hierarchies and registries, so a strategy built
on one is rejected by the other's Trainer. ``strategy.py`` and ``precision.py`` take every Lightning name
through :func:`lightning_import` and their sibling through :func:`sibling`; ``_pl_compat.py`` imports the
same two files a second time, as ordinary modules, inside ``building_on("pytorch_lightning")``.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Iterator

LIGHTNING, PYTORCH_LIGHTNING = "lightning.pytorch", "pytorch_lightning"
_root = LIGHTNING
_PREFIX = {LIGHTNING: "", PYTORCH_LIGHTNING: "_pl_"}  # module name prefix of each variant


@contextlib.contextmanager
def building_on(root: str) -> Iterator[None]:
    global _root
    if root not in _PREFIX:
        raise ValueError(f"Unknown Lightning distribution {root!r}. Allowed: {', '.join(_PREFIX)}.")
    previous, _root = _root, root
    try:
        yield
    finally:
        _root = previous


def root() -> str:
    """The distribution the module being imported right now builds on."""
    return _root


def lightning_import(submodule: str, *names: str) -> Any:
    """``from <root>.<submodule> import names`` for the distribution being built on."""
    module = importlib.import_module(f"{_root}.{submodule}")
    values = tuple(getattr(module, n) for n in names)
    return values[0] if len(values) == 1 else values


def sibling(name: str) -> Any:
    """The adapter module ``name`` of the same variant (``precision`` for ``strategy``)."""
    full = f"{__package__}.{_PREFIX[_root]}{name}"
    if full not in sys.modules and _root == LIGHTNING:
        importlib.import_module(full)
    return sys.modules[full]
