"""Loss scalers for fp16 mixed-precision training.

Design note:
- The dynamic scaler reproduces DeepSpeed's ``DynamicLossScaler.update_scale``
  (deepspeed/runtime/fp16/loss_scaler.py) step for step, including hysteresis
  and the ``(cur_iter - last_overflow_iter) % scale_window`` growth rule, so
  configs and scale trajectories carry over from DeepSpeed unchanged.
- The scaler never inspects gradients and never talks to other ranks. With
  ZeRO each rank holds only a shard of the gradients, so only the caller can
  know whether *any* rank overflowed; it all-reduces that flag and passes it
  to ``update``. Because every rank then feeds the identical flag into an
  identical state machine, all ranks skip the same steps and keep the same
  scale without further communication.
- Pure Python, no Lightning or torch.distributed imports, so it is trivially
  unit-testable and checkpointable through ``state_dict``.
- A scaler decides which steps are skipped, so it records them, in its
  ``counters`` (:class:`~.engine_state.StepCounters`): the one count of
  skipped steps, shared with the engine that uses the scaler (``skipped_steps``
  is a view of it).
"""

from __future__ import annotations

from typing import Any, Dict

from ..engine_state import StepCounters


class LossScalerError(RuntimeError):
    """Raised when gradients keep overflowing although the scale is at its minimum."""


class _RecordsSkips:
    counters: StepCounters

    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.counters.skipped_steps = int(value)


class DynamicLossScaler(_RecordsSkips):
    """fp16 dynamic loss scaling with DeepSpeed's semantics: start at ``init_scale`` (2^16), halve on an
    overflow once ``hysteresis`` overflows have been absorbed, double after ``scale_window`` clean steps, never
    below ``min_scale`` (``raise_at_min_scale``: an overflow there raises :class:`LossScalerError`)."""

    dynamic = True

    _CONFIG_KEYS = (
        "init_scale", "scale_window", "hysteresis", "consecutive_hysteresis",
        "min_scale", "scale_factor", "raise_at_min_scale",
    )
    _STATE_KEYS = ("scale", "cur_hysteresis", "last_overflow_iter", "cur_iter", "skipped_steps")

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        scale_factor: float = 2.0,
        raise_at_min_scale: bool = True,
    ) -> None:
        self._validate(init_scale, scale_window, hysteresis, min_scale, scale_factor)
        self.init_scale = float(init_scale)
        self.scale_window = int(scale_window)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self.scale_factor = float(scale_factor)
        self.raise_at_min_scale = bool(raise_at_min_scale)

        self.scale = self.init_scale
        self.cur_hysteresis = self.hysteresis
        # -1 (as in DeepSpeed) makes the first growth happen after exactly
        # `scale_window` clean steps rather than at step 0.
        self.last_overflow_iter = -1
        self.cur_iter = 0
        self.counters = StepCounters()

    @staticmethod
    def _validate(init_scale, scale_window, hysteresis, min_scale, scale_factor) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if not min_scale > 0:
            raise ValueError(f"min_scale must be > 0, got {min_scale}")
        if init_scale < min_scale:
            raise ValueError(f"init_scale ({init_scale}) must be >= min_scale ({min_scale})")
        if scale_window < 1:
            raise ValueError(f"scale_window must be >= 1, got {scale_window}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        if not scale_factor > 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")

    def update(self, overflow: bool) -> bool:
        """Advance one optimizer step; return True if the step must be skipped.

        ``overflow`` must already be reduced across all ranks (see module note).
        """
        overflow = bool(overflow)
        if overflow:
            if self.cur_hysteresis == 1:
                if self.scale == self.min_scale and self.raise_at_min_scale:
                    # Shrinking further is impossible, so skipping would loop forever.
                    raise LossScalerError(
                        f"fp16 loss scale is at its minimum ({self.min_scale}) and gradients keep "
                        "overflowing. Consider training in bf16, lowering the learning rate, or "
                        "setting raise_at_min_scale=False to keep skipping steps at the minimum scale."
                    )
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                # Tolerate isolated overflows (e.g. a single bad batch) without
                # giving up scale that took many windows to earn.
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
            self.counters.record(True)
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self.cur_iter += 1
        return overflow

    def state_dict(self) -> Dict[str, Any]:
        state = {k: getattr(self, k) for k in self._STATE_KEYS + self._CONFIG_KEYS}
        state["dynamic"] = True
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state.get("dynamic", True):
            raise ValueError("cannot load a StaticLossScaler state into a DynamicLossScaler")
        missing = [k for k in self._STATE_KEYS + self._CONFIG_KEYS if k not in state]
        if missing:
            raise ValueError(f"loss scaler state_dict is missing keys: {missing}")
        # Validate before assigning so a bad checkpoint leaves the scaler untouched.
        self._validate(state["init_scale"], state["scale_window"], state["hysteresis"],
                       state["min_scale"], state["scale_factor"])
        # Config is restored too: resuming must continue the exact trajectory
        # even if the new run was constructed with different defaults.
        for k in ("init_scale", "min_scale", "scale_factor", "scale"):
            setattr(self, k, float(state[k]))
        for k in ("scale_window", "hysteresis", "cur_hysteresis", "last_overflow_iter",
                  "cur_iter", "skipped_steps"):
            setattr(self, k, int(state[k]))
        self.consecutive_hysteresis = bool(state["consecutive_hysteresis"])
        self.raise_at_min_scale = bool(state["raise_at_min_scale"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale}, cur_hysteresis={self.cur_hysteresis}, "
                f"cur_iter={self.cur_iter}, skipped_steps={self.skipped_steps})")


class StaticLossScaler(_RecordsSkips):
    """A fixed loss scale (DeepSpeed's ``fp16.loss_scale`` > 0): a step whose gradients overflow is skipped and
    counted, the scale never changes."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.counters = StepCounters()

    def update(self, overflow: bool) -> bool:
        """Return True (skip) on overflow; a fixed scale is never adjusted and never raises."""
        return self.counters.record(bool(overflow))

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "skipped_steps": self.skipped_steps, "dynamic": False}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("dynamic", False):
            raise ValueError("cannot load a DynamicLossScaler state into a StaticLossScaler")
        if not state["scale"] > 0:
            raise ValueError(f"scale must be > 0, got {state['scale']}")
        self.scale = float(state["scale"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self.scale}, skipped_steps={self.skipped_steps})"
