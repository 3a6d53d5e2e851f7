"""Bring a DeepSpeed JSON config over: the same run as ``ZeroStrategy`` + ``ZeroPrecision`` + Trainer flags.

Design note
-----------
A DeepSpeed user's config is the record of a working run (stage, offload, fp16 scaler settings, clipping,
accumulation, optimizer, LR schedule). :func:`from_deepspeed_config` reads it and says, key by key, where
each setting lives here, so nothing is silently dropped:

* a key that maps becomes a ``ZeroStrategy`` / ``ZeroPrecision`` argument, a Trainer flag, the micro-batch
  size, or an optimizer / LR-scheduler factory that reproduces DeepSpeed's formulas exactly (its "Adam"
  is AdamW unless ``adam_w_mode`` is false; its WarmupLR / WarmupDecayLR set absolute LRs, the first
  step at ``warmup_min_lr``);
* a key that only tunes DeepSpeed's own machinery (``overlap_comm``, ``sub_group_size``, logging, ...)
  is listed in ``ignored`` with the reason;
* anything else -- an unknown key, NVMe offload, a non-elementwise optimizer, fp16 and bf16 together --
  is refused with one error that names what is allowed. ``"auto"`` (HF Trainer's placeholder) means
  "not set".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..engine.config import ZeroConfig

# keys that tune DeepSpeed's internals or its own logging; the run is the same without them
_NO_EFFECT = {
    "steps_per_print": "Lightning logs (log_every_n_steps)",
    "wall_clock_breakdown": "use Lightning's profiler",
    "dump_state": "DeepSpeed debugging",
    "prescale_gradients": "gradients are averaged in the reduction",
    "gradient_predivide_factor": "gradients are averaged in the reduction",
    "zero_allow_untested_optimizer": "elementwise torch optimizers are allowed; others are refused",
    "tensorboard": "use Lightning's loggers", "wandb": "use Lightning's loggers",
    "csv_monitor": "use Lightning's loggers", "comms_logger": "DeepSpeed debugging",
    "flops_profiler": "DeepSpeed profiling", "memory_breakdown": "engine.memory_report() gives exact bytes",
    "zero_force_ds_cpu_optimizer": "offload always uses torch's fused CPU AdamW/Adam",
}
_ZERO_NO_EFFECT = {
    "overlap_comm": "reductions always overlap backward (side stream on CUDA)",
    "contiguous_gradients": "reduced gradients always land in flat shards",
    "reduce_scatter": "stages 1-3 always reduce-scatter",
    "allgather_partitions": "parameters are always all-gathered per bucket",
    "allgather_bucket_size": "one bucket cap (reduce_bucket_size) serves both directions",
    "round_robin_gradients": "every rank owns a slice of every parameter",
    "sub_group_size": "the optimizer steps each shard whole",
    "stage3_max_live_parameters": "at most two units are gathered (prefetch)",
    "stage3_max_reuse_distance": "units are released after each use",
    "stage3_prefetch_bucket_size": "prefetch is one unit ahead in the recorded order",
    "stage3_gather_16bit_weights_on_model_save": "checkpoints consolidate with `lightning-zero consolidate`",
    "gather_16bit_weights_on_model_save": "checkpoints consolidate with `lightning-zero consolidate`",
    "elastic_checkpoint": "checkpoints always reshard to any world size",
    "ignore_unused_parameters": "unused parameters are always handled (grad stays None, as in DDP)",
    "load_from_fp32_weights": "masters are always restored from the fp32 checkpoint",
    "memory_efficient_linear": "DeepSpeed kernel",
    "use_multi_rank_bucket_allreduce": "DeepSpeed kernel",
}
_OFFLOAD_KEYS = {"device", "pin_memory", "buffer_count", "buffer_size", "fast_init", "ratio", "max_in_cpu",
                 "nvme_path", "pipeline", "pipeline_read", "pipeline_write"}
_TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "fp16", "bf16", "zero_optimization", "optimizer", "scheduler",
             "communication_data_type"} | set(_NO_EFFECT)
_ZERO_KEYS = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size",
              "stage3_param_persistence_threshold", "cpu_offload", "cpu_offload_params"} | set(_ZERO_NO_EFFECT)
_FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "auto_cast"}
_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
               "adagrad": torch.optim.Adagrad}
_SCHEDULERS = ("WarmupLR", "WarmupDecayLR")


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config setting that has no equivalent here (the message names what is allowed)."""


