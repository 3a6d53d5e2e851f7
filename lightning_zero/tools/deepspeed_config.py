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
* ZeRO-Infinity's ``offload_optimizer.device: "nvme"`` becomes ``offload_optimizer="nvme"`` with its
  ``nvme_path`` and ``buffer_count`` (``nvme_buffer_count``), ``offload_param.device: "nvme"`` becomes
  ``offload_params="nvme"`` (one ``nvme_path`` for both); the ``aio`` block tunes DeepSpeed's libaio only;
* DeepSpeed's Muon becomes torch's Muon on the hidden matrices + AdamW on the rest ([Note: DeepSpeed's Muon]),
  what differs listed in ``differs``;
* the ``bf16`` block's ``bf16_master_weights_and_grads`` / ``bf16_optimizer_states`` become ``master_dtype="bf16"``
  / ``optimizer_state_dtype="bf16"`` (``deepspeed_low_precision.py``; fp32 gradients and the master's
  compensation term listed in ``differs``);
* anything else -- an unknown key, an optimizer type with no torch counterpart, fp16 and bf16 together --
  is refused with one error that names what is allowed.

``"auto"`` is HF Trainer's placeholder for "the value of the setting beside it" (its
``HfTrainerDeepSpeedConfig.trainer_config_process``: clipping from ``max_grad_norm``, weight decay from
``weight_decay``, precision from ``--bf16``/``--fp16``, ...). It is resolved the same way: from ``auto=`` (HF's
``TrainingArguments`` names, :data:`AUTO_SOURCES`) where given, else left to the setting beside it -- the
Trainer's own flag or, for ``hydra_overrides``, the recipe's field (no override is emitted, so the recipe's
clipping / weight decay / precision stay). Every resolution is listed in ``auto``; it never silently becomes
DeepSpeed's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from ..engine.config import ZeroConfig
from .deepspeed_auto import AUTO_SOURCES, DeepSpeedConfigError, _Auto  # noqa: F401  (AUTO_SOURCES: public)
from .deepspeed_auto import check_keys, positive_int, setting
from .deepspeed_auto import unset as _unset
from .deepspeed_batch import deepspeed_batch
from .deepspeed_json import read_config
from .deepspeed_low_precision import KEYS as LOW_PRECISION_KEYS
from .deepspeed_low_precision import low_precision_knobs
from .deepspeed_offload import offload_knobs, preset_label
from .deepspeed_muon import split_optimizers
from .deepspeed_optimizer import check_composes_with, recipe_overrides, translate_optimizer
from .deepspeed_schedule import DeepSpeedWarmupLR

# keys that tune DeepSpeed's internals or its own logging; the run is the same without them
_NO_EFFECT = {
    "steps_per_print": "Lightning logs (log_every_n_steps)",
    "aio": "NVMe I/O runs through os.preadv/pwritev reader and writer threads (no libaio)",
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
    "save_muon_momentum_buffer_in_memory": "a whole-tensor optimizer's state is never on NVMe here: with "
                                           "offload_optimizer nvme the run refuses Muon",
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
_TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "fp16", "bf16", "zero_optimization", "optimizer", "scheduler",
             "communication_data_type"} | set(_NO_EFFECT)
_ZERO_KEYS = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size",
              "stage3_param_persistence_threshold", "cpu_offload", "cpu_offload_params"} | set(_ZERO_NO_EFFECT)
_FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "auto_cast"}
_SCHEDULERS = ("WarmupLR", "WarmupDecayLR")




