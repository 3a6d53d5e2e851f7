"""Hydra app: fine-tune T5 with ZeRO (lightning_zero) on the embedded stdlib code-summarisation set.

    python examples/t5_finetune.py                       # CPU, 2 ranks, ZeRO-2, t5_mini, 2048-token BPE
    python examples/t5_finetune.py model.pretrained=outputs/t5_pretrain/.../hf_model   # from t5_pretrain.py
    python examples/t5_finetune.py mode=test ckpt_path=outputs/.../checkpoints/last.ckpt   # test + predictions
    python examples/t5_finetune.py ckpt_path=outputs/.../checkpoints/last.ckpt   # resume the fit (exact, mid-epoch too)
    python examples/t5_finetune.py strategy=zero1_offload trainer.max_steps=200
    python examples/t5_finetune.py -m strategy=zero0,zero1,zero2 trainer.max_steps=100
    python examples/t5_finetune.py trainer=gpu model=t5_small

Configs live in ../conf (schema: t5_config.py).  Outputs go to Hydra's run dir:
``checkpoints/`` (ModelCheckpoint on val_loss + last.ckpt), ``csv/metrics.csv``, ``tb/`` (TensorBoard, with
the validation samples as text), ``samples.jsonl``, ``hf_model/`` (``save_pretrained`` model + tokenizer).

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

import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

# Never reach the network at run time (set before transformers is imported anywhere).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# examples/ is not a package: make its modules importable however this file is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from t5_config import (  # noqa: E402,F401  (importing registers the schemas in the ConfigStore)
    ConfigError, build_datamodule, build_strategy, build_tokenizer, strategy_kwargs, validate_schema)
from t5_attention import check_attention, describe_attention  # noqa: E402
from t5_optim import check_optimizer, optimizer_kwargs  # noqa: E402
from t5_run import (  # noqa: E402,F401  (resolve_start_method, output_dir: part of this app's API)
    checked_ckpt_path, eval_trainer, fit_and_report, fmt_metric, make_trainer, one_line_per_message, output_dir,
    resolve_start_method, run_report, set_cpu_threads, summary_lines)
from t5_samples import console_table, last_samples  # noqa: E402
from t5_tokenizer import describe  # noqa: E402

log = logging.getLogger("t5_finetune")
METRICS = ("loss", "token_acc", "chrf", "sacrebleu", "rougeL")


def build_model(cfg: DictConfig, tok, out: str):
    from omegaconf import OmegaConf
    from t5_module import T5FineTuner

    try:
        return T5FineTuner(
            preset=cfg.model.preset, tokenizer=tok, pretrained=cfg.model.pretrained,
            lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, warmup_steps=cfg.optim.warmup_steps,
            total_steps=cfg.optim.total_steps, lr_schedule=cfg.optim.schedule,
            label_smoothing=cfg.optim.label_smoothing, num_gen_batches=cfg.model.num_gen_batches,
            max_new_tokens=cfg.model.max_new_tokens, dropout_rate=cfg.model.dropout_rate,
            no_repeat_ngram_size=cfg.model.no_repeat_ngram_size, num_samples=cfg.model.num_samples,
            samples_path=os.path.join(out, "samples.jsonl"),
            predictions_path=cfg.output.predictions or os.path.join(out, "test_predictions.jsonl"),
            attention=cfg.model.attention, sparse_attention=OmegaConf.to_container(cfg.model.sparse, resolve=True),
            **optimizer_kwargs(cfg), **OmegaConf.to_container(cfg.model.config_overrides, resolve=True))
    except FileNotFoundError as e:
        raise ConfigError(f"model.pretrained: {e}") from e
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e


# --------------------------------------------------------------------------- the job
def train(cfg: DictConfig) -> Optional[dict]:
    """Build everything from ``cfg``, fit (or test), and return a summary on global rank 0 (None elsewhere)."""
    import lightning as L

    # 1. validate what can be validated before any process starts
    validate_schema(cfg)
    if cfg.mode not in ("fit", "test"):
        raise ConfigError(f"Unknown mode {cfg.mode!r}. Allowed: 'fit', 'test'.")
    check_attention(cfg)  # model.attention and every model.sparse knob
    ckpt_path = checked_ckpt_path(cfg)
    one_line_per_message()
    resolve_start_method(cfg)
    strategy = build_strategy(cfg)  # ConfigError names the allowed values
    check_optimizer(cfg, strategy)  # optim.name and its knobs, and whether it composes with that strategy
    out = output_dir(cfg)
    set_cpu_threads(cfg)

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    dm = build_datamodule(cfg)
    dm.setup("fit")  # build/load the pairs once here: forked/spawned ranks inherit them
    if not dm.splits["train"] or not dm.splits["val"]:
        raise ConfigError(f"data={cfg.data.kind}: empty split (train={len(dm.splits['train'])}, "
                          f"val={len(dm.splits['val'])}); give more pairs or raise data.limit_*.")
    tok = dm.tokenizer = build_tokenizer(cfg, dm.splits["train"])
    model = build_model(cfg, tok, out)
    if cfg.mode == "test":
        return test(cfg, strategy, model, dm, out)

    # 2. trainer
    report = run_report(out, tok, cfg.output.export_hf)
    trainer, checkpoint, csv_logger, loggers = make_trainer(cfg, strategy, out, "val_loss", [report], dm)
    if trainer.is_global_zero:
        log.info("strategy=%s %s | model=%s | attention: %s | tokenizer=%s | %d ranks on %s | output: %s%s",
                 cfg.strategy.name, strategy_kwargs(cfg), cfg.model.pretrained or cfg.model.preset,
                 describe_attention(model.model), describe(tok), trainer.world_size, cfg.trainer.accelerator, out,
                 f" | resuming from {ckpt_path}" if ckpt_path else "")

    # 3. fit (after an optional baseline validation of the untrained model: the "step 0" point; a resumed
    # run's model is not untrained, so it has none)
    baseline: dict = {}
    if cfg.trainer.validate_before_fit and ckpt_path is None:
        res = eval_trainer(cfg, build_strategy(cfg), out).validate(model, datamodule=dm, verbose=False)
        baseline = {k: float(v) for k, v in (res[0] if res else {}).items()}
        baseline["step"] = 0
    summary = fit_and_report(trainer, model, dm, out, checkpoint, csv_logger, loggers, tok, ckpt_path)
    if summary is None:
        return None
    hist = summary["val_history"]
    summary.update(attention=describe_attention(model.model), baseline_val=baseline, first_val=hist[0] if hist else {}, last_val=hist[-1] if hist else {},
                   samples=last_samples(os.path.join(out, "samples.jsonl")))
    print(format_summary(cfg, strategy, summary), flush=True)
    return summary


def format_summary(cfg: DictConfig, strategy, s: dict) -> str:
    lines = summary_lines("t5_finetune", cfg, strategy, s)
    b, f, last = s["baseline_val"], s["first_val"], s["last_val"]
    if f:
        cols = ([("before fit", b)] if b else []) + [("first val", f), ("last val", last)]
        lines.append(f"{'':<16}" + "".join(f"{name:>11}" for name, _ in cols))
        # the CSV "step" of a validation row is the index of the last training step (0-based)
        steps = [0 if r is b else r.get("step", -2) + 1 for _, r in cols]
        lines.append(f"{'after N steps':<16}" + "".join(f"{n:>11}" for n in steps))
        for k in METRICS:
            lines.append(f"{'val_' + k:<16}" + "".join(f"{fmt_metric(r, 'val_' + k):>11}" for _, r in cols))
    else:
        lines.append("no validation ran (raise trainer.max_steps or lower trainer.val_check_interval)")
    smp = s.get("samples")
    if smp and smp.get("rows"):
        lines.append(f"samples (validation after step {smp['step']}: function head / reference / generated):")
        lines.append(console_table(smp["rows"]))
    return "\n".join(lines)


def test(cfg: DictConfig, strategy, model, dm, out: str) -> Optional[dict]:
    """mode=test: test-split metrics of ``ckpt_path`` (or of the model as configured) + predictions JSONL."""
    from lightning.pytorch.loggers import CSVLogger

    checked_ckpt_path(cfg)
    trainer = eval_trainer(cfg, strategy, out, logger=CSVLogger(save_dir=out, name="csv_test", version=""))
    t0 = time.time()
    res = trainer.test(model, datamodule=dm, ckpt_path=cfg.ckpt_path, verbose=False)
    if not trainer.is_global_zero:
        return None
    metrics = {k: float(v) for k, v in (res[0] if res else {}).items()}
    path = model.hparams.predictions_path
    lines = [f"== t5_finetune mode=test done in {time.time() - t0:.0f}s: {len(dm.splits['test'])} test pairs, "
             f"checkpoint {cfg.ckpt_path or '(none: the model as configured)'} ==",
             f"predictions:  {path}"]
    lines += [f"{'test_' + k:<16}{fmt_metric(metrics, 'test_' + k):>11}" for k in METRICS]
    print("\n".join(lines), flush=True)
    return {"output_dir": out, "test_metrics": metrics, "predictions": path}


@hydra.main(config_path="../conf", config_name="t5_finetune", version_base="1.3")
def main(cfg: DictConfig) -> Optional[float]:
    try:
        summary = train(cfg)
    except ConfigError as e:
        raise SystemExit(f"t5_finetune: config error: {e}") from None
    # Returned to Hydra (sweepers such as optuna minimise it); None on ranks > 0.
    if summary and summary.get("last_val"):
        return summary["last_val"].get("val_loss")
    return None


if __name__ == "__main__":
    main()