def _unset(v) -> bool:
    return v is None or v == "auto"


def _check_keys(block: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(block) - allowed)
    if unknown:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {where}: unsupported key(s) {unknown}. Allowed: {', '.join(sorted(allowed))}.")


@dataclass
class DeepSpeedTranslation:
    """What a DeepSpeed config becomes: build the pieces with the ``make_*`` methods."""

    strategy: dict = field(default_factory=dict)  # ZeroStrategy keyword arguments
    precision: str = "32-true"
    precision_kwargs: dict = field(default_factory=dict)  # ZeroPrecision loss-scaler arguments
    trainer: dict = field(default_factory=dict)  # Trainer flags: accumulate_grad_batches, gradient_clip_val
    micro_batch_size: Optional[int] = None  # per rank: the DataLoader's batch_size
    optimizer: Optional[tuple[type, dict]] = None  # torch class, kwargs (lr, betas, ...)
    scheduler: Optional[dict] = None  # {"type": "WarmupLR" | "WarmupDecayLR", params}
    ignored: dict = field(default_factory=dict)  # key -> why it has no effect here

    def make_precision(self):
        from ..lightning.precision import ZeroPrecision

        return ZeroPrecision(self.precision, **self.precision_kwargs)

    def make_strategy(self, **kwargs):
        """``ZeroStrategy`` with the translated ZeRO settings and precision plugin (``kwargs`` override)."""
        from ..lightning.strategy import ZeroStrategy

        return ZeroStrategy(**{**self.strategy, "precision_plugin": self.make_precision(), **kwargs})

    def configure_optimizers(self, params) -> Union[torch.optim.Optimizer, dict]:
        """For ``LightningModule.configure_optimizers``: the optimizer, with the LR schedule per step."""
        if self.optimizer is None:
            raise DeepSpeedConfigError("the DeepSpeed config has no 'optimizer' block; build the optimizer yourself")
        cls, kw = self.optimizer
        opt = cls(params, **kw)
        if self.scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": DeepSpeedWarmupLR(opt, **self.scheduler),
                                                   "interval": "step"}}

    def hydra_overrides(self) -> tuple[list[str], list[str]]:
        """(overrides for ``examples/t5_finetune.py``, notes on what the recipe cannot take as it is)."""
        offload = self.strategy.get("offload_optimizer") or self.strategy.get("offload_params")
        o = {"strategy.name": f"zero{self.strategy.get('stage', 0)}{'_offload' if offload else ''}"}  # a label
        o.update({f"strategy.{k}": v for k, v in self.strategy.items()})
        if self.strategy.get("stage") == 3:
            o["strategy.unit_classes"] = "[T5Block]"  # the recipe's model: one unit per block
        o["trainer.precision"] = self.precision
        o.update({f"trainer.{k}": v for k, v in self.trainer.items()})
        notes = [f"{k}: no effect here ({why})" for k, why in self.ignored.items()]
        if self.micro_batch_size:
            o["data.batch_size"] = self.micro_batch_size
        if self.precision_kwargs:
            notes.append(f"fp16 loss scaler {self.precision_kwargs}: the recipe uses DeepSpeed's defaults; "
                         "pass ZeroPrecision('16-mixed', ...) from Python to change them")
        if self.optimizer is not None:
            cls, kw = self.optimizer
            o.update({f"optim.{k}": kw[k] for k in ("lr", "weight_decay") if k in kw})
            defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
            rest = {k: v for k, v in kw.items() if k not in ("lr", "weight_decay") and defaults.get(k) != v}
            if cls is not torch.optim.AdamW or rest:
                notes.append(f"optimizer {cls.__name__}{rest or ''}: the recipe runs AdamW with torch's defaults")
        if self.scheduler is not None:
            sch = self.scheduler
            for ds_key, key in (("warmup_num_steps", "warmup_steps"), ("total_num_steps", "total_steps"),
                                ("warmup_max_lr", "lr")):
                if ds_key in sch:
                    o[f"optim.{key}"] = sch[ds_key]
            notes.append(f"scheduler {sch['type']}: the recipe warms up linearly and decays linearly to 0; "
                         "DeepSpeedWarmupLR reproduces DeepSpeed's formula exactly from Python")
        return [f"{k}={_hydra(v)}" for k, v in o.items()], notes


