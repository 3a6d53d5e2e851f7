"""What the tuner needs from a training recipe, and how it finds one.

The tuner measures the model, strategy fields and precision a recipe would run, but knows no recipe:
it asks a :class:`TuneRecipe` (any module or object with these three functions) and nothing in the
package imports ``examples/``. ``lightning-zero tune --recipe`` names one; the default is the T5
recipe file that sits next to the Hydra config directory (``examples/t5_config.py`` beside ``conf/``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Protocol, Union, runtime_checkable


@runtime_checkable
class TuneRecipe(Protocol):
    def validate_schema(self, cfg: Any) -> None:
        """Raise on a composed config the recipe would refuse."""

    def strategy_kwargs(self, cfg: Any) -> dict:
        """``ZeroStrategy`` keyword arguments of a composed config."""

    def tune_model_config(self, cfg: Any) -> Any:
        """The ``transformers`` model config the recipe would train (vocabulary from its tokenizer)."""


def default_recipe_path(config_dir: Path) -> Path:
    return Path(os.environ.get("LIGHTNING_ZERO_EXAMPLES") or config_dir.parent / "examples") / "t5_config.py"


def load_recipe(recipe: Union[str, os.PathLike, Any, None], config_dir: Path) -> TuneRecipe:
    """``recipe``: an object with the :class:`TuneRecipe` functions, an importable module name, a ``.py``
    file (its folder joins ``sys.path``: recipe files import their siblings by bare name), or None for
    :func:`default_recipe_path`."""
    if recipe is None or str(recipe).endswith(".py"):
        path = Path(recipe) if recipe is not None else default_recipe_path(config_dir)
        if not path.is_file():
            raise FileNotFoundError(f"Recipe {path} not found (next to {config_dir}); pass --recipe path/to/recipe.py "
                                    "or set LIGHTNING_ZERO_EXAMPLES.")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        recipe = path.stem
    if isinstance(recipe, str):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        recipe = importlib.import_module(recipe)
    if not isinstance(recipe, TuneRecipe):
        missing = [n for n in ("validate_schema", "strategy_kwargs", "tune_model_config") if not hasattr(recipe, n)]
        raise TypeError(f"{recipe!r} is not a tuning recipe: it lacks {', '.join(missing)} "
                        "(see lightning_zero.tools.tuning.recipe.TuneRecipe).")
    return recipe