@dataclass
class DeepSpeedTranslation:
    """What a DeepSpeed config becomes: build the pieces with the ``make_*`` methods."""

    strategy: dict = field(default_factory=dict)  # ZeroStrategy keyword arguments
    precision: Optional[str] = "32-true"  # None: "auto", the Trainer's precision flag stays
    precision_kwargs: dict = field(default_factory=dict)  # ZeroPrecision loss-scaler arguments
    trainer: dict = field(default_factory=dict)  # Trainer flags: accumulate_grad_batches, gradient_clip_val
    micro_batch_size: Optional[int] = None  # per rank: the DataLoader's batch_size
    optimizer: Optional[tuple[type, dict]] = None  # torch class, kwargs (lr, betas, ...)
    rest_optimizer: Optional[tuple[type, dict]] = None  # Muon: the AdamW for the other parameters
    scheduler: Optional[dict] = None  # {"type": "WarmupLR" | "WarmupDecayLR", params}
    ignored: dict = field(default_factory=dict)  # key -> why it has no effect here
    differs: dict = field(default_factory=dict)  # key -> how the run here differs from DeepSpeed's
    auto: dict = field(default_factory=dict)  # "auto" key -> what it resolved to (a value, or the setting it defers to)
    world_size: Optional[int] = None  # the ranks train_batch_size was divided over: the run needs as many

    def make_precision(self):
        from ..lightning.precision import ZeroPrecision

        if self.precision is None:
            raise DeepSpeedConfigError("fp16/bf16 \"enabled\" is \"auto\": pass from_deepspeed_config(..., auto="
                                       "{'precision': 'bf16-mixed'}) or leave the precision to the Trainer "
                                       "(make_strategy() then takes the Trainer's precision flag).")
        return ZeroPrecision(self.precision, **self.precision_kwargs)

    def make_strategy(self, **kwargs):
        """``ZeroStrategy`` with the translated ZeRO settings and precision plugin (``kwargs`` override)."""
        from ..lightning.strategy import ZeroStrategy

        plugin = {"precision_plugin": self.make_precision()} if self.precision is not None else {}
        return ZeroStrategy(**{**self.strategy, **plugin, **kwargs})

    def configure_optimizers(self, params) -> Union[torch.optim.Optimizer, dict, tuple]:
        """For ``LightningModule.configure_optimizers``: the optimizer, with the LR schedule per step. ``params``:
        the parameters or the module; Muon: the module, and two optimizers (Muon, AdamW: [Note: DeepSpeed's
        Muon]) with a schedule each, for manual optimization."""
        if self.optimizer is None:
            raise DeepSpeedConfigError("the DeepSpeed config has no 'optimizer' block; build the optimizer yourself")
        cls, kw = self.optimizer
        if "lr" not in kw and "optimizer.params.lr" in self.auto:
            raise DeepSpeedConfigError("optimizer.params.lr is \"auto\": pass its value as "
                                       "from_deepspeed_config(..., auto={'learning_rate': LR}).")
        if self.rest_optimizer is not None:
            opts = split_optimizers(params, self.optimizer, self.rest_optimizer)
        else:
            opts = [cls(params.parameters() if isinstance(params, torch.nn.Module) else params, **kw)]
        if self.scheduler is None:
            return opts[0] if len(opts) == 1 else opts
        open_keys = [k for k in ("warmup_num_steps", "total_num_steps")
                     if f"scheduler.params.{k}" in self.auto and k not in self.scheduler]
        if open_keys:
            names = {"warmup_num_steps": "warmup_steps", "total_num_steps": "max_steps"}
            raise DeepSpeedConfigError(
                f"scheduler.params {', '.join(open_keys)} are \"auto\": pass from_deepspeed_config(..., auto="
                f"{{{', '.join(repr(names[k]) + ': N' for k in open_keys)}}}) (HF resolves them from its arguments).")
        scheds = [{"scheduler": DeepSpeedWarmupLR(opt, **self.scheduler), "interval": "step"} for opt in opts]
        if len(opts) == 1:
            return {"optimizer": opts[0], "lr_scheduler": scheds[0]}
        return opts, scheds

    def hydra_overrides(self) -> tuple[list[str], list[str]]:
        """(overrides for ``examples/t5_finetune.py``, notes on what the recipe cannot take as it is)."""
        o = {"strategy.name": preset_label(self.strategy)}
        o.update({f"strategy.{k}": v for k, v in self.strategy.items()})
        # no unit_classes: the recipe's default unit policy already makes one unit per T5Block, as its preset
        if self.precision is not None:
            o["trainer.precision"] = self.precision
        o.update({f"trainer.{k}": v for k, v in self.trainer.items()})
        notes = [f"{k}: no effect here ({why})" for k, why in self.ignored.items()]
        notes += [f"{k}: differs here ({how})" for k, how in self.differs.items()]
        notes += [f"{k}: \"auto\" -> {how}" for k, how in self.auto.items()]
        if self.micro_batch_size:
            o["data.batch_size"] = self.micro_batch_size
        if self.world_size is not None:
            notes.append(f"train_batch_size: micro-batch {self.micro_batch_size} x accumulation "
                         f"{self.trainer.get('accumulate_grad_batches', 1)} x {self.world_size} ranks: run on "
                         f"{self.world_size} ranks (trainer.devices x trainer.num_nodes)")
        if self.precision_kwargs:
            notes.append(f"fp16 loss scaler {self.precision_kwargs}: the recipe uses DeepSpeed's defaults; "
                         "pass ZeroPrecision('16-mixed', ...) from Python to change them")
        if self.optimizer is not None:
            opt_overrides, opt_notes = recipe_overrides(*self.optimizer, rest=self.rest_optimizer)
            o.update(opt_overrides)
            notes += opt_notes
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


