"""What the Trainer strategy and the Fabric strategy build the same way.

Both are Lightning ``DDPStrategy`` subclasses (launchers, process groups, samplers reused) that replace
the model side with one :class:`~lightning_zero.engine.ZeroEngine`. The engine, the precision plugin any
precision flag becomes, the launcher check and the registered names are made here, once, so a
``Trainer(strategy="zero3")`` and a ``Fabric(strategy="zero3")`` run the same ZeRO. Imports nothing from
Lightning: the callers pass their own distribution's classes and registry.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from ..engine import ZeroConfig, ZeroEngine
from ..engine.config import PRESETS
from ..engine.plan import ShardingPlan
from ..engine.layout.elastic import destroy_groups_at_exit, init_attempt_default_group
from ..engine.stage3.unit_policy import choose_unit_modules
from ..checkpoint.trainable_only import check_base_source

START_METHODS = ("popen", "spawn", "fork", "forkserver")
CHECKPOINT_FORMATS = ("sharded", "full")
_LAUNCH_VARIANTS = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"))
PRECISIONS = "precision='32-true', '16-mixed' or 'bf16-mixed'"


def zero_config(arguments: dict) -> ZeroConfig:
    """The ``ZeroConfig`` of a strategy's constructor arguments (its ``locals()``): every argument named like
    a config field goes to the config, which validates them; the rest are the strategy's own."""
    fields = {f.name for f in dataclasses.fields(ZeroConfig)}
    return ZeroConfig(**{k: v for k, v in arguments.items() if k in fields})


def check_start_method(start_method: str) -> None:
    if not isinstance(start_method, str) or start_method not in START_METHODS:
        raise ValueError(f"Unknown start_method {start_method!r}. Allowed: {', '.join(START_METHODS)}.")


def check_process_group_backend(backend: Any) -> None:
    """None, or what ``torch.distributed.init_process_group(backend=...)`` takes and this torch build has: a
    backend name or torch's per-device form ('cpu:gloo,cuda:nccl'). torch itself takes any string here and
    fails on an unknown name with an assert inside every rank, once they have started."""
    import torch.distributed as dist

    if backend is None:
        return
    available = [b for b in dist.Backend.backend_list  # 'fake' is torch's test double: it moves no data
                 if b not in ("undefined", "fake") and dist.is_backend_available(b)]
    if isinstance(backend, str) and backend.strip():
        parts = [p.strip() for p in backend.lower().split(",")]
        names = [p.split(":", 1)[1].strip() if ":" in p else p for p in parts]
        devices_ok = all(p.split(":", 1)[0].strip() for p in parts if ":" in p)
        if devices_ok and all(n in available for n in names) and (len(parts) == 1 or all(":" in p for p in parts)):
            return
    raise ValueError(f"process_group_backend must be None (nccl on CUDA, gloo on CPU) or a torch.distributed "
                     f"backend name this torch build has ({', '.join(map(repr, available))}), or torch's per-device "
                     f"form of those, e.g. 'cpu:gloo,cuda:nccl' on a CUDA build; got {backend!r}.")


