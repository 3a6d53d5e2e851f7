"""The package's public names: each resolves, is documented, and is the object its defining module holds; the
old import paths stay as aliases."""

from __future__ import annotations

import lightning_zero


def test_package_exports():
    """Every public name resolves, is documented, and is the object its defining module holds."""
    import importlib

    assert len(set(lightning_zero.__all__)) == len(lightning_zero.__all__)
    for name in lightning_zero.__all__:
        obj = getattr(lightning_zero, name)
        if name == "__version__":
            assert isinstance(obj, str) and obj.count(".") == 2
            continue
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
        home = importlib.import_module(obj.__module__)
        assert getattr(home, obj.__qualname__.split(".")[0]) is obj, name
    # the old import paths, kept as aliases
    assert importlib.import_module("lightning_zero.strategy").ZeroStrategy is lightning_zero.ZeroStrategy
    assert importlib.import_module("lightning_zero.precision").ZeroPrecision is lightning_zero.ZeroPrecision