def _hydra(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


class DeepSpeedWarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR (``total_num_steps=None``) and WarmupDecayLR, formula for formula.

    DeepSpeed's iteration counter starts at -1 (the first step runs at ``warmup_min_lr``); torch's
    ``last_epoch`` starts at 0, so DeepSpeed's iteration is ``last_epoch - 1``.
    """

    def __init__(self, optimizer, type: str = "WarmupLR", warmup_min_lr: float = 0.0,  # noqa: A002
                 warmup_max_lr: Optional[float] = None, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 total_num_steps: Optional[int] = None, last_epoch: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise DeepSpeedConfigError(f"warmup_type {warmup_type!r}: allowed 'log', 'linear'")
        if type == "WarmupDecayLR" and total_num_steps is None:
            raise DeepSpeedConfigError("WarmupDecayLR needs total_num_steps")
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]  # DeepSpeed: the optimizer's lr
        self.min_lr, self.max_lr = float(warmup_min_lr), float(warmup_max_lr)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type, self.total_num_steps = warmup_type, total_num_steps
        super().__init__(optimizer, last_epoch)

    def gamma(self, it: int) -> float:
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup_num_steps)
            return it / self.warmup_num_steps
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))

    def get_lr(self) -> list[float]:
        lr = self.min_lr + (self.max_lr - self.min_lr) * self.gamma(self.last_epoch - 1)
        return [lr for _ in self.optimizer.param_groups]


def _offload(block, key: str) -> bool:
    """True for device 'cpu', False for 'none'/absent; NVMe and unknown devices are refused."""
    if _unset(block):
        return False
    _check_keys(block, _OFFLOAD_KEYS, f"zero_optimization.{key}")
    device = str(block.get("device", "none")).lower()
    if device not in ("cpu", "none"):
        raise DeepSpeedConfigError(
            f"zero_optimization.{key}.device={device!r} is not supported. Allowed: 'cpu', 'none'.")
    return device == "cpu"


def _precision(cfg: dict, out: DeepSpeedTranslation) -> None:
    fp16, bf16 = cfg.get("fp16") or {}, cfg.get("bf16") or {}
    _check_keys(fp16, _FP16_KEYS, "fp16")
    _check_keys(bf16, {"enabled", "immediate_grad_update", "check_grad_overflow"}, "bf16")
    on16, onbf = fp16.get("enabled") is True, bf16.get("enabled") is True
    if on16 and onbf:
        raise DeepSpeedConfigError("fp16 and bf16 are both enabled. Allowed: at most one of them.")
    if onbf:
        out.precision = "bf16-mixed"
    elif on16:
        out.precision = "16-mixed"
        kw = {k: fp16[k] for k in ("initial_scale_power", "loss_scale_window", "hysteresis",
                                   "consecutive_hysteresis", "min_loss_scale") if not _unset(fp16.get(k))}
        if not _unset(fp16.get("loss_scale")) and fp16["loss_scale"] != 0:  # 0 = dynamic
            kw["loss_scale"] = float(fp16["loss_scale"])
        out.precision_kwargs = kw
        if "auto_cast" in fp16:
            out.ignored["fp16.auto_cast"] = "inputs keep their dtype; the module's fp16 params set the compute dtype"


def _zero(cfg: dict, out: DeepSpeedTranslation, elem_bytes: int) -> None:
    zero = cfg.get("zero_optimization") or {}
    _check_keys(zero, _ZERO_KEYS, "zero_optimization")
    stage = 0 if _unset(zero.get("stage")) else zero["stage"]
    offload_opt = _offload(zero.get("offload_optimizer"), "offload_optimizer") or zero.get("cpu_offload") is True
    offload_par = _offload(zero.get("offload_param"), "offload_param") or zero.get("cpu_offload_params") is True
    s = {"stage": stage, "offload_optimizer": offload_opt, "offload_params": offload_par}
    if not _unset(zero.get("reduce_bucket_size")):
        s["bucket_mb"] = float(zero["reduce_bucket_size"]) * elem_bytes / 2**20  # DeepSpeed counts elements
    if not _unset(zero.get("stage3_param_persistence_threshold")):
        s["persist_numel"] = int(zero["stage3_param_persistence_threshold"])
    comm = cfg.get("communication_data_type")
    if not _unset(comm):
        s["reduce_dtype"] = str(comm).lower()
    try:
        ZeroConfig(**s)  # stage / offload combinations are refused here, with the allowed ones named
    except ValueError as e:
        raise DeepSpeedConfigError(f"DeepSpeed config zero_optimization: {e}") from None
    out.strategy = s
    out.ignored.update({f"zero_optimization.{k}": why for k, why in _ZERO_NO_EFFECT.items() if k in zero})


def _optimizer(cfg: dict, out: DeepSpeedTranslation) -> None:
    block = cfg.get("optimizer")
    if block:
        kind = str(block.get("type", "")).lower()
        params = dict(block.get("params") or {})
        if kind not in _OPTIMIZERS:
            raise DeepSpeedConfigError(
                f"optimizer type {block.get('type')!r} is not supported (ZeRO shards need an elementwise "
                f"optimizer). Allowed: Adam, AdamW, SGD, Adagrad.")
        if kind == "adam":  # DeepSpeed's Adam decouples weight decay unless told otherwise
            kind = "adamw" if params.pop("adam_w_mode", True) else "adam"
        params.pop("torch_adam", None)
        params = {k: (tuple(v) if k == "betas" else v) for k, v in params.items() if not _unset(v)}
        cls = _OPTIMIZERS[kind]
        if cls in (torch.optim.Adam, torch.optim.AdamW):
            params.setdefault("weight_decay", 0.0)  # DeepSpeed's default; torch's AdamW would use 0.01
        try:
            cls([torch.zeros(1, requires_grad=True)], **params)
        except TypeError as e:
            raise DeepSpeedConfigError(f"optimizer params {sorted(params)} do not fit {cls.__name__}: {e}") from None
        out.optimizer = (cls, params)
    sched = cfg.get("scheduler")
    if sched:
        if sched.get("type") not in _SCHEDULERS:
            raise DeepSpeedConfigError(
                f"scheduler type {sched.get('type')!r} is not supported. Allowed: {', '.join(_SCHEDULERS)} "
                "(or leave 'scheduler' out and return a torch scheduler from configure_optimizers).")
        p = {k: v for k, v in (sched.get("params") or {}).items() if not _unset(v)}
        out.scheduler = {"type": sched["type"], **p}
        DeepSpeedWarmupLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), **out.scheduler)


def from_deepspeed_config(config: Union[dict, str, Path], world_size: Optional[int] = None) -> DeepSpeedTranslation:
    """Translate a DeepSpeed config (a dict or a JSON file). ``world_size`` checks ``train_batch_size``."""
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    _check_keys(config, _TOP_KEYS, "top level")
    out = DeepSpeedTranslation()
    _precision(config, out)
    _zero(config, out, elem_bytes=4 if out.precision == "32-true" else 2)
    _optimizer(config, out)
    out.ignored.update({k: why for k, why in _NO_EFFECT.items() if k in config})
    gas = config.get("gradient_accumulation_steps")
    if not _unset(gas):
        out.trainer["accumulate_grad_batches"] = int(gas)
    clip = config.get("gradient_clipping")  # DeepSpeed's default 0 = no clipping
    out.trainer["gradient_clip_val"] = float(clip) if not _unset(clip) and float(clip) > 0 else None
    micro = config.get("train_micro_batch_size_per_gpu")
    out.micro_batch_size = None if _unset(micro) else int(micro)
    total = config.get("train_batch_size")
    if not _unset(total):
        accum = out.trainer.get("accumulate_grad_batches", 1)
        if out.micro_batch_size is None and world_size:
            out.micro_batch_size, rem = divmod(int(total), accum * world_size)
            if rem or not out.micro_batch_size:
                raise DeepSpeedConfigError(
                    f"train_batch_size={total} is not a multiple of gradient_accumulation_steps x world size "
                    f"= {accum * world_size}")
        elif world_size and out.micro_batch_size * accum * world_size != int(total):
            raise DeepSpeedConfigError(
                f"train_batch_size={total} != micro batch {out.micro_batch_size} x accumulation {accum} x "
                f"world size {world_size}")
    return out
