"""Convergence of low-precision optimizer states: val loss at equal steps, bf16 vs fp32 masters and moments.

Every run trains in bf16 mixed precision (bf16 parameters and compute) on 2 gloo ranks, from the same seed on
the same data; the runs differ only in what the optimizer keeps between steps
([Note: low-precision optimizer states], lightning_zero/engine/optim/low_precision.py):

* ``fp32``: fp32 masters and fp32 Adam moments (the default, 16 B/param of model states with the gradient);
* ``bf16``: ``optimizer_state_dtype="bf16"`` + ``master_dtype="bf16"`` -- bf16 moments, the master the bf16
  parameter itself plus a bf16 Kahan compensation term;
* ``bf16_nocomp`` (ABLATION, not a mode of the package): as ``bf16`` with every compensation tensor
  (``sharded.low_precision.compensation``) zeroed after every optimizer step, i.e. a plain bf16 master rounded
  to nearest after each update -- what the compensation buys.

Workloads:

* ``t5``: the T5 recipe (examples/t5_finetune.py, its ``train()``) on its embedded default data (the stdlib
  code-summarisation pairs, the recipe's BPE), model ``t5_mini``, the recipe's AdamW with LR warmup and linear
  decay, ``trainer.precision=bf16-mixed``; the val loss is the recipe's validation (its first 64 val pairs,
  ``data.limit_val``) every ``--t5-every`` steps. The knobs reach the recipe's ``ZeroStrategy`` through its
  ``build_strategy``.
* ``gpt2``: HF ``GPT2LMHeadModel`` from a config (random init, no download; 4 layers, 256 wide) on real text:
  the Python stdlib source the T5 pretraining recipe reads (examples/t5_pretrain_data.pretrain_files), tokenized
  by the recipe's BPE, cut into 64-token chunks, 1 chunk in 20 held out; ``ZeroEngine(compute_dtype=bf16)``,
  torch AdamW (lr 1e-3, wd 0.01) with linear warmup and linear decay, clip 1.0; the val loss over 16 held-out
  batches every ``--gpt2-every`` steps.

Reported: the val loss of each run at every evaluation and its relative difference to the ``fp32`` run of the
same stage (target: within 1%), and the training loss curve (mean over each window of steps, rank 0). Run::

    python bench/low_precision_convergence.py   # both workloads, zero2 + zero3, ablation at zero2: ~27 min, load 10
    python bench/low_precision_convergence.py --workloads gpt2 --gpt2-steps 60 --stages zero2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the recipe's modules (examples/ is not a package)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VARIANTS = {  # name -> (optimizer_state_dtype, master_dtype, zero the compensation after each step)
    "fp32": ("fp32", "fp32", False),
    "bf16": ("bf16", "bf16", False),
    "bf16_nocomp": ("bf16", "bf16", True),
}


def drop_compensation(engine) -> None:
    """The ablation: a plain bf16 master, i.e. what rounding dropped is forgotten after every step."""
    for sharded in engine.shardeds:
        for lo in sharded.low_precision.compensation.values():
            lo.zero_()


# --------------------------------------------------------------------------- T5 recipe
def run_t5(stage: str, variant: str, args, out: str) -> dict:
    import lightning as L
    from hydra import compose, initialize_config_dir

    import t5_finetune
    from lightning_zero import ZeroStrategy
    from t5_config import strategy_kwargs

    state_dtype, master_dtype, nocomp = VARIANTS[variant]

    def build_strategy(cfg):  # the recipe's, with the two knobs (programmatic: no Hydra field needed)
        return ZeroStrategy(**{**strategy_kwargs(cfg), "optimizer_state_dtype": state_dtype,
                               "master_dtype": master_dtype})

    class DropCompensation(L.Callback):
        def on_train_batch_end(self, trainer, *_):
            drop_compensation(trainer.strategy.engine)

    make_trainer = t5_finetune.make_trainer

    def make_trainer_with(cfg, strategy, out_dir, monitor, extra, dm):
        return make_trainer(cfg, strategy, out_dir, monitor, list(extra) + ([DropCompensation()] if nocomp else []),
                            dm)

    overrides = [
        f"strategy={stage}", f"model={args.t5_model}", "trainer=cpu", "trainer.devices=2",
        "trainer.precision=bf16-mixed", f"trainer.max_steps={args.t5_steps}",
        f"trainer.val_check_interval={args.t5_every}", "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false", "trainer.validate_before_fit=false", "model.num_gen_batches=0",
        "model.num_samples=0", f"seed={args.seed}", "output.tensorboard=false", "output.export_hf=false",
        "output.save_top_k=0", "output.save_last=false", f"output.dir={out}/t5_{stage}_{variant}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("t5_finetune", overrides=overrides)
    saved = t5_finetune.build_strategy, t5_finetune.make_trainer
    t5_finetune.build_strategy, t5_finetune.make_trainer = build_strategy, make_trainer_with
    try:
        t0 = time.perf_counter()
        s = t5_finetune.train(cfg)
    finally:
        t5_finetune.build_strategy, t5_finetune.make_trainer = saved
    val = {int(h["step"]) + 1: float(h["val_loss"]) for h in s["val_history"]}  # CSV step: before the update
    return dict(val=val, train=_train_losses(s["metrics_csv"]), seconds=time.perf_counter() - t0,
                n_params=s["n_params"], what=f"T5 recipe, {args.t5_model}, warmup {cfg.optim.warmup_steps} steps "
                f"then {cfg.optim.schedule} decay, lr {cfg.optim.lr}, batch {cfg.data.batch_size}/rank")


def _train_losses(metrics_csv: str) -> dict[int, float]:
    import csv

    out = {}
    with open(metrics_csv, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("train_loss"):
                out[int(r["step"]) + 1] = float(r["train_loss"])  # the CSV's step is the one before the update
    return out


# --------------------------------------------------------------------------- GPT-2 on stdlib text
GPT2_SEQ, GPT2_BATCH, GPT2_VAL_BATCHES = 64, 8, 16


def gpt2_chunks(args) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train chunks, val chunks, vocab) of the stdlib source text, tokenized by the recipe's BPE."""
    from hydra import compose, initialize_config_dir

    from t5_config import build_datamodule, build_tokenizer
    from t5_pretrain_data import pretrain_files
    from t5_tokenizer import tokenizer_vocab

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("t5_finetune")  # the recipe's defaults: its data and its BPE (cached where it caches it)
    dm = build_datamodule(cfg)
    dm.setup("fit")
    tok = build_tokenizer(cfg, dm.splits["train"])
    texts = [t for _, t in pretrain_files()[: args.gpt2_files]]
    stream: list[int] = []
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        stream += ids + [tok.eos_token_id]
    n = len(stream) // GPT2_SEQ
    chunks = torch.tensor(stream[: n * GPT2_SEQ], dtype=torch.long).view(n, GPT2_SEQ)
    held = torch.arange(n) % 20 == 0
    return chunks[~held], chunks[held], tokenizer_vocab(tok)


