"""Hydra app: pretrain T5 offline with span corruption on the interpreter's stdlib source, under ZeRO.

    python examples/t5_pretrain.py                                    # CPU, 2 ranks, ZeRO-2, t5_mini
    python examples/t5_finetune.py model.pretrained=<this run's output>/hf_model
    python examples/t5_pretrain.py strategy=zero3_offload trainer.max_steps=2000

Same config groups and strategies as t5_finetune.py (conf/t5_pretrain.yaml).  The tokenizer is the one the
fine-tuning run would build (the BPE of the fine-tuning training split, from the same cache), and only the
fine-tuning *train* modules are pretrained on (t5_pretrain_data.py), so a later fine-tune's val/test pairs
stay unseen.  Output: ``hf_model/`` (``save_pretrained`` model + tokenizer), checkpoints, csv and tb logs.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from t5_config import (  # noqa: E402
    ConfigError, T5PretrainConf, build_datamodule, build_strategy, build_tokenizer, default_cache_dir,
    validate_schema)
from t5_optim import check_optimizer, optimizer_kwargs  # noqa: E402
from t5_run import (  # noqa: E402
    checked_ckpt_path, fit_and_report, fmt_metric, make_trainer, one_line_per_message, output_dir, resolve_start_method, run_report,
    set_cpu_threads, summary_lines)
from t5_tokenizer import describe  # noqa: E402

log = logging.getLogger("t5_pretrain")


def pretrain(cfg: DictConfig) -> Optional[dict]:
    """Build everything from ``cfg``, pretrain, export ``hf_model/``; a summary on global rank 0."""
    import lightning as L
    from t5_module import T5FineTuner
    from t5_pretrain_data import SpanCorruptionDataModule, held_out_summaries, pretrain_files

    validate_schema(cfg, T5PretrainConf)
    ckpt_path = checked_ckpt_path(cfg)  # resume a pretraining fit (exact, mid-epoch too)
    one_line_per_message()
    resolve_start_method(cfg)
    strategy = build_strategy(cfg)
    check_optimizer(cfg, strategy)
    out = output_dir(cfg, "t5_pretrain")
    set_cpu_threads(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    # the fine-tuning splits: their train split trains the tokenizer, their val/test pairs are held out
    ft = build_datamodule(cfg)
    full = ft._load_splits()  # before data.limit_*: hold out every val/test pair, not the first N
    ft.setup("fit")
    tok = build_tokenizer(cfg, ft.splits["train"])
    d, p = cfg.data, cfg.pretrain
    files = pretrain_files(packages=d.stdlib_packages, held_out_targets=held_out_summaries(full))
    if not files:
        raise ConfigError("no stdlib source left to pretrain on (data.stdlib_packages too narrow?).")
    dm = SpanCorruptionDataModule(
        [text for _, text in files], tok, chunk_len=p.chunk_len, batch_size=d.batch_size,
        noise_density=p.noise_density, mean_span=p.mean_span, val_every=p.val_every, max_val=p.max_val,
        seed=cfg.seed, num_workers=d.num_workers,
        cache_dir=os.path.join(d.cache_dir or default_cache_dir(), "pretrain"))
    dm.setup("fit")  # tokenise once here: forked ranks inherit the chunks
    if not dm.splits["train"] or not dm.splits["val"]:
        raise ConfigError(f"too little text for pretrain.chunk_len={p.chunk_len}: {len(dm.splits['train'])} "
                          f"train / {len(dm.splits['val'])} val chunks.")
    try:
        model = T5FineTuner(
            preset=cfg.model.preset, tokenizer=tok, pretrained=cfg.model.pretrained, lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay, warmup_steps=cfg.optim.warmup_steps,
            total_steps=cfg.optim.total_steps, lr_schedule=cfg.optim.schedule,
            label_smoothing=cfg.optim.label_smoothing, num_gen_batches=0, num_samples=0,
            max_new_tokens=cfg.model.max_new_tokens, dropout_rate=cfg.model.dropout_rate,
            **optimizer_kwargs(cfg), **OmegaConf.to_container(cfg.model.config_overrides, resolve=True))
    except FileNotFoundError as e:
        raise ConfigError(f"model.pretrained: {e}") from e
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e

    report = run_report(out, tok, export_hf=True)  # the point of pretraining is the exported directory
    trainer, checkpoint, csv_logger, loggers = make_trainer(cfg, strategy, out, "val_loss", [report], dm)
    if trainer.is_global_zero:
        log.info("pretraining on %d stdlib files (%d train / %d val chunks of %d tokens) | tokenizer=%s | "
                 "output: %s", len(files), len(dm.splits["train"]), len(dm.splits["val"]), p.chunk_len,
                 describe(tok), out)
    s = fit_and_report(trainer, model, dm, out, checkpoint, csv_logger, loggers, tok, ckpt_path)
    if s is None:
        return None
    hist, info = s["val_history"], s["run_info"]
    s["hf_model"] = info.get("hf_model")
    lines = summary_lines("t5_pretrain", cfg, strategy, s)
    lines.append(f"pretraining text: {len(files)} stdlib files, {len(dm.splits['train'])} chunks of "
                 f"{p.chunk_len} tokens, {p.noise_density:.0%} noise in spans of mean {p.mean_span:g}")
    if hist:
        lines.append(f"span-corruption val_loss: {fmt_metric(hist[0], 'val_loss')} (step {hist[0]['step'] + 1}) "
                     f"-> {fmt_metric(hist[-1], 'val_loss')} (step {hist[-1]['step'] + 1}), token acc "
                     f"{fmt_metric(hist[-1], 'val_token_acc')}")
    if s["hf_model"]:
        lines.append(f"fine-tune it:  python examples/t5_finetune.py model.pretrained={s['hf_model']}")
    print("\n".join(lines), flush=True)
    return s


@hydra.main(config_path="../conf", config_name="t5_pretrain", version_base="1.3")
def main(cfg: DictConfig) -> Optional[float]:
    try:
        s = pretrain(cfg)
    except ConfigError as e:
        raise SystemExit(f"t5_pretrain: config error: {e}") from None
    return s["val_history"][-1].get("val_loss") if s and s["val_history"] else None


if __name__ == "__main__":
    main()
