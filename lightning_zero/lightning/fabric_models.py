"""The models set up under ``ZeroFabricStrategy``: each one's module, engine and forward hook (``SetUpModel``),
the optimizers its training engine is built over, and ``fabric.no_backward_sync`` on it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

from torch.nn import Module
from torch.optim import Optimizer

from ..engine import ZeroEngine
from .compat import BackwardSyncControl


class SetUpModel:
    """A model set up under the strategy: its module, its engine (None until one is built: stages 0-2
    without an optimizer) and the forward pre-hook that prepares each forward."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.engine: Optional[ZeroEngine] = None
        self.handles: list = []

    def optimizers_with(self, optimizer: Optimizer) -> list[Optimizer]:
        """The optimizers of the training engine to build once ``optimizer`` is set up: those this model's
        engine shards already, and it. ``fabric.setup_optimizers(muon, adamw)`` hands the strategy one at a
        time, and one engine shards all of a model's optimizers (the bucket table, one global norm), so the
        engine is built again over both; only before it trained, since a new engine starts from the values
        and no optimizer state or gradient would carry over."""
        engine = self.engine
        if engine is None or engine.sharded is None:  # none yet, or stage 3's evaluation engine
            return [optimizer]
        if any(opt is optimizer for opt in engine.optimizers):
            raise ValueError(f"This {type(optimizer).__name__} is already set up. Allowed: each optimizer once.")
        if any(opt.state for opt in engine.optimizers) or any(row.dirty for row in engine.reducer.rows):
            raise RuntimeError(
                f"The {type(optimizer).__name__} joins a model whose optimizers already trained under "
                "ZeroFabricStrategy. Allowed: every optimizer of a model set up before training, together "
                "(fabric.setup(model, opt1, opt2) or fabric.setup_optimizers(opt1, opt2)); a parameter group "
                "added later goes through optimizer.add_param_group.")
        engine.restore_fp32_module()  # the next engine's masters from fp32 values (a bf16 module: the masters')
        for opt in engine.optimizers:  # the engine rebound their groups onto its masters: the parameters again
            for group, params in zip(opt.param_groups, engine.sharded_for(opt).group_params):
                group["params"] = list(params)
        return [*engine.optimizers, optimizer]


class ZeroBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: accumulate without reducing (no collective at stages 0-1;
    stage 2+ still reduces each micro-batch into its shard, as DeepSpeed does)."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        model = self._strategy._model_of(module)
        engine = model.engine if model is not None else None
        if engine is None or engine.reducer is None:
            raise TypeError("fabric.no_backward_sync(model) under ZeroFabricStrategy needs the model set up with "
                            "its optimizer: fabric.setup(model, optimizer).")
        return engine.no_sync()
