"""ZeroFabricPrecision: :class:`~lightning_zero.ZeroPrecision`'s semantics under Fabric's hook signatures.

The same plugin as the Trainer's -- the module itself in fp16/bf16, fp32 master shards in the optimizer,
fp16 loss scaling (dynamic or static), forwards under autocast with each half-precision module's inputs
cast, overflow checked on every rank and the step skipped everywhere -- only the entry points differ:
Fabric calls ``backward(tensor, module)`` on the loss and ``optimizer_step(optimizer)`` from
``optimizer.step()``, with no LightningModule or Trainer behind them.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins.precision import Precision as FabricPrecision
from torch import Tensor
from torch.nn import Module

from .precision import ZeroPrecision


class ZeroFabricPrecision(ZeroPrecision):
    """Precision for :class:`~lightning_zero.ZeroFabricStrategy`; the arguments are ``ZeroPrecision``'s.

    ``Fabric(precision="bf16-mixed")`` (or "16-mixed", "32-true") becomes one of these; pass it yourself
    for the loss-scaler options, e.g. ``Fabric(plugins=[ZeroFabricPrecision("16-mixed", loss_scale=128)])``.
    """

    # Fabric's hooks: the Trainer's versions call the LightningModule's callbacks through its trainer
    pre_backward = FabricPrecision.pre_backward
    post_backward = FabricPrecision.post_backward

    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        if self.loss_scaler is not None:
            tensor = tensor * self.loss_scaler.scale
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        """``optimizer.step()``: the engine unscales, clips, checks for overflow, steps the master shards
        and publishes the parameters (a skipped step is counted in ``skipped_steps``)."""
        if self._engine is None or self._engine.sharded is None:
            raise RuntimeError("optimizer.step() under ZeroFabricStrategy needs the optimizer set up with the "
                               "model: fabric.setup(model, optimizer) (or setup_module, then setup_optimizers).")
        closure = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(f"optimizer.step() got unsupported argument(s) {sorted(kwargs)}. Allowed: closure.")
        loss = closure() if closure is not None else None
        self._engine.step(optimizer)
        return loss

    def unscale_gradients(self, optimizer) -> None:
        """Nothing to do: the engine unscales in the step, fused with clipping (one multiply)."""

    def main_params(self, optimizer):
        """The module's parameters this optimizer updates (its param groups hold their master shards)."""
        return [p for group in self._engine.sharded_for(optimizer).group_params for p in group]
