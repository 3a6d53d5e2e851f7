"""The T5 recipe's optimizer choice (``optim.name``): AdamW, or lightning_zero's communication-compressed Adams
(1-bit Adam, 0/1 Adam; docs/onebit_adam.md), built over the module's weight-decay param groups.

Design note: the compressed Adams compose with fewer strategies than AdamW (1-bit Adam: stages 0-1; 0/1 Adam:
stage 0; neither with fp16 loss scaling or tensor parallelism). The engine refuses the rest when a fit sets it
up, inside every launched rank; :func:`check_optimizer` asks the engine's own check
(``engine/optim/onebit/kind.check_composes``) before any process starts, so the recipe stops with one config error
carrying the engine's message (what is allowed) instead of a traceback per rank.
"""
from __future__ import annotations

from typing import Any

import torch

OPTIMIZERS = ("adamw", "onebit_adam", "zeroone_adam")  # optim.name


def make_optimizer(groups: Any, lr: float, total_steps: int, optimizer: str = "adamw",
                   freeze_step: int | None = None, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                   local_step_clipper: int = 16) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer over ``groups`` (each group's weight decay kept). The compressed Adams take
    AdamW's betas and eps; ``freeze_step`` None: 20% of ``total_steps`` (DeepSpeed's guidance: 15-25% of
    training, the end of the LR warmup)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optim.name={optimizer!r}: allowed {', '.join(OPTIMIZERS)}.")
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    from lightning_zero.optim import OneBitAdam, ZeroOneAdam

    freeze = max(1, round(0.2 * total_steps)) if freeze_step is None else freeze_step
    if optimizer == "onebit_adam":
        return OneBitAdam(groups, lr=lr, freeze_step=freeze)
    return ZeroOneAdam(groups, lr=lr, var_freeze_step=freeze, var_update_scaler=var_update_scaler,
                       local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper)


def optimizer_kwargs(cfg: Any) -> dict:
    """The ``T5FineTuner`` arguments that choose and shape its optimizer, from ``cfg.optim``."""
    o = cfg.optim
    return dict(optimizer=o.name, freeze_step=o.freeze_step, var_update_scaler=o.var_update_scaler,
                local_step_scaler=o.local_step_scaler, local_step_clipper=o.local_step_clipper)


def check_optimizer(cfg: Any, strategy: Any) -> None:
    """Refuse ``optim.*`` before any process starts (a ``ConfigError``): an unknown name or a bad knob (the
    optimizer's own message), and a compressed Adam the strategy does not compose with (the engine's own
    refusal, asked of a stand-in optimizer under the run's stage, precision and layout)."""
    from t5_config import ConfigError

    if cfg.optim.name not in OPTIMIZERS:
        raise ConfigError(f"Unknown optim.name {cfg.optim.name!r}. Allowed: {', '.join(OPTIMIZERS)}.")
    try:
        opt = make_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.optim.lr, 1, **optimizer_kwargs(cfg))
    except ValueError as e:
        raise ConfigError(f"Invalid optimizer config (optim.name={cfg.optim.name!r}): {e}") from e
    if cfg.optim.name == "adamw":
        return
    from lightning_zero.engine.optim.onebit.kind import check_composes
    from lightning_zero.engine.plan import ShardingPlan

    z = strategy.zero_config
    tensor_parallel = cfg.strategy.tensor_parallel_size  # the check reads only whether there is one
    loss_scaler = True if str(cfg.trainer.precision).startswith("16") else None  # fp16 mixed scales the loss
    try:
        check_composes([opt], ShardingPlan.of(z), z, tensor_parallel, loss_scaler)
    except ValueError as e:
        raise ConfigError(f"optim.name={cfg.optim.name} with strategy={cfg.strategy.name} (stage {z.stage}), "
                          f"precision {cfg.trainer.precision}: {e}") from e
