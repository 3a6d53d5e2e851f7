"""Hydra app: fine-tune T5 with ZeRO (lightning_zero) on the embedded stdlib code-summarisation set.

    python examples/t5_finetune.py                       # CPU, 2 ranks, ZeRO-2, t5_mini: ~8-9 min on 2 cores
    python examples/t5_finetune.py strategy=zero1_offload trainer.max_steps=200
    python examples/t5_finetune.py -m strategy=zero0,zero1,zero2 trainer.max_steps=100
    python examples/t5_finetune.py trainer=gpu model=t5_small

Configs live in ../conf (schema: t5_config.py).  Outputs go to Hydra's run dir:
``checkpoints/`` (ModelCheckpoint on val_loss + last.ckpt), ``csv/metrics.csv``, ``tb/`` (TensorBoard).

Design note -- Hydra and the multi-process launchers
----------------------------------------------------
* ``fork`` (the cpu trainer preset): ranks are forked inside the Hydra job, so they share its run dir and
  config; works for single runs and ``-m`` multiruns.  The parent prepares the data once before forking.
* ``popen`` (the gpu preset; Lightning's default for scripts): rank 0 re-runs ``sys.argv`` for ranks >= 1
  and Lightning appends ``hydra.run.dir=<parent's run dir> hydra.output_subdir=null``, so a single run
  keeps one run dir.  Under ``-m`` that replay is wrong (each child would run the whole sweep, with a run
  dir that is not the sweep job's), so a multirun switches popen to ``spawn`` with a warning.
* ``spawn`` pickles the trainer/module/data to fresh interpreters (slow start on small machines).
"""
from __future__ import annotations

import csv
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

# Never reach the network at run time (set before transformers is imported anywhere).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# examples/ is not a package: make its modules importable however this file is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from t5_config import (  # noqa: E402,F401  (importing registers the schemas in the ConfigStore)
    ConfigError, build_datamodule, build_strategy, strategy_kwargs, validate_schema)

log = logging.getLogger("t5_finetune")


# --------------------------------------------------------------------------- helpers
def _hydra_cfg() -> Optional[Any]:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def output_dir(cfg: DictConfig) -> str:
    """cfg.output.dir, else Hydra's run dir (sweep job dir under -m), else outputs/t5_finetune/<time>."""
    if cfg.output.dir:
        return os.path.abspath(os.path.expanduser(cfg.output.dir))
    hc = _hydra_cfg()
    if hc is not None:
        return hc.runtime.output_dir
    return os.path.abspath(os.path.join("outputs", "t5_finetune", time.strftime("%Y-%m-%d_%H-%M-%S")))


def resolve_start_method(cfg: DictConfig) -> None:
    """popen under a Hydra multirun replays the whole sweep in every child: use spawn there instead."""
    from hydra.types import RunMode

    hc = _hydra_cfg()
    s = cfg.strategy
    if s.start_method == "popen" and hc is not None and hc.mode == RunMode.MULTIRUN \
            and os.environ.get("LOCAL_RANK") is None:
        log.warning("strategy.start_method=popen re-runs sys.argv per rank, which under a Hydra multirun (-m) "
                    "would replay the sweep in every child; using 'spawn' for this multirun instead "
                    "(or set strategy.start_method=fork on CPU).")
        s.start_method = "spawn"


def _num_devices(cfg: DictConfig) -> int:
    d = cfg.trainer.devices
    if isinstance(d, int):
        return d
    if isinstance(d, str) and d.strip().lstrip("-").isdigit():
        return int(d)
    if OmegaConf.is_list(d) or isinstance(d, (list, tuple)):
        return len(d)
    return os.cpu_count() or 1  # "auto" on CPU: one rank per core


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


