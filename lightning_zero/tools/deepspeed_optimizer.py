"""A DeepSpeed config's ``optimizer`` block as a torch optimizer class and its arguments (``from-deepspeed``).

DeepSpeed's "Adam" is AdamW unless ``adam_w_mode`` is false; Adam, AdamW, SGD, Adagrad and Adafactor (a torch
class DeepSpeed imports by name) map to torch's. DeepSpeed's "Muon" is torch's Muon on the hidden matrices and
AdamW on the rest (deepspeed_muon.py, [Note: DeepSpeed's Muon]).
DeepSpeed's ``OneBitAdam`` and ``ZeroOneAdam`` map to :class:`lightning_zero.optim.OneBitAdam` /
:class:`~lightning_zero.optim.ZeroOneAdam`, the same algorithms with the same knobs. DeepSpeed removed its
own in 2026, so a config that used them has nowhere else to go. Their transport keys (``cuda_aware``,
``comm_backend_name``) have no effect here: the compressed exchange runs on torch.distributed's collectives
(NCCL or gloo). What they cannot take is refused, naming what is allowed: ``amsgrad``, ``eps_inside_sqrt``,
and a ``max_grad_norm`` (clip with ``gradient_clipping`` instead).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..engine.optim.onebit import OneBitAdam, ZeroOneAdam
from .deepspeed_auto import DeepSpeedConfigError, unset
from .deepspeed_muon import recipe_muon, translate_muon

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
              "adagrad": torch.optim.Adagrad, "adafactor": torch.optim.Adafactor, "muon": torch.optim.Muon,
              "onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam}
_ALLOWED = "Adam, AdamW, SGD, Adagrad, Adafactor, Muon, OneBitAdam, ZeroOneAdam"
_COMPRESSED = (OneBitAdam, ZeroOneAdam)
_TRANSPORT = ("cuda_aware", "comm_backend_name")  # DeepSpeed's choice of transport for the compressed exchange
_DEFAULT_ONLY = {"amsgrad": False, "eps_inside_sqrt": False, "max_grad_norm": 0.0}  # DeepSpeed's 1-bit defaults
# the recipe's optim.* name and keys for each compressed Adam (examples/t5_optim.py)
RECIPE_NAMES = {OneBitAdam: ("onebit_adam", {"freeze_step": "freeze_step"}),
                ZeroOneAdam: ("zeroone_adam", {"var_freeze_step": "freeze_step", "var_update_scaler": "var_update_scaler",
                                               "local_step_scaler": "local_step_scaler",
                                               "local_step_clipper": "local_step_clipper"})}


def translate_optimizer(block: dict, auto: Any, out: Any) -> tuple[type, dict]:
    """``(torch optimizer class, kwargs)`` of a DeepSpeed ``optimizer`` block; ``auto`` resolves ``"auto"``
    values, and ``out.ignored`` / ``out.auto`` record what had no effect or was resolved. Muon: Muon's, with
    the AdamW for the other parameters in ``out.rest_optimizer``."""
    kind = str(block.get("type", "")).lower()
    params = dict(block.get("params") or {})
    if kind not in OPTIMIZERS:
        raise DeepSpeedConfigError(
            f"optimizer type {block.get('type')!r} is not supported. Allowed: {_ALLOWED} (or build any torch "
            "optimizer in configure_optimizers: elementwise ones step shards, whole-tensor ones their owner rank).")
    if kind == "adam":  # DeepSpeed's Adam decouples weight decay unless told otherwise
        kind = "adamw" if params.pop("adam_w_mode", True) else "adam"
    params.pop("torch_adam", None)
    cls = OPTIMIZERS[kind]
    if cls in _COMPRESSED:
        for k in _TRANSPORT:
            if params.pop(k, None) is not None:
                out.ignored[f"optimizer.params.{k}"] = "the compressed exchange runs on torch.distributed (NCCL or gloo)"
        for k, default in _DEFAULT_ONLY.items():
            if k in params and params.pop(k) not in (default, None):
                raise DeepSpeedConfigError(
                    f"optimizer {block.get('type')}: params.{k} is not supported (allowed: {k}={default!r}"
                    + ("; clip with gradient_clipping" if k == "max_grad_norm" else "") + ").")
    betas = lambda v: (v["adam_beta1"], v["adam_beta2"]) if "adam_beta1" in v and "adam_beta2" in v else None  # noqa: E731
    sources = {"lr": ("learning_rate", None), "weight_decay": ("weight_decay", None), "eps": ("adam_epsilon", None),
               "betas": ("adam_beta1, adam_beta2", betas)}
    for k, (source, compute) in sources.items():
        if params.get(k) == "auto":
            params[k] = auto.resolve(f"optimizer.params.{k}", "auto", source, compute)
    params = {k: (tuple(v) if k == "betas" else v) for k, v in params.items() if not unset(v)}
    if cls is torch.optim.Muon:
        muon, out.rest_optimizer = translate_muon(params, out)
        return muon
    if cls in (torch.optim.Adam, torch.optim.AdamW) and "optimizer.params.weight_decay" not in out.auto:
        params.setdefault("weight_decay", 0.0)  # DeepSpeed's default; torch's AdamW would use 0.01
    try:
        cls([torch.zeros(1, requires_grad=True)], **params)
    except (TypeError, ValueError) as e:
        raise DeepSpeedConfigError(f"optimizer params {sorted(params)} do not fit {cls.__name__}: {e}") from None
    return cls, params


def check_composes_with(optimizers: list, config: Any, precision: Optional[str]) -> None:
    """Refuse now, with the run's own message, an optimizer the run would refuse at setup (a compressed Adam
    past its stages, a whole-tensor one with NVMe state): its kind's check (engine/optim/kinds/) asked of
    stand-ins of ``optimizers`` ((class, kwargs) pairs) under the translated stage, offload and precision (the
    Trainer's flag when ``precision`` is None is not known here: the run checks it), and the low-precision
    states' check (bf16 moments / masters: elementwise optimizers only)."""
    from ..engine.optim.kinds import KindSetup, kind_of
    from ..engine.optim.low_precision import check_low_precision
    from ..engine.plan import ShardingPlan

    stand_ins = [cls([torch.zeros(2, 2, requires_grad=True)], **kw) for cls, kw in optimizers]
    loss_scaler = True if precision == "16-mixed" else None  # fp16 mixed precision always scales the loss
    setup = KindSetup(ShardingPlan.of(config), config, stand_ins, None, loss_scaler)
    cls = optimizers[0][0]
    try:
        for opt in stand_ins:
            kind_of(opt).check(opt, setup)
        # bf16 states / masters: only elementwise kinds (the Trainer's precision, when it decides, is checked there)
        compute = {"16-mixed": torch.float16, "32-true": torch.float32}.get(precision, torch.bfloat16)
        check_low_precision(config, compute, stand_ins, [kind_of(opt) for opt in stand_ins])
    except ValueError as e:
        raise DeepSpeedConfigError(f"DeepSpeed config: optimizer {cls.__name__} with zero_optimization.stage="
                                   f"{config.stage}, precision {precision}: the run refuses it: {e}") from None


def recipe_overrides(cls: type, kw: dict, rest: Optional[tuple[type, dict]] = None) -> tuple[dict, list[str]]:
    """The T5 recipe's ``optim.*`` overrides for a translated optimizer (``rest``: Muon's AdamW), and notes on
    what it cannot take."""
    if cls is torch.optim.Muon:
        return recipe_muon(kw, rest[1])
    o = {f"optim.{k}": kw[k] for k in ("lr", "weight_decay") if k in kw}
    if cls in RECIPE_NAMES:
        name, keys = RECIPE_NAMES[cls]
        o["optim.name"] = name
        o.update({f"optim.{ours}": kw[theirs] for theirs, ours in keys.items() if theirs in kw})
        rest = {k: v for k, v in kw.items() if k not in ("lr", "weight_decay", *keys)}
        notes = [f"optimizer {cls.__name__}{rest}: the recipe takes AdamW's betas and eps"] if rest else []
        return o, notes
    name, like = ("adafactor", torch.optim.Adafactor) if cls is torch.optim.Adafactor else ("adamw", torch.optim.AdamW)
    if name != "adamw":
        o["optim.name"] = name
    defaults = like([torch.zeros(1, requires_grad=True)]).defaults
    rest = {k: v for k, v in kw.items() if k not in ("lr", "weight_decay") and defaults.get(k) != v}
    notes = [f"optimizer {cls.__name__}{rest or ''}: the recipe runs {like.__name__} with torch's defaults"] \
        if cls is not like or rest else []
    return o, notes
