"""The T5 recipe's optimizer choice (``optim.name``): AdamW, torch's whole-tensor optimizers (Muon on the hidden
matrices with AdamW on the rest, Adafactor; docs/optimizers.md), or lightning_zero's communication-compressed
Adams (1-bit Adam, 0/1 Adam; docs/onebit_adam.md), built over the module's weight-decay param groups.

Muon is two optimizers (``lightning_zero.muon_split``: Muon cannot step an embedding, a head, a bias or a norm),
and Lightning's automatic optimization takes one, so ``optim.name=muon`` trains with manual optimization
(:data:`MANUAL`, examples/t5_module.py ``_manual_step``): the Trainer then gets neither ``gradient_clip_val`` nor
``accumulate_grad_batches``; the module clips (one global norm across both optimizers) and accumulates.

Design note: the compressed Adams compose with fewer strategies than AdamW (1-bit Adam: stages 0-1; 0/1 Adam:
stage 0; neither with fp16 loss scaling or tensor parallelism). The engine refuses the rest when a fit sets it
up, inside every launched rank; :func:`check_optimizer` asks the engine's own check
(``engine/optim/onebit/kind.check_composes``) before any process starts, so the recipe stops with one config error
carrying the engine's message (what is allowed) instead of a traceback per rank.
"""
from __future__ import annotations

from typing import Any

import torch

OPTIMIZERS = ("adamw", "muon", "adafactor", "onebit_adam", "zeroone_adam")  # optim.name
MANUAL = ("muon",)  # optim.name values whose module steps its optimizers itself (several optimizers)


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
    if optimizer == "adafactor":  # factored second moments, fp32 throughout; each group's weight decay kept
        return torch.optim.Adafactor(groups, lr=lr)
    if optimizer == "muon":
        raise ValueError("optim.name='muon' is two optimizers over the module's parameters: make_muon_adamw.")
    from lightning_zero.optim import OneBitAdam, ZeroOneAdam

    freeze = max(1, round(0.2 * total_steps)) if freeze_step is None else freeze_step
    if optimizer == "onebit_adam":
        return OneBitAdam(groups, lr=lr, freeze_step=freeze)
    return ZeroOneAdam(groups, lr=lr, var_freeze_step=freeze, var_update_scaler=var_update_scaler,
                       local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper)


def make_muon_adamw(module: torch.nn.Module, groups: list, lr: float) -> list[torch.optim.Optimizer]:
    """[Muon over the hidden 2-D matrices, AdamW over the rest] (``lightning_zero.muon_split``), each keeping the
    weight decay of the ``groups`` its parameters come from. Muon's ``adjust_lr_fn="match_rms_adamw"``
    (Moonlight's scaling) gives its update AdamW's RMS, so one ``optim.lr`` and ``optim.weight_decay`` serve
    both optimizers."""
    from lightning_zero import muon_split

    hidden = {id(p) for p in muon_split(module)[0]}
    muon = [{**g, "params": [p for p in g["params"] if id(p) in hidden]} for g in groups]
    adamw = [{**g, "params": [p for p in g["params"] if id(p) not in hidden]} for g in groups]
    return [torch.optim.Muon([g for g in muon if g["params"]], lr=lr, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([g for g in adamw if g["params"]], lr=lr)]


def optimizer_kwargs(cfg: Any) -> dict:
    """The ``T5FineTuner`` arguments that choose and shape its optimizer, from ``cfg.optim`` (and the clipping a
    module that steps itself applies: :data:`MANUAL`)."""
    o = cfg.optim
    return dict(optimizer=o.name, freeze_step=o.freeze_step, var_update_scaler=o.var_update_scaler,
                local_step_scaler=o.local_step_scaler, local_step_clipper=o.local_step_clipper,
                gradient_clip_val=cfg.trainer.gradient_clip_val,
                accumulate_grad_batches=cfg.trainer.accumulate_grad_batches)


def _stand_ins(cfg: Any) -> list[torch.optim.Optimizer]:
    """``optim.name``'s optimizers over a stand-in module (one embedding, one hidden matrix): what the engine's
    kind check is asked about before any process starts."""
    if cfg.optim.name in MANUAL:
        module = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 2))
        return make_muon_adamw(module, [{"params": list(module.parameters())}], cfg.optim.lr)
    kwargs = {k: v for k, v in optimizer_kwargs(cfg).items()
              if k not in ("gradient_clip_val", "accumulate_grad_batches")}  # the module's
    return [make_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.optim.lr, 1, **kwargs)]


def check_optimizer(cfg: Any, strategy: Any) -> None:
    """Refuse ``optim.*`` before any process starts (a ``ConfigError``): an unknown name or a bad knob (the
    optimizer's own message), and an optimizer the
    strategy does not compose with: the engine's own refusal (its optimizer kind's check: a compressed Adam
    past its stages, a whole-tensor optimizer with NVMe state or tensor parallelism), asked of stand-in
    optimizers under the run's stage, placement, precision and layout."""
    from t5_config import ConfigError

    name = cfg.optim.name
    if name not in OPTIMIZERS:
        raise ConfigError(f"Unknown optim.name {name!r}. Allowed: {', '.join(OPTIMIZERS)}.")
    try:
        opts = _stand_ins(cfg)
    except ValueError as e:
        raise ConfigError(f"Invalid optimizer config (optim.name={name!r}): {e}") from e
    from lightning_zero.engine.optim.kinds import KindSetup, kind_of
    from lightning_zero.engine.plan import ShardingPlan

    z = strategy.zero_config
    tensor_parallel = cfg.strategy.tensor_parallel_size  # the checks read only whether there is one
    loss_scaler = True if str(cfg.trainer.precision).startswith("16") else None  # fp16 mixed scales the loss
    setup = KindSetup(ShardingPlan.of(z), z, opts, tensor_parallel, loss_scaler)
    try:
        for opt in opts:
            kind_of(opt).check(opt, setup)
    except ValueError as e:
        raise ConfigError(f"optim.name={name} with strategy={cfg.strategy.name} (stage {z.stage}), "
                          f"precision {cfg.trainer.precision}: {e}") from e