def gpt2_body(rank: int, world: int, stage: str, variant: str, args, train, val, vocab) -> dict:
    import transformers

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    transformers.logging.set_verbosity_error()
    state_dtype, master_dtype, nocomp = VARIANTS[variant]
    torch.manual_seed(args.seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=GPT2_SEQ, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.gpt2_lr, weight_decay=0.01)
    warm, total = args.gpt2_warmup, args.gpt2_steps
    sched = torch.optim.lr_scheduler.LambdaLR(  # the recipe's schedule: linear warmup, linear decay to 0
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))
    engine = ZeroEngine(model, opt, ZeroConfig(stage=int(stage[-1]), optimizer_state_dtype=state_dtype,
                                               master_dtype=master_dtype), compute_dtype=torch.bfloat16)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    train_losses, vals = {}, {}
    for step in range(1, total + 1):
        model.train()
        i = ((step - 1) * world + rank) * GPT2_BATCH
        idx = order[torch.arange(i, i + GPT2_BATCH) % len(train)]
        toks = train[idx]
        loss = model(toks, labels=toks).loss
        loss.backward()
        engine.clip_grad_norm_(1.0)
        engine.step()
        if nocomp:
            drop_compensation(engine)
        sched.step()
        train_losses[step] = loss.item()
        if step % args.gpt2_every == 0 or step == total:
            model.eval()
            with torch.no_grad():
                vals[step] = statistics.fmean(
                    model(t, labels=t).loss.item() for t in val[: GPT2_VAL_BATCHES * GPT2_BATCH].split(GPT2_BATCH))
    mem = engine.memory_report()  # after the last step: what a rank holds between steps
    return dict(val=vals, train=train_losses, n_params=n_params, mem=mem.as_dict())


def run_gpt2(stage: str, variant: str, args, data) -> dict:
    from lightning_zero.tools.launch import run_ranks

    t0 = time.perf_counter()
    r = run_ranks(gpt2_body, 2, (stage, variant, args, *data), timeout_s=3600)[0]
    r.update(seconds=time.perf_counter() - t0, what=(
        f"HF GPT-2 from config (4 x 256, vocab {data[2]}), stdlib source text ({len(data[0])} train / "
        f"{len(data[1])} val chunks of {GPT2_SEQ} tokens, {args.gpt2_files} files), batch {GPT2_BATCH}/rank, "
        f"AdamW lr {args.gpt2_lr} wd 0.01, warmup {args.gpt2_warmup} then linear decay, clip 1.0"))
    return r


# --------------------------------------------------------------------------- report
def runs_of(args) -> list[tuple[str, str]]:
    runs = [(s, v) for s in args.stages.split(",") for v in ("fp32", "bf16")]
    return runs + [(s, "bf16_nocomp") for s in args.ablation_stages.split(",") if s]


