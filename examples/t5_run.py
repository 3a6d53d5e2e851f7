"""Plumbing both T5 apps share (t5_finetune.py, t5_pretrain.py): output dir, launcher fix-ups, logging,
the Trainer with its loggers and checkpoints, the HF export, and the end-of-run summary.

Design note: under the fork/spawn launchers the process that prints the summary is not the one that trained
(Lightning hands back only rank 0's return value and metrics), so everything the summary reports that only
the ranks know -- per-rank model-state bytes, the stage-3 units actually built, the exported HF directory --
is written by the :func:`run_report` callback to ``run_info.json`` in the run directory, and read back from there.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import os
import sys
import time
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("t5_recipe")
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")


def hydra_cfg() -> Optional[Any]:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def output_dir(cfg: DictConfig, app: str = "t5_finetune") -> str:
    """cfg.output.dir, else Hydra's run dir (sweep job dir under -m), else outputs/<app>/<time>."""
    if cfg.output.dir:
        return os.path.abspath(os.path.expanduser(cfg.output.dir))
    hc = hydra_cfg()
    if hc is not None:
        return hc.runtime.output_dir
    return os.path.abspath(os.path.join("outputs", app, time.strftime("%Y-%m-%d_%H-%M-%S")))


def one_line_per_message() -> None:
    """Lightning gives its loggers their own console handler; under Hydra (which configures the root logger)
    every message then prints twice. Let them propagate to the root handler only."""
    if not logging.getLogger().handlers:
        return  # no root handler (plain Python, not Hydra): Lightning's own handlers are the only output
    for name in _LIGHTNING_LOGGERS:
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                lg.removeHandler(h)
        lg.propagate = True


def resolve_start_method(cfg: DictConfig) -> None:
    """popen under a Hydra multirun replays the whole sweep in every child: use spawn there instead."""
    from hydra.types import RunMode

    hc = hydra_cfg()
    s = cfg.strategy
    if s.start_method == "popen" and hc is not None and hc.mode == RunMode.MULTIRUN \
            and os.environ.get("LOCAL_RANK") is None:
        log.warning("strategy.start_method=popen re-runs sys.argv per rank, which under a Hydra multirun (-m) "
                    "would replay the sweep in every child; using 'spawn' for this multirun instead "
                    "(or set strategy.start_method=fork on CPU).")
        s.start_method = "spawn"


def num_devices(cfg: DictConfig) -> int:
    d = cfg.trainer.devices
    if isinstance(d, int):
        return d
    if isinstance(d, str) and d.strip().lstrip("-").isdigit():
        return int(d)
    if OmegaConf.is_list(d) or isinstance(d, (list, tuple)):
        return len(d)
    return os.cpu_count() or 1  # "auto" on CPU: one rank per core


def set_cpu_threads(cfg: DictConfig) -> None:
    import torch

    if cfg.trainer.accelerator == "cpu":
        # one rank per core: more threads than cores only makes the ranks fight
        threads = max(1, (os.cpu_count() or 1) // max(1, num_devices(cfg)))
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _progress_bar(cfg: DictConfig):
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    kind = cfg.trainer.progress_bar
    tty = sys.stdout.isatty()
    if kind == "rich" or (kind == "auto" and tty):
        try:
            import rich  # noqa: F401

            return RichProgressBar(refresh_rate=1)
        except ImportError:
            pass
    # Without a terminal, redraw rarely so log files stay readable.
    return TQDMProgressBar(refresh_rate=1 if tty else max(1, cfg.trainer.log_every_n_steps))


def describe_strategy(strategy: Any) -> str:
    """What was composed, read from the strategy object (a preset's name can be overridden field by field)."""
    z = strategy.zero_config
    parts = [f"ZeRO stage {z.stage}"]
    if z.stage >= 1:
        off = ["optimizer"] if z.offload_optimizer else []
        off += ["params"] if z.offload_params else []
        parts.append(f"offload {'+'.join(off) if off else 'none'}")
    if z.stage == 3:
        if z.unit_classes:
            units = f"classes {','.join(map(str, z.unit_classes))}"
        elif z.unit_mb is not None:
            units = f"by size ({z.unit_mb:g} MiB)"
        else:  # the engine's policy: the model's _no_split_modules, else repeated blocks, else size
            units = "automatic (the model's declared blocks, else repeated blocks, else size)"
        persist = "auto" if z.persist_numel is None else z.persist_numel
        parts.append(f"units {units}, persist < {persist} params, prefetch {'on' if z.prefetch else 'off'}")
    parts.append(f"bucket {z.bucket_mb:g} MiB")
    return ", ".join(parts)


def make_trainer(cfg: DictConfig, strategy: Any, out: str, monitor: str, extra_callbacks: list,
                 datamodule: Any = None) -> tuple:
    """(trainer, checkpoint callback, csv logger, loggers) as configured in cfg.trainer / cfg.output; with
    ``datamodule``, its position in the epoch and the RNG states go into every checkpoint (t5_resume.py)."""
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    checkpoint = ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), monitor=monitor, mode="min",
                                 save_top_k=cfg.output.save_top_k, save_last=cfg.output.save_last,
                                 filename=f"step{{step:05d}}-{monitor}{{{monitor}:.3f}}",
                                 auto_insert_metric_name=False)
    csv_logger = CSVLogger(save_dir=out, name="csv", version="")
    loggers = [csv_logger]
    if cfg.output.tensorboard:
        try:
            import tensorboard  # noqa: F401

            loggers.append(TensorBoardLogger(save_dir=out, name="tb", version="", default_hp_metric=False))
        except ImportError:
            pass
    callbacks = [checkpoint, LearningRateMonitor(logging_interval="step")] + extra_callbacks
    if datamodule is not None:
        from t5_resume import TrainPosition

        callbacks.append(TrainPosition(datamodule))
    if cfg.trainer.enable_progress_bar:
        callbacks.append(_progress_bar(cfg))
    from t5_optim import MANUAL

    t = cfg.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=strategy,
        precision=t.precision, max_steps=t.max_steps, max_epochs=t.max_epochs,
        val_check_interval=t.val_check_interval, check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_val_batches=t.limit_val_batches, num_sanity_val_steps=t.num_sanity_val_steps,
        log_every_n_steps=t.log_every_n_steps,
        # a module that steps itself clips and accumulates itself (t5_optim.MANUAL; Lightning refuses both then)
        gradient_clip_val=None if cfg.optim.name in MANUAL else t.gradient_clip_val,
        accumulate_grad_batches=1 if cfg.optim.name in MANUAL else t.accumulate_grad_batches,
        deterministic=t.deterministic,
        enable_progress_bar=t.enable_progress_bar, logger=loggers, callbacks=callbacks,
        default_root_dir=out,
    )
    return trainer, checkpoint, csv_logger, loggers


