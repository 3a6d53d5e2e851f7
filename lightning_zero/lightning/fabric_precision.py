"""ZeroFabricPrecision: :class:`~lightning_zero.ZeroPrecision`'s semantics under Fabric's hook signatures.

The same plugin as the Trainer's -- the module itself in fp16/bf16, fp32 master shards in the optimizer,
fp16 loss scaling (dynamic or static), forwards under autocast with each half-precision module's inputs
cast, overflow checked on every rank and the step skipped everywhere -- only the entry points differ:
Fabric calls ``backward(tensor, module)`` on the loss and ``optimizer_step(optimizer)`` from
``optimizer.step()``, with no LightningModule or Trainer behind them.

Fabric sets up several models (a GAN's generator and discriminator, a student and its frozen teacher),
each with its own engine, so the plugin holds every engine attached (the Trainer's one ``_engine`` is
the last of them): ``optimizer.step()`` goes to the engine that shards that optimizer, each training
module gets its own input casts, and every training engine shares the plugin's one loss scaler and
skip count -- one scaler for all optimizers, as Fabric's own ``MixedPrecision`` keeps one ``GradScaler``
and updates it at every ``optimizer.step()``.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins.precision import Precision as FabricPrecision
from torch import Tensor
from torch.nn import Module

from .compat import fabric_optimizer
from .precision import ZeroPrecision, _cast_inputs_to_param_dtype, _training


class ZeroFabricPrecision(ZeroPrecision):
    """Precision for :class:`~lightning_zero.ZeroFabricStrategy`; the arguments are ``ZeroPrecision``'s.

    ``Fabric(precision="bf16-mixed")`` (or "16-mixed", "32-true") becomes one of these; pass it yourself
    for the loss-scaler options, e.g. ``Fabric(plugins=[ZeroFabricPrecision("16-mixed", loss_scale=128)])``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._engines: dict[int, tuple[Any, list]] = {}  # id(engine) -> (engine, its input-cast hooks)

    # Fabric's hooks: the Trainer's versions call the LightningModule's callbacks through its trainer
    pre_backward = FabricPrecision.pre_backward
    post_backward = FabricPrecision.post_backward

    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        if self.loss_scaler is not None:
            tensor = tensor * self.loss_scaler.scale
        tensor.backward(*args, **kwargs)

    # -- several engines (one per model set up) ------------------------------------------------------
    def attach(self, engine, device_type: str = "cpu") -> None:
        """Add ``engine`` to the engines this plugin serves; ``None`` detaches all of them (teardown)."""
        if engine is None:
            for e in [e for e, _ in self._engines.values()]:
                self.detach(e)
            self._engine = None
            return
        self.detach(engine)
        self.device_type = device_type
        hooks = _cast_inputs_to_param_dtype(engine.module) if _training(engine) and self.mixed else []
        if _training(engine):  # restored before the engine existed, or carried on from an earlier setup
            engine.counters = self.counters
        self._engines[id(engine)] = (engine, hooks)
        self._engine = engine

    def detach(self, engine) -> None:
        """Forget ``engine`` (its model is set up again, or torn down) and remove its input casts."""
        engine_hooks = self._engines.pop(id(engine), None)
        for handle in engine_hooks[1] if engine_hooks is not None else []:
            handle.remove()
        if self._engine is engine:
            rest = list(self._engines.values())
            self._engine = rest[-1][0] if rest else None

    def engine_for(self, optimizer):
        """The attached training engine that shards ``optimizer`` (Fabric's wrapper unwrapped), or None."""
        optimizer = fabric_optimizer(optimizer)
        for engine, _ in self._engines.values():
            if _training(engine) and any(s.optimizer is optimizer for s in engine.shardeds):
                return engine
        return None

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        """``optimizer.step()``: the engine that shards this optimizer unscales, clips, checks for overflow,
        steps the master shards and publishes the parameters (a skipped step is counted in ``skipped_steps``)."""
        engine = self.engine_for(optimizer)
        if engine is None:
            raise RuntimeError("optimizer.step() under ZeroFabricStrategy needs the optimizer set up with its "
                               "model: fabric.setup(model, optimizer) (or setup_module, then setup_optimizers).")
        closure = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(f"optimizer.step() got unsupported argument(s) {sorted(kwargs)}. Allowed: closure.")
        loss = closure() if closure is not None else None
        engine.step(optimizer)
        return loss

    def unscale_gradients(self, optimizer) -> None:
        """Nothing to do: the engine unscales in the step, fused with clipping (one multiply)."""

    def main_params(self, optimizer):
        """The module's parameters this optimizer updates (its param groups hold their master shards)."""
        engine = self.engine_for(optimizer)
        if engine is None:
            raise ValueError(f"{type(optimizer).__name__} is not an optimizer set up under this Fabric. "
                             "Allowed: the optimizers returned by fabric.setup(model, optimizer, ...).")
        return [p for group in engine.sharded_for(fabric_optimizer(optimizer)).group_params
                for p in group]