def check_strategy_knobs(owner: str, knobs: dict, instance_of: dict) -> None:
    """The strategy's own constructor arguments (``knobs``, its ``locals()``; ZeroConfig checks the rest),
    each refused with one error naming it, the value and what is allowed. ``instance_of``: argument ->
    the Lightning class (of the caller's distribution) a value other than None must be an instance of."""
    for name, cls in instance_of.items():
        value = knobs[name]
        if value is not None and not isinstance(value, cls):
            raise ValueError(f"{owner}: {name} must be None (Lightning chooses) or an instance of {cls.__name__}; "
                             f"got {value!r} ({type(value).__name__}).")
    devices = knobs["parallel_devices"]
    if devices is not None and not (isinstance(devices, (list, tuple)) and devices
                                    and all(isinstance(d, torch.device) for d in devices)):
        raise ValueError(f"parallel_devices must be None (from the devices= flag) or a non-empty list of "
                         f"torch.device; got {devices!r}.")
    check_process_group_backend(knobs["process_group_backend"])
    timeout = knobs["timeout"]
    if timeout is not None and not (isinstance(timeout, timedelta) and timeout > timedelta(0)):
        raise ValueError(f"timeout must be a positive datetime.timedelta (e.g. timedelta(minutes=30)) or None "
                         f"(torch's default); got {timeout!r}.")
    check_start_method(knobs["start_method"])
    fmt = knobs.get("checkpoint_format", "sharded")
    if not isinstance(fmt, str) or fmt not in CHECKPOINT_FORMATS:
        raise ValueError(f"Unknown checkpoint_format {fmt!r}. Allowed: {', '.join(map(repr, CHECKPOINT_FORMATS))}.")
    for flag in ("memory_summary", "trust_checkpoint", "async_save"):
        if not isinstance(knobs.get(flag, False), bool):
            raise ValueError(f"{flag} must be True or False; got {knobs[flag]!r}.")
    fn = knobs.get("parallelize_fn")
    if fn is not None and not callable(fn):
        raise ValueError(f"parallelize_fn must be None or a callable (module, device_mesh) -> module; got {fn!r}.")


def check_model_knobs(module: torch.nn.Module, config: ZeroConfig) -> None:
    """Knobs that name modules, checked once the model exists: ``unit_classes`` entries must match modules of
    it at every stage (stage 3 resolves its units itself; below, a misspelt entry would pass unnoticed)."""
    if config.unit_classes is not None and not ShardingPlan.of(config).shards_params:
        choose_unit_modules(module, config.unit_classes)


def external_launcher(strategy, script_launcher_cls: type, info) -> bool:
    """torchrun / SLURM / any external launcher has already made every process: a fork or spawn launcher
    would start world-size more ranks inside each of them (whose rendezvous then fails with gloo's
    "Connection reset by peer"). Give ``strategy`` the script launcher, which starts nothing, and say so.
    False: the strategy's own ``start_method`` applies."""
    env = strategy.cluster_environment
    if strategy._start_method == "popen" or env is None or not env.creates_processes_externally:
        return False
    info(f"{type(strategy).__name__}: processes created by {type(env).__name__}; "
         f"start_method={strategy._start_method!r} is not used.")
    strategy._launcher = script_launcher_cls(env, strategy.num_processes, strategy.num_nodes)
    return True


def build_engine(module: torch.nn.Module, optimizers: Optional[Sequence[Any]], config: ZeroConfig, precision,
                 device: torch.device, device_mesh: Optional[Any] = None) -> ZeroEngine:
    """The engine for ``module`` (its optimizers sharded in place) with the precision plugin attached.

    ``optimizers=None``: an evaluation engine (stage 3 still partitions, a meta model is materialized
    sharded); the weights stay fp32 and mixed precision runs under autocast."""
    check_model_knobs(module, config)
    if optimizers is not None:
        engine = ZeroEngine(module, list(optimizers), config, compute_dtype=precision.compute_dtype,
                            loss_scaler=precision.loss_scaler, check_finite=precision.check_finite, device=device,
                            device_mesh=device_mesh)
    else:
        engine = ZeroEngine(module, None, config, device=device, device_mesh=device_mesh)
    precision.attach(engine, device.type)
    return engine


def as_zero_precision(plugin, zero_cls: type, mixed_cls: type, plain_cls: type, owner: str,
                      knob: str = "precision_plugin"):
    """Lightning's plugin for a precision flag -> our ``zero_cls``: the module itself in fp16/bf16 with fp32
    master shards (fp16: loss scaling), not autocast over fp32 weights. Anything else is refused."""
    if plugin is None or isinstance(plugin, zero_cls):
        return plugin
    if not isinstance(plugin, plain_cls):
        raise ValueError(f"{owner}: {knob} must be None or a precision plugin, e.g. {zero_cls.__name__}('bf16-mixed'); "
                         f"got {plugin!r} ({type(plugin).__name__}). Allowed: {PRECISIONS} as the "
                         f"Trainer / Fabric flag, or {knob}={zero_cls.__name__}(...).")
    if isinstance(plugin, mixed_cls):
        return zero_cls(plugin.precision)
    if type(plugin) is plain_cls:
        return zero_cls("32-true")
    flag = getattr(plugin, "precision", None)
    raise ValueError(
        f"{owner} does not support the precision plugin {type(plugin).__name__}"
        + (f" (precision={flag!r})" if isinstance(flag, str) else "")
        + f". Allowed: {PRECISIONS}, or plugins=[{zero_cls.__name__}(...)]."
    )


