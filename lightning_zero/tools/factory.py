"""``pkg.mod:factory`` (the ``--module`` of ``estimate`` and ``tune``) -> what ``factory()`` returns.

The working directory is importable, as under ``python -m`` (a console script's ``sys.path`` starts at its own
``bin/`` folder, so a user's ``mypkg/models.py`` beside them would not be found otherwise); anything that does not
resolve is one ``ValueError`` naming the spec and what is allowed.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def call_factory(spec: str) -> Any:
    mod_name, _, attr = str(spec).partition(":")
    if not mod_name or not attr:
        raise ValueError(f"--module wants 'package.module:factory', got {spec!r}.")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--module {spec!r}: cannot import {mod_name!r} ({e}). Allowed: a module importable "
                         "from the working directory or the installed packages, then ':factory'.") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--module {spec!r}: {mod_name!r} has no callable {attr!r}. Allowed: a function (or "
                         "class) that takes no arguments and returns the model.")
    return factory()