def eval_trainer(cfg: DictConfig, strategy: Any, out: str, logger: Any = False):
    """A Trainer for validate/test only (same hardware and precision, no checkpoints)."""
    import lightning as L

    t = cfg.trainer
    return L.Trainer(accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=strategy,
                     precision=t.precision, limit_val_batches=t.limit_val_batches, logger=logger,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=out)


def read_val_history(metrics_csv: str, prefix: str = "val_") -> list[dict]:
    """Rows of a Lightning CSVLogger metrics.csv that hold ``<prefix>loss``, in step order."""
    if not os.path.isfile(metrics_csv):
        return []
    rows = []
    with open(metrics_csv, newline="") as f:
        for r in csv.DictReader(f):
            if r.get(prefix + "loss"):
                rows.append({k: (float(v) if k != "step" else int(float(v))) for k, v in r.items()
                             if v not in ("", None) and k.startswith((prefix, "step"))})
    return sorted(rows, key=lambda r: r.get("step", 0))


def run_info_path(out: str) -> str:
    return os.path.join(out, "run_info.json")


def read_run_info(out: str) -> dict:
    p = run_info_path(out)
    if not os.path.isfile(p):
        return {}
    with open(p, encoding="utf-8") as f:
        return json.load(f)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_metric(r: dict, k: str) -> str:
    return f"{r[k]:.3f}" if k in r and isinstance(r[k], float) and math.isfinite(r[k]) else "n/a"


def run_report(out: str, tokenizer: Any, export_hf: bool):
    """A callback that records per-rank model-state bytes and the stage-3 units built (``run_info.json``),
    and writes ``<out>/hf_model`` (``save_pretrained`` model + tokenizer) once the engine has handed the
    module back whole and in fp32 (``on_fit_end`` comes after the strategy's teardown)."""
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    class _RunReport(Callback):
        def __init__(self) -> None:
            self.info: dict = {}

        def on_train_end(self, trainer, pl_module) -> None:
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                mine = engine.memory_report().as_dict()
                comm = engine.comm_report()  # the last step's bytes; a compressed Adam's totals per phase
                mine["comm"] = {"last_step_wire_bytes": comm.wire_bytes, "phases": comm.phases}
            else:
                n = sum(p.numel() * p.element_size() for p in pl_module.parameters())
                mine = {"model_states": n}
            part = getattr(engine, "partitioner", None)
            units = getattr(part, "units", None)
            if units is not None:
                mine["units"] = len(units)
                mine["persistent_units"] = sum(bool(getattr(u, "persistent", False)) for u in units)
            ranks = [mine]
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                ranks = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, mine)  # every rank calls it: on_train_end runs on all
            self.info = {"ranks": ranks, "global_step": trainer.global_step,
                         "batches": trainer.fit_loop.epoch_loop.total_batch_idx + 1}  # micro-batches trained

        def on_fit_end(self, trainer, pl_module) -> None:
            if not trainer.is_global_zero:
                return
            info = dict(self.info)
            if export_hf:
                hf = os.path.join(out, "hf_model")
                pl_module.model.save_pretrained(hf)
                tokenizer.save_pretrained(hf)
                info["hf_model"] = hf
            os.makedirs(out, exist_ok=True)
            with open(run_info_path(out), "w", encoding="utf-8") as f:
                json.dump(info, f, indent=1)

    return _RunReport()


