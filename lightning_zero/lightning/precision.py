"""ZeroPrecision: Lightning's precision plugin for ZeRO (fp32, fp16 + dynamic loss scaling, bf16).

Unlike Lightning's AMP plugin (autocast over fp32 weights), ZeRO keeps the module itself in the compute
dtype and the fp32 master copy only in the optimizer shards, which is where the memory saving comes
from. A forward written for fp32 weights under AMP must still run: a tensor the model makes itself in
fp32 (a positional encoding kept as a plain attribute, a mask) would meet half-precision weights. So the
forward runs under autocast (matmuls and convolutions cast their operands), and each module that owns
half-precision parameters gets its floating inputs in that dtype (what FSDP's ``cast_forward_inputs``
does per unit): CPU autocast leaves e.g. ``layer_norm`` alone, and an fp32 residual stream would reach
a bf16 LayerNorm.

The plugin also owns the things that touch the step: it scales the loss before backward, routes
Lightning's clipping to the engine's *global* norm (Lightning's own would see only this rank's
shard), and hands the step to the engine, which unscales, clips, checks for overflow on every rank and
skips the step everywhere when one rank overflowed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer

from ..engine import DynamicLossScaler, StaticLossScaler
from ..engine.engine_state import EngineMode, StepCounters
from .optimizers import raw_optimizer

_ALIASES = {
    "32-true": "32-true", "32": "32-true", 32: "32-true",
    "16-mixed": "16-mixed", "16": "16-mixed", 16: "16-mixed",
    "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
}
_DTYPE = {"32-true": torch.float32, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class ZeroPrecision(Precision):
    """Precision for :class:`~lightning_zero.ZeroStrategy`.

    Args:
        precision: "32-true", "16-mixed" or "bf16-mixed" (Lightning's aliases 32/16/"bf16" accepted).
        loss_scale: fp16 only. ``None``/0 = dynamic scaling; a positive number = static scale.
        initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale,
            raise_at_min_scale: the dynamic scaler (DeepSpeed's defaults: 2**16, 1000, 2, False, 1, True).
        check_finite: skip steps whose gradients are non-finite on any rank (always on for fp16;
            default on for bf16; off for fp32, where it would cost an extra pass for nothing).
    """

    def __init__(
        self,
        precision: Union[str, int] = "32-true",
        loss_scale: Optional[float] = None,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        raise_at_min_scale: bool = True,
        check_finite: Optional[bool] = None,
    ) -> None:
        if precision not in _ALIASES:
            raise ValueError(
                f"ZeroPrecision does not support precision={precision!r}. "
                "Allowed: '32-true', '16-mixed', 'bf16-mixed' (aliases 32, 16, 'bf16')."
            )
        self.precision = _ALIASES[precision]
        self.compute_dtype = _DTYPE[self.precision]
        self._scaler_args = dict(
            init_scale=2.0**initial_scale_power, scale_window=loss_scale_window, hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis, min_scale=min_loss_scale,
            raise_at_min_scale=raise_at_min_scale,
        )
        self._static_scale = loss_scale if loss_scale else None
        self.check_finite = (self.precision != "32-true") if check_finite is None else bool(check_finite)
        self.loss_scaler = self._make_scaler()
        # the one count of skipped steps, for the plugin's whole life (it outlives each fit's engine): the
        # scaler's own when there is one, handed to every training engine attached (engine_state.py)
        self.counters = self.loss_scaler.counters if self.loss_scaler is not None else StepCounters()
        self._engine = None  # attached by the strategy once the optimizer is sharded
        # overlap_publish with weight-reading hooks: wait for the all-gathers at the end of each step
        self.ensure_published_after_step = False
        self._cast_hooks: list = []

    def _make_scaler(self):
        if self.precision != "16-mixed":
            return None
        if self._static_scale is not None:
            return StaticLossScaler(self._static_scale)
        return DynamicLossScaler(**self._scaler_args)

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != torch.float32

    def attach(self, engine, device_type: str = "cpu") -> None:
        self._engine = engine
        self.device_type = device_type
        for handle in self._cast_hooks:
            handle.remove()
        self._cast_hooks = []
        if _training(engine) and self.mixed:  # training: the module itself is fp16/bf16
            self._cast_hooks = _cast_inputs_to_param_dtype(engine.module)
        if _training(engine):  # restored before the engine existed, or carried on from an earlier fit
            engine.counters = self.counters  # the same object (already so when the scaler brought it)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Every forward runs under autocast in the compute dtype. Training: on the fp16/bf16 module itself
        (autocast only casts what the model creates in fp32). Evaluation without an optimizer (validate/
        test/predict on their own) keeps the user's fp32 weights, so evaluating never rounds them."""
        if self.mixed:
            with torch.autocast(getattr(self, "device_type", "cpu"), dtype=self.compute_dtype):
                yield
        else:
            yield

    # -- forward -------------------------------------------------------------------------------
    def convert_input(self, data: Any) -> Any:
        if not self.mixed:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

    def convert_output(self, data: Any) -> Any:
        # losses and metrics leave the plugin in fp32 so logging and reductions stay exact
        if not self.mixed:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.float() if t.is_floating_point() else t)

    # -- backward / step -------------------------------------------------------------------------
    def backward(self, tensor: Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        if self.loss_scaler is not None:
            tensor = tensor * self.loss_scaler.scale
        model.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)
        if self._engine is None:
            raise RuntimeError("ZeroPrecision is not attached to a ZeroStrategy engine; use it with ZeroStrategy.")
        optimizer = raw_optimizer(optimizer)
        if closure_result is None and getattr(model, "automatic_optimization", True):
            self._engine.zero_grad(optimizer)  # training_step returned None: skip this step, drop its gradients
            return None
        self._engine.step(optimizer)
        if self.ensure_published_after_step:  # hooks that read weights run next (engine_side.py, _publish_before_hooks)
            self._engine.ensure_published()
        if self.mixed and hasattr(model, "log"):
            if self.loss_scaler is not None:
                model.log("loss_scale", float(self.loss_scaler.scale), prog_bar=True, sync_dist=False)
            model.log("skipped_steps", float(self.skipped_steps), prog_bar=self.loss_scaler is not None)
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self._engine.clip_grad_norm_(clip_val, raw_optimizer(optimizer))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self._engine.clip_grad_value_(clip_val, raw_optimizer(optimizer))

    # -- scaler state in checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        if self.check_finite:  # steps skipped for non-finite gradients (self.counters; bf16 has no scaler)
            state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is not None and "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        if "skipped_steps" in state_dict:
            self.counters.skipped_steps = int(state_dict["skipped_steps"])

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.scale) if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped_steps


def _training(engine) -> bool:
    return engine is not None and engine.mode is EngineMode.TRAIN


def _cast_inputs_to_param_dtype(module: torch.nn.Module) -> list:
    """Forward pre-hooks: floating inputs of a module that owns fp16/bf16 parameters arrive in that dtype.

    The dtype is read at call time, so once the module is handed back in fp32 the hooks change nothing."""
    from torch.utils._pytree import tree_map

    def hook(mod, args, kwargs):
        dtype = next((p.dtype for p in mod.parameters(recurse=False) if p.is_floating_point()), None)
        if dtype not in (torch.float16, torch.bfloat16):
            return None
        cast = lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype else t
        return tree_map(cast, args), tree_map(cast, kwargs)

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in module.modules()
            if any(p.is_floating_point() for p in m.parameters(recurse=False))]
