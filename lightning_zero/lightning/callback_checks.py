"""Callbacks that read or write the module's parameters outside the training step: which ZeRO supports.

ZeRO keeps the training values in fp32 master shards; the module holds a copy (stages 0-2, in the
compute dtype) or, under stage 3, partitioned parameters that are whole only inside a unit's forward
or ``strategy.gathered_params()``. A callback that averages ``pl_module.parameters()`` between steps
therefore sees nothing under stage 3 (Lightning's SWA silently did nothing), sees rounded copies in
mixed precision (and its result is overwritten by the masters at the end of fit), and Lightning's
``WeightAveraging`` also replaces the checkpoint's ``state_dict`` with whole tensors, which a sharded
checkpoint cannot hold. What works equals DDP (tests/test_lifecycle.py); the rest is refused at setup,
as Lightning refuses SWA for DeepSpeed and FSDP.
"""

from __future__ import annotations

from typing import Any

import torch

_GATHER_HINT = ("Code of your own that reads parameters in a hook under stage 3 must do so inside "
                "`with trainer.strategy.gathered_params():`.")


def check_callbacks(callbacks: list[Any], plan: Any, compute_dtype: torch.dtype, checkpoint_format: str) -> None:
    """Raise one clear error for the first weight-averaging callback ZeroStrategy cannot run exactly."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    try:  # Lightning >= 2.6
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # pragma: no cover - older Lightning
        WeightAveraging = ()
    mixed = compute_dtype not in (None, torch.float32)
    for cb in callbacks:
        name = type(cb).__name__
        if isinstance(cb, StochasticWeightAveraging) or (WeightAveraging and isinstance(cb, WeightAveraging)):
            reason = None
            if plan.shards_params:
                reason = f"stage {plan.stage} partitions the parameters, so the callback would average empty tensors"
            elif mixed:
                reason = ("in mixed precision the module holds rounded copies of the fp32 master weights, and "
                          "the masters replace the module's values at the end of fit")
            elif not isinstance(cb, StochasticWeightAveraging) and checkpoint_format != "full":
                reason = ("it replaces the checkpoint's state_dict with whole tensors, which a sharded "
                          "checkpoint directory cannot hold")
            if reason is not None:
                raise ValueError(
                    f"{name} is not supported by ZeroStrategy(stage={plan.stage}) here: {reason}. Supported: "
                    "StochasticWeightAveraging at stages 0-2 with precision='32-true'; WeightAveraging/"
                    "EMAWeightAveraging at stages 0-2 with precision='32-true' and checkpoint_format='full'. "
                    + _GATHER_HINT
                )


# Hooks of a LightningModule that run between an optimizer step and the next forward: where an overlapped
# publish (overlap_publish) has not yet written the other ranks' slices into the parameters.
_WINDOW_HOOKS = ("on_train_batch_end", "on_train_batch_start", "on_train_epoch_end", "on_train_epoch_start",
                 "on_before_batch_transfer", "on_after_batch_transfer", "on_validation_start",
                 "on_validation_epoch_start", "on_validation_model_eval", "on_validation_model_train")


def weight_readers(callbacks: list[Any], pl_module: Any) -> list[str]:
    """What may read the module's parameters while an overlapped publish is still in flight: every callback
    outside Lightning's own bookkeeping ones (progress bars, checkpointing -- which reads through
    ``state_dict``, and so waits -- summaries, timers, LR monitors, early stopping), and the module's own
    overrides of the hooks that run between a step and the next forward."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch import callbacks as C

    safe = tuple(getattr(C, n) for n in ("ProgressBar", "ModelCheckpoint", "ModelSummary", "Timer", "LearningRateMonitor",
                                         "EarlyStopping", "DeviceStatsMonitor", "ThroughputMonitor")
                 if hasattr(C, n))
    names = [type(cb).__name__ for cb in callbacks if not isinstance(cb, safe)]
    names += [f"{type(pl_module).__name__}.{h}" for h in _WINDOW_HOOKS
              if getattr(type(pl_module), h, None) is not getattr(LightningModule, h, None)]
    return names


_FINDER_HINT = ("under ZeroStrategy use lightning_zero.ZeroBatchSizeFinder(max_bytes=..., mode='binsearch', "
                "steps_per_trial=3, init_val=2, max_trials=25) as a Trainer callback, or `lightning-zero tune "
                "--module pkg.mod:factory --memory-mb M` (docs/tuning.md)")


def lightning_finder_refusal(entry: str) -> str:
    return (f"{entry} refuses distributed strategies, and ZeroStrategy is one (a DDPStrategy, also at devices=1); "
            f"{_FINDER_HINT}.")


def check_no_lightning_finder(callbacks: list[Any]) -> None:
    """Lightning's BatchSizeFinder among the callbacks: our error, raised where the strategy sets up its
    environment -- before the callbacks' ``setup``, where Lightning's finder raises its own."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    if any(isinstance(cb, BatchSizeFinder) for cb in callbacks):
        raise ValueError(lightning_finder_refusal("Lightning's BatchSizeFinder"))