def _precision(cfg: dict, out: DeepSpeedTranslation, auto: _Auto) -> None:
    fp16, bf16 = cfg.get("fp16") or {}, cfg.get("bf16") or {}
    check_keys(fp16, _FP16_KEYS, "fp16")
    check_keys(bf16, {"enabled", "immediate_grad_update", "check_grad_overflow"} | LOW_PRECISION_KEYS, "bf16")
    if "auto" in (fp16.get("enabled"), bf16.get("enabled")):  # HF: from --bf16 / --fp16, i.e. the Trainer's flag
        chosen = auto.values.get("precision")
        for key, block in (("fp16.enabled", fp16), ("bf16.enabled", bf16)):
            if block.get("enabled") == "auto":
                auto.resolve(key, "auto")
        if chosen is None:
            out.precision = None
            return
        fp16 = {**fp16, "enabled": str(chosen).startswith("16")}
        bf16 = {**bf16, "enabled": str(chosen).startswith("bf16")}
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


def _zero(cfg: dict, out: DeepSpeedTranslation, elem_bytes: int, auto: _Auto) -> ZeroConfig:
    zero = cfg.get("zero_optimization") or {}
    check_keys(zero, _ZERO_KEYS, "zero_optimization")
    s = {"stage": setting(zero, "stage", 0), **offload_knobs(zero, out.ignored),
         **low_precision_knobs(cfg.get("bf16") or {}, out.precision, out.differs)}
    hidden = lambda v: v.get("hidden_size")  # noqa: E731
    bucket = auto.resolve("zero_optimization.reduce_bucket_size", zero.get("reduce_bucket_size"), "hidden_size",
                          lambda v: hidden(v) and hidden(v) ** 2)
    if bucket is not None:
        s["bucket_mb"] = float(bucket) * elem_bytes / 2**20  # DeepSpeed counts elements
    persist = auto.resolve("zero_optimization.stage3_param_persistence_threshold",
                           zero.get("stage3_param_persistence_threshold"), "hidden_size",
                           lambda v: hidden(v) and 10 * hidden(v))
    if persist is not None:
        s["persist_numel"] = int(persist)
    comm = cfg.get("communication_data_type")
    if not _unset(comm):
        s["reduce_dtype"] = str(comm).lower()
    try:  # the run's own rules; nvme_path is the training machine's ([Note: nvme_path is the training machine's])
        config = ZeroConfig.for_another_machine(**s)
    except ValueError as e:
        raise DeepSpeedConfigError(f"DeepSpeed config zero_optimization: {e}") from None
    out.strategy = s
    out.ignored.update({f"zero_optimization.{k}": why for k, why in _ZERO_NO_EFFECT.items() if k in zero})
    return config