def register_presets(cls: type, registry, what: str = "ZeRO") -> None:
    """zero0 ... zero3_offload (the PRESETS table), each also with a ``_spawn`` and a ``_fork`` launcher."""
    for name, kw in PRESETS.items():
        for suffix, method in _LAUNCH_VARIANTS:
            registry.register(name + suffix, cls, description=f"{what} {kw} with start_method '{method}'",
                              override=True, start_method=method, **kw)


def setup_default_group(strategy, lightning_setup) -> None:
    """Under torchrun, the default group on a store prefix of this restart attempt's own ([Note: torchrun
    restarts], engine/layout/elastic.py), which Lightning's own setup (``lightning_setup``) then finds made; for
    every launcher, the groups destroyed at exit whatever the backend (``destroy_groups_at_exit``)."""
    device = strategy.root_device
    init_attempt_default_group(strategy._get_process_group_backend(), strategy._timeout,
                               device_id=device if device.type != "cpu" else None)
    lightning_setup()
    destroy_groups_at_exit()


def is_whole(module: torch.nn.Module) -> bool:
    """Every parameter has its full storage (a stage-3 engine that did not hand the module back has not)."""
    return all(p.untyped_storage().nbytes() >= p.numel() * p.element_size() for p in module.parameters())


def checked_weights_path(path: Any) -> Optional[str]:
    """``load_weights_from``: None, or a path that exists (a save_pretrained directory or a state-dict file)."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)) or not os.path.exists(path):
        raise ValueError(f"load_weights_from={path!r}: no such directory or file. Allowed: None, a save_pretrained "
                         "directory (safetensors, sharded or not; pytorch_model.bin) or a state-dict file.")
    return os.fspath(path)


def checkpoint_base_of(knobs: dict) -> Optional[str]:
    """The frozen base a trainable-only save records ([Note: trainable-only checkpoints]): ``checkpoint_base``,
    else ``load_weights_from``; None when ``checkpoint_trainable_only`` is off. One error for anything else."""
    flag, base = knobs["checkpoint_trainable_only"], knobs["checkpoint_base"]
    if not isinstance(flag, bool):
        raise ValueError(f"checkpoint_trainable_only must be True or False; got {flag!r}.")
    if not flag:
        if base is not None:
            raise ValueError(f"checkpoint_base={base!r} is only read by trainable-only saves. Allowed: "
                             "checkpoint_trainable_only=True with it, or checkpoint_base=None.")
        return None
    if knobs.get("checkpoint_format", "sharded") != "sharded":
        raise ValueError("checkpoint_trainable_only=True writes sharded checkpoint directories. Allowed: "
                         "checkpoint_format='sharded' with it.")
    base = base if base is not None else knobs.get("load_weights_from")
    if base is None:
        raise ValueError("checkpoint_trainable_only=True needs the frozen base's source. Allowed: "
                         "checkpoint_base=DIR (a save_pretrained directory, a state-dict file or a lightning_zero "
                         "checkpoint directory the model's frozen weights were built from)"
                         + (" or load_weights_from=DIR." if "load_weights_from" in knobs else "."))
    return check_base_source(base)


def guard_scheduler(module, skipped: Callable[[], bool]) -> Callable[[], None]:
    """A step skipped for fp16 overflow must not advance the LR schedule (as in DeepSpeed): the module's
    ``lr_scheduler_step`` skips while ``skipped()``; returns the undo for teardown (an instance attribute)."""
    original = module.lr_scheduler_step

    def lr_scheduler_step(scheduler, metric=None):
        return None if skipped() else original(scheduler, metric)

    module.lr_scheduler_step = lr_scheduler_step
    return lambda: module.__dict__.pop("lr_scheduler_step", None)