def report(workload: str, rows: dict, every: int, steps: int) -> None:
    first = next(iter(rows.values()))
    print(f"\n### {workload}: {first['what']}; {first['n_params'] / 1e6:.2f} M params, 2 gloo ranks, bf16 mixed "
          f"precision, {steps} steps\n")
    evals = sorted(first["val"])
    print("| stage | states | " + " | ".join(f"val @ {s} (vs fp32)" for s in evals) + " | fit |")
    print("|---|---|" + "---:|" * len(evals) + "---:|")
    for (stage, variant), r in rows.items():
        ref = rows.get((stage, "fp32"))
        label = variant + (" (ABLATION: compensation zeroed every step)" if variant == "bf16_nocomp" else "")
        cells = [f"{r['val'][s]:.4f}" + (f" ({100 * (r['val'][s] / ref['val'][s] - 1):+.2f}%)" if ref else "")
                 for s in evals]
        print(f"| {stage} | {label} | " + " | ".join(cells) + f" | {r['seconds']:.0f} s |")
    print(f"\n{workload} training loss (rank 0, mean over each window of {every} steps):\n")
    windows = [(a, min(a + every - 1, steps)) for a in range(1, steps + 1, every)]
    print("| stage | states | " + " | ".join(f"{a}-{b}" for a, b in windows) + " |")
    print("|---|---|" + "---:|" * len(windows))
    for (stage, variant), r in rows.items():
        cells = []
        for a, b in windows:
            xs = [v for k, v in r["train"].items() if a <= k <= b]
            cells.append(f"{statistics.fmean(xs):.3f}" if xs else "-")
        print(f"| {stage} | {variant} | " + " | ".join(cells) + " |")
    mems = {k: r["mem"] for k, r in rows.items() if "mem" in r}
    if mems:
        n = first["n_params"]
        print(f"\n{workload} model states of rank 0 after the last step (engine.memory_report(), bytes per "
              f"parameter element of the model; 2 ranks):\n")
        print("| stage | states | params | grad shards | masters + compensation | optimizer state | model states |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for (stage, variant), m in mems.items():
            print(f"| {stage} | {variant} | " + " | ".join(f"{m[k] / n:.2f}" for k in (
                "params", "grad_shards", "master", "optimizer_state", "model_states")) + " |")


def dump(path, workload: str, rows: dict) -> None:
    if path:
        import json

        old = json.load(open(path)) if os.path.exists(path) else {}
        old[workload] = {f"{s}/{v}": r for (s, v), r in rows.items()}
        with open(path, "w") as f:
            json.dump(old, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="t5,gpt2", help="t5, gpt2 or both")
    ap.add_argument("--stages", default="zero2,zero3")
    ap.add_argument("--ablation-stages", default="zero2", help="stages with the bf16_nocomp row ('' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--t5-model", default="t5_mini")
    ap.add_argument("--t5-steps", type=int, default=300)
    ap.add_argument("--t5-every", type=int, default=50)
    ap.add_argument("--gpt2-steps", type=int, default=300)
    ap.add_argument("--gpt2-every", type=int, default=50)
    ap.add_argument("--gpt2-warmup", type=int, default=30)
    ap.add_argument("--gpt2-lr", type=float, default=1e-3)
    ap.add_argument("--gpt2-files", type=int, default=400, help="stdlib files of the text (train-split modules)")
    ap.add_argument("--json", default=None, help="write every run's losses and bytes here")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    bad = [w for w in workloads if w not in ("t5", "gpt2")] + [
        s for s in (args.stages + "," + args.ablation_stages).split(",") if s and s not in ("zero1", "zero2", "zero3")]
    if bad:
        ap.error(f"unknown {', '.join(bad)}: allowed workloads t5, gpt2; stages zero1, zero2, zero3")
    with tempfile.TemporaryDirectory() as out:
        if "t5" in workloads:
            _workload("t5", "T5 recipe", lambda stage, variant: run_t5(stage, variant, args, out), args,
                      args.t5_every, args.t5_steps)
        if "gpt2" in workloads:
            data = gpt2_chunks(args)
            _workload("gpt2", "GPT-2", lambda stage, variant: run_gpt2(stage, variant, args, data), args,
                      args.gpt2_every, args.gpt2_steps)


def _workload(key: str, title: str, run, args, every: int, steps: int) -> None:
    """Every (stage, variant) run of one workload, its table printed and its rows dumped."""
    rows = {}
    for stage, variant in runs_of(args):
        rows[(stage, variant)] = run(stage, variant)
        print(f"{key} {stage} {variant}: {rows[(stage, variant)]['seconds']:.0f} s", flush=True)
    report(title, rows, every, steps)
    dump(args.json, key, rows)


if __name__ == "__main__":
    main()