def summary_lines(app: str, cfg: DictConfig, strategy: Any, s: dict) -> list[str]:
    """The run's head lines: what was composed (from the objects), what ran, where everything went."""
    info = s.get("run_info", {})
    ranks = info.get("ranks", [])
    model = (f"pretrained {cfg.model.pretrained}" if cfg.model.pretrained
             else f"{cfg.model.preset} (random init)")
    lines = [
        f"== {app} done in {s['fit_seconds']:.0f}s: {info.get('global_step', '?')} steps "
        f"({s.get('steps_per_s', float('nan')):.2f}/s), {s['world_size']} ranks on {cfg.trainer.accelerator}, "
        f"precision {cfg.trainer.precision} ==",
        f"strategy:     {describe_strategy(strategy)} (preset name: {cfg.strategy.name})",
        f"model:        {model}, {s['n_params'] / 1e6:.2f}M params",
        *([f"attention:    {s['attention']}"] if s.get("attention") else []),
        f"tokenizer:    {s['tokenizer']}",
    ]
    if ranks:
        mem = ", ".join(f"rank {i} {fmt_bytes(r['model_states'])}" for i, r in enumerate(ranks))
        lines.append(f"model states: {mem} (params + grads + optimizer state, per rank)")
        phases = ranks[0].get("comm", {}).get("phases")
        if phases:  # optim.name=onebit_adam / zeroone_adam: the bytes before and after the 1-bit phase began
            lines.append("comm (rank 0): " + ", ".join(
                f"{name} {steps} steps {fmt_bytes(wire / steps)}/step" for name, (steps, _c, _p, wire) in phases.items()))
        if "units" in ranks[0]:
            lines.append(f"stage-3 units built: {ranks[0]['units']} ({ranks[0]['persistent_units']} persistent)")
    lines += [f"outputs:      {s['output_dir']}",
              f"checkpoints:  {s['checkpoint_dir']} (best: {os.path.basename(s['best_checkpoint']) or 'none'})"]
    if info.get("hf_model"):
        lines.append(f"hf model:     {info['hf_model']} (AutoTokenizer / T5ForConditionalGeneration.from_pretrained)")
    lines.append(f"metrics csv:  {s['metrics_csv']}")
    if s.get("tensorboard_dir"):
        lines.append(f"tensorboard:  tensorboard --logdir {s['tensorboard_dir']}")
    return lines


def checked_ckpt_path(cfg: DictConfig) -> Optional[str]:
    """``ckpt_path``: None, a checkpoint file, or a lightning_zero checkpoint directory -- anything else is refused
    before a process starts (a mistyped path must not train from step 0 without a word)."""
    from lightning_zero.checkpoint.format import is_checkpoint_dir
    from t5_config import ConfigError

    path = cfg.ckpt_path
    if path is None:
        return None
    if not (os.path.isfile(path) or is_checkpoint_dir(path)):
        what = "a directory that is not a lightning_zero checkpoint" if os.path.isdir(path) else "no such file"
        raise ConfigError(f"ckpt_path={path!r}: {what}. Allowed: null, a checkpoint file, or a checkpoint "
                          "directory a fit wrote (e.g. <output>/checkpoints/last.ckpt).")
    return path


def fit_and_report(trainer, model, dm, out: str, checkpoint, csv_logger, loggers, tok,
                   ckpt_path: Optional[str] = None) -> Optional[dict]:
    """Fit (resuming from ``ckpt_path`` when given: t5_resume.py makes it exact mid-epoch), then (global rank 0
    only; None elsewhere) the summary fields both apps report: outputs, wall time and speed, validation
    history, what the ranks recorded (run_info.json), tokenizer, size."""
    from t5_tokenizer import describe

    t0 = time.time()
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    wall = time.time() - t0
    if not trainer.is_global_zero:
        return None
    metrics_csv = os.path.join(csv_logger.log_dir, "metrics.csv")  # written by global rank 0
    hist, info = read_val_history(metrics_csv), read_run_info(out)
    steps = info.get("global_step", trainer.global_step)
    return {"output_dir": out, "checkpoint_dir": checkpoint.dirpath, "best_checkpoint": checkpoint.best_model_path,
            "metrics_csv": metrics_csv, "tensorboard_dir": loggers[1].log_dir if len(loggers) > 1 else None,
            "fit_seconds": wall, "steps_per_s": steps / wall if wall > 0 else float("nan"), "val_history": hist,
            "run_info": info, "world_size": trainer.world_size, "tokenizer": describe(tok),
            "n_params": sum(q.numel() for q in model.model.parameters())}