def read_val_history(metrics_csv: str) -> list[dict]:
    """Validation rows of a Lightning CSVLogger metrics.csv, in step order."""
    if not os.path.isfile(metrics_csv):
        return []
    rows = []
    with open(metrics_csv, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("val_loss"):
                rows.append({k: (float(v) if k != "step" else int(float(v))) for k, v in r.items()
                             if v not in ("", None) and k.startswith(("val_", "step"))})
    return sorted(rows, key=lambda r: r.get("step", 0))


# --------------------------------------------------------------------------- the job
def train(cfg: DictConfig) -> Optional[dict]:
    """Build everything from ``cfg``, fit, and return a summary on global rank 0 (None elsewhere)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from t5_data import ByteTokenizer
    from t5_module import T5FineTuner

    # 1. validate what can be validated before any process starts
    validate_schema(cfg)
    resolve_start_method(cfg)
    strategy = build_strategy(cfg)  # ConfigError names the allowed values
    out = output_dir(cfg)
    n_dev = _num_devices(cfg)
    if cfg.trainer.accelerator == "cpu":
        # one rank per core: more threads than cores only makes the ranks fight
        threads = max(1, (os.cpu_count() or 1) // max(1, n_dev))
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    tok = ByteTokenizer()
    dm = build_datamodule(cfg, tok)
    dm.setup("fit")  # build/load the pairs once here: forked/spawned ranks inherit them
    if not dm.splits["train"] or not dm.splits["val"]:
        raise ConfigError(f"data={cfg.data.kind}: empty split (train={len(dm.splits['train'])}, "
                          f"val={len(dm.splits['val'])}); give more pairs or raise data.limit_*.")
    try:
        model = T5FineTuner(
            preset=cfg.model.preset, tokenizer=tok, pretrained=cfg.model.pretrained,
            lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, warmup_steps=cfg.optim.warmup_steps,
            total_steps=cfg.optim.total_steps, num_gen_batches=cfg.model.num_gen_batches,
            max_new_tokens=cfg.model.max_new_tokens, dropout_rate=cfg.model.dropout_rate,
            **OmegaConf.to_container(cfg.model.config_overrides, resolve=True))
    except FileNotFoundError as e:
        raise ConfigError(f"model.pretrained: {e}") from e
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e

    # 2. trainer
    ckpt_dir = os.path.join(out, "checkpoints")
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", mode="min",
                                 save_top_k=cfg.output.save_top_k, save_last=cfg.output.save_last,
                                 filename="step{step:05d}-val_loss{val_loss:.3f}", auto_insert_metric_name=False)
    csv_logger = CSVLogger(save_dir=out, name="csv", version="")
    loggers = [csv_logger]
    if cfg.output.tensorboard:
        try:
            import tensorboard  # noqa: F401

            loggers.append(TensorBoardLogger(save_dir=out, name="tb", version="", default_hp_metric=False))
        except ImportError:
            pass
    callbacks = [checkpoint, LearningRateMonitor(logging_interval="step")]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(_progress_bar(cfg))
    t = cfg.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=strategy,
        precision=t.precision, max_steps=t.max_steps, max_epochs=t.max_epochs,
        val_check_interval=t.val_check_interval, check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_val_batches=t.limit_val_batches, num_sanity_val_steps=t.num_sanity_val_steps,
        log_every_n_steps=t.log_every_n_steps, gradient_clip_val=t.gradient_clip_val,
        accumulate_grad_batches=t.accumulate_grad_batches, deterministic=t.deterministic,
        enable_progress_bar=t.enable_progress_bar, logger=loggers, callbacks=callbacks,
        default_root_dir=out,
    )
    if trainer.is_global_zero:
        kw = strategy_kwargs(cfg)
        log.info("strategy=%s %s | model=%s | %d ranks on %s | output: %s", cfg.strategy.name, kw,
                 cfg.model.preset, trainer.world_size, t.accelerator, out)

    # 3. fit (after an optional baseline validation of the untrained model: the "step 0" point)
    baseline: dict = {}
    if t.validate_before_fit:
        pre = L.Trainer(
            accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=build_strategy(cfg),
            precision=t.precision, limit_val_batches=t.limit_val_batches, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=out)
        res = pre.validate(model, datamodule=dm, verbose=False)
        baseline = {k: float(v) for k, v in (res[0] if res else {}).items()}
        baseline["step"] = 0
    t0 = time.time()
    trainer.fit(model, datamodule=dm)
    wall = time.time() - t0
    if not trainer.is_global_zero:
        return None

    # 4. report (the CSV is written by global rank 0, whichever process that was)
    hist = read_val_history(os.path.join(csv_logger.log_dir, "metrics.csv"))
    summary = {
        "output_dir": out, "checkpoint_dir": ckpt_dir, "best_checkpoint": checkpoint.best_model_path,
        "metrics_csv": os.path.join(csv_logger.log_dir, "metrics.csv"),
        "tensorboard_dir": loggers[1].log_dir if len(loggers) > 1 else None,
        "fit_seconds": wall, "val_history": hist,
        "baseline_val": baseline, "first_val": hist[0] if hist else {}, "last_val": hist[-1] if hist else {},
    }
    _print_summary(cfg, summary)
    return summary


def _print_summary(cfg: DictConfig, s: dict) -> None:
    def fmt(r: dict, k: str) -> str:
        return f"{r[k]:.3f}" if k in r and math.isfinite(r[k]) else "n/a"

    lines = [
        f"== t5_finetune done in {s['fit_seconds']:.0f}s (strategy={cfg.strategy.name}, stage "
        f"{cfg.strategy.stage}, model={cfg.model.preset}) ==",
        f"outputs:      {s['output_dir']}",
        f"checkpoints:  {s['checkpoint_dir']} (best: {os.path.basename(s['best_checkpoint']) or 'none'})",
        f"metrics csv:  {s['metrics_csv']}",
    ]
    if s["tensorboard_dir"]:
        lines.append(f"tensorboard:  tensorboard --logdir {s['tensorboard_dir']}")
    b, f, l = s["baseline_val"], s["first_val"], s["last_val"]
    if f:
        cols = ([("untrained", b)] if b else []) + [("first val", f), ("last val", l)]
        lines.append(f"{'':<14}" + "".join(f"{name:>11}" for name, _ in cols))
        # the CSV "step" of a validation row is the index of the last training step (0-based)
        steps = [0 if r is b else r.get("step", -2) + 1 for _, r in cols]
        lines.append(f"{'after N steps':<14}" + "".join(f"{n:>11}" for n in steps))
        for k in ("val_loss", "val_token_acc", "val_chrf", "val_sacrebleu", "val_rougeL"):
            lines.append(f"{k:<14}" + "".join(f"{fmt(r, k):>11}" for _, r in cols))
    else:
        lines.append("no validation ran (raise trainer.max_steps or lower trainer.val_check_interval)")
    print("\n".join(lines), flush=True)


@hydra.main(config_path="../conf", config_name="t5_finetune", version_base="1.3")
def main(cfg: DictConfig) -> Optional[float]:
    try:
        summary = train(cfg)
    except ConfigError as e:
        raise SystemExit(f"t5_finetune: config error: {e}") from None
    # Returned to Hydra (sweepers such as optuna minimise it); None on ranks > 0.
    if summary and summary["last_val"]:
        return summary["last_val"].get("val_loss")
    return None


if __name__ == "__main__":
    main()