def _optimizer(cfg: dict, out: DeepSpeedTranslation, auto: _Auto) -> None:
    block = cfg.get("optimizer")
    if block:
        out.optimizer = translate_optimizer(block, auto, out)  # deepspeed_optimizer.py
    sched = cfg.get("scheduler")
    if sched:
        if sched.get("type") not in _SCHEDULERS:
            raise DeepSpeedConfigError(
                f"scheduler type {sched.get('type')!r} is not supported. Allowed: {', '.join(_SCHEDULERS)} "
                "(or leave 'scheduler' out and return a torch scheduler from configure_optimizers).")
        p = dict(sched.get("params") or {})
        fills = {"warmup_min_lr": lambda v: 0.0, "warmup_max_lr": None, "warmup_num_steps": None,
                 "total_num_steps": None}
        for k, compute in fills.items():
            if p.get(k) == "auto":
                p[k] = auto.resolve(f"scheduler.params.{k}", "auto", None, compute)
        p = {k: v for k, v in p.items() if not _unset(v)}
        out.scheduler = {"type": sched["type"], **p}
        if "total_num_steps" not in p and "scheduler.params.total_num_steps" in out.auto:
            return  # WarmupDecayLR's length is still open: checked when the scheduler is built
        DeepSpeedWarmupLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), **out.scheduler)


def from_deepspeed_config(config: Union[dict, str, Path], world_size: Optional[int] = None,
                          auto: Optional[dict] = None) -> DeepSpeedTranslation:
    """Translate a DeepSpeed config (a dict, or a file in DeepSpeed's dialect: [Note: DeepSpeed's config
    dialect]). ``world_size``: the ranks of the run, for DeepSpeed's batch rule ([Note: DeepSpeed's batch
    rule]: ``train_batch_size`` = micro-batch x accumulation x world size; needed when the config derives one
    of them from the total).

    ``auto``: the values HF's Trainer would fill "auto" keys with, by ``TrainingArguments`` name (e.g.
    ``{"max_grad_norm": 1.0, "weight_decay": 0.01, "precision": "bf16-mixed", "learning_rate": 3e-4}``); an
    "auto" key without one is left to the setting beside it (``translation.auto`` says which).

    What the run would refuse is refused here with the run's own message (the ZeRO knobs by ``ZeroConfig``,
    a compressed Adam by the engine's ``check_composes``), but ``nvme_path``: it names a directory on the
    training machine, checked when the run starts there ([Note: nvme_path is the training machine's])."""
    config = read_config(config)
    check_keys(config, _TOP_KEYS, "top level")
    out = DeepSpeedTranslation()
    resolver = _Auto(auto, out.auto)
    _precision(config, out, resolver)
    zero_config = _zero(config, out, elem_bytes=4 if out.precision in ("32-true", None) else 2, auto=resolver)
    _optimizer(config, out, resolver)
    if out.optimizer is not None:
        check_composes_with([out.optimizer] + ([out.rest_optimizer] if out.rest_optimizer else []),
                            config=zero_config, precision=out.precision)
    out.ignored.update({k: why for k, why in _NO_EFFECT.items() if k in config})
    if "gradient_clipping" in config and config["gradient_clipping"] == "auto":
        clip = resolver.resolve("gradient_clipping", "auto")
        if clip is not None:
            out.trainer["gradient_clip_val"] = float(clip) if float(clip) > 0 else None
    else:  # DeepSpeed's default 0 (or absent) = no clipping
        clip = config.get("gradient_clipping")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
            raise DeepSpeedConfigError(f"DeepSpeed config gradient_clipping={clip!r}: allowed a number >= 0 "
                                       "(0 = no clipping) or \"auto\".")
        out.trainer["gradient_clip_val"] = float(clip) if clip else None
    _batch(config, out, resolver, world_size)
    return out


def _batch(config: dict, out: DeepSpeedTranslation, resolver: _Auto, world_size: Optional[int]) -> None:
    """Micro-batch and accumulation by DeepSpeed's rule ([Note: DeepSpeed's batch rule])."""
    sizes, open_keys = {}, []
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        value = config.get(key)
        if value == "auto":
            value = resolver.resolve(key, "auto")
            if value is None and key != "train_batch_size":  # left to the setting beside it
                open_keys.append(key)
        sizes[key] = None if value is None else positive_int(value, key)
    batch = deepspeed_batch(sizes["train_batch_size"], sizes["train_micro_batch_size_per_gpu"],
                            sizes["gradient_accumulation_steps"], world_size, tuple(open_keys))
    out.micro_batch_size = batch.micro
    if batch.accumulation is not None:
        out.trainer["accumulate_grad_batches"] = batch.accumulation
    out.world_size = batch.world_size
