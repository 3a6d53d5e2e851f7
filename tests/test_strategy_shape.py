"""The strategies' shape: the pipeline strategy shares ZeroStrategy's hooks through its model side instead of
overriding them (it overrode 20 of ZeroStrategy's methods), and the two model sides answer the same hooks."""

import inspect
import re

from lightning_zero.lightning.engine_side import EngineSide
from lightning_zero.lightning.pipeline_side import PipelineSide
from lightning_zero.lightning.pipeline_strategy import ZeroPipelineStrategy
from lightning_zero.lightning.strategy import ZeroStrategy

MAX_OVERRIDES = 8


def _overrides(cls: type, base: type) -> list[str]:
    """The methods and properties ``cls`` defines itself that ``base`` or one of its bases also has."""
    return sorted(name for name, value in vars(cls).items()
                  if (inspect.isfunction(value) or isinstance(value, (property, classmethod, staticmethod)))
                  and hasattr(base, name))


def _methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if not name.startswith("_") and callable(value)}


def test_the_pipeline_strategy_overrides_at_most_eight_of_zero_strategys_methods():
    overrides = _overrides(ZeroPipelineStrategy, ZeroStrategy)
    assert len(overrides) <= MAX_OVERRIDES, overrides
    assert issubclass(ZeroPipelineStrategy, ZeroStrategy)  # isinstance checks of ZeroStrategy still hold


def test_the_count_sees_an_override():
    """The counter itself: a subclass redefining a hook (or a property) is counted, a new method is not."""

    class Probe(ZeroPipelineStrategy):
        def setup(self, trainer):
            pass

        @property
        def restore_checkpoint_after_setup(self):
            return True

        def something_new(self):
            pass

    assert _overrides(Probe, ZeroPipelineStrategy) == ["restore_checkpoint_after_setup", "setup"]


def test_both_model_sides_answer_the_same_hooks():
    """ZeroStrategy hands these hooks to ``self.model_side``: a hook added to one side only would be an
    AttributeError in the other strategy's fit."""
    assert _methods(EngineSide) == _methods(PipelineSide)
    called = set(re.findall(r"self\.model_side\.(\w+)\(", inspect.getsource(ZeroStrategy)))
    assert len(called) >= 15 and called <= _methods(EngineSide), called - _methods(EngineSide)


def test_the_strategy_modules_stay_under_400_lines():
    """One concept per file: strategy.py grew past 400 lines with the model side inside it."""
    import lightning_zero.lightning.engine_side as engine_side
    import lightning_zero.lightning.pipeline_side as pipeline_side
    import lightning_zero.lightning.pipeline_strategy as pipeline_strategy
    import lightning_zero.lightning.strategy as strategy

    for module in (strategy, engine_side, pipeline_strategy, pipeline_side):
        with open(module.__file__) as f:
            assert len(f.readlines()) < 400, module.__name__
