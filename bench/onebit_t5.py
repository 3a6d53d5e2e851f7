"""1-bit Adam and 0/1 Adam against AdamW in the T5 recipe (examples/t5_finetune.py) at equal steps.

Each method is one run of the recipe's own ``train()`` on its embedded default data (the stdlib
code-summarisation pairs, the BPE tokenizer), 2 CPU ranks (fork, gloo), differing only in ``optim.name`` /
``strategy``; the val loss is the recipe's validation at the last step (the whole val split, no generation).
Bytes: rank 0's ``comm_report()`` as the recipe records it (``run_info.json``: the phase totals of a compressed
Adam, the last step's bytes); DDP's: its ring all-reduce of every fp32 gradient, ``2 (N-1)/N * 4`` bytes per
parameter per step (AdamW at stage 0 measures the same, as the GPT-2 bench shows). Run::

    python bench/onebit_t5.py         # t5_mini, 150 steps, LR warmup and freeze at 30 (20%): ~10 min on 2 busy cores
    python bench/onebit_t5.py --steps 40 --freeze 8 --methods adamw_zero0,onebit_zero0
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the recipe's modules (examples/ is not a package)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

METHODS = {  # name -> recipe overrides
    "adamw_zero0": ["strategy=zero0", "optim.name=adamw"],
    "onebit_zero0": ["strategy=zero0", "optim.name=onebit_adam"],
    "zeroone_zero0": ["strategy=zero0", "optim.name=zeroone_adam"],
    "onebit_zero1": ["strategy=zero1", "optim.name=onebit_adam"],
    "adamw_zero1": ["strategy=zero1", "optim.name=adamw"],
}


def run(method: str, args, out: str) -> dict:
    from hydra import compose, initialize_config_dir

    from t5_finetune import train

    overrides = METHODS[method] + [
        f"model={args.model}", "trainer=cpu", "trainer.devices=2", f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.steps}", "trainer.enable_progress_bar=false",
        "trainer.validate_before_fit=false", "model.num_gen_batches=0", "model.num_samples=0", f"optim.freeze_step={args.freeze}",
        f"optim.warmup_steps={args.freeze if args.warmup is None else args.warmup}", f"seed={args.seed}",
        # 0/1 Adam: by default the GPT-2 bench's knobs (its local-step interval grows to 4 within the run)
        f"optim.var_update_scaler={args.var_update_scaler}",
        f"optim.local_step_scaler={args.local_step_scaler or max(1, args.steps // 8)}",
        f"optim.local_step_clipper={args.local_step_clipper}",
        "output.tensorboard=false", "output.export_hf=false", "output.save_top_k=0", "output.save_last=false",
        f"output.dir={out}/{method}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("t5_finetune", overrides=overrides)
    t0 = time.perf_counter()
    s = train(cfg)
    comm = s["run_info"]["ranks"][0]["comm"]
    return dict(val=s["last_val"]["val_loss"], n_params=s["n_params"], seconds=time.perf_counter() - t0,
                fit_seconds=s["fit_seconds"], phases=comm["phases"], last=comm["last_step_wire_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--freeze", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=None, help="LR warmup steps (default: --freeze, DeepSpeed's "
                    "guidance: the variance freezes where the LR warmup ends)")
    ap.add_argument("--var-update-scaler", type=int, default=8, help="0/1 Adam (DeepSpeed's default: 16)")
    ap.add_argument("--local-step-scaler", type=int, default=None,
                    help="0/1 Adam (default: steps // 8; DeepSpeed's: 32678, i.e. no local steps in a short run)")
    ap.add_argument("--local-step-clipper", type=int, default=4, help="0/1 Adam (DeepSpeed's default: 16)")
    ap.add_argument("--model", default="t5_mini")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="adamw_zero0,onebit_zero0,zeroone_zero0,onebit_zero1")
    args = ap.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}: allowed {', '.join(METHODS)}")
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for m in methods:
            rows[m] = run(m, args, out)
            print(f"{m}: {rows[m]['seconds']:.0f} s", flush=True)
    n = next(iter(rows.values()))["n_params"]
    ddp = 2 * (2 - 1) / 2 * 4 * n  # the ring all-reduce of every fp32 gradient, per step, this rank
    ref = rows.get("adamw_zero0", next(iter(rows.values())))["val"]
    print(f"\nT5 recipe, {args.model} ({n / 1e6:.2f} M params), 2 gloo ranks (fork), {args.steps} steps, "
          f"freeze at {args.freeze}, LR warmup {args.freeze if args.warmup is None else args.warmup}; DDP: {ddp:,.0f} B/step\n")
    print("| method | final val loss | vs AdamW | B/step, compressed phase | vs DDP | B/step, whole run | vs DDP | fit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m, r in rows.items():
        ph = r["phases"]
        steps = sum(v[0] for v in ph.values()) or args.steps
        total = sum(v[3] for v in ph.values()) if ph else r["last"] * args.steps
        comp = ph["compressed"][3] / ph["compressed"][0] if "compressed" in ph else r["last"]
        print(f"| {m} | {r['val']:.4f} | {100 * (r['val'] / ref - 1):+.2f}% | {comp:,.0f} | 1/{ddp / comp:.1f} | "
              f"{total / steps:,.0f} | 1/{ddp * steps / total:.1f} | {r['fit_seconds']:.0f} s |")
    for m, r in rows.items():
        if r["phases"]:
            lines = ["| phase | steps | calls/step | payload B/step | wire B/step |", "|---|---:|---:|---:|---:|"]
            lines += [f"| {k} | {s} | {c / s:.1f} | {p / s:,.0f} | {w / s:,.0f} |" for k, (s, c, p, w) in r["phases"].items()]
            print(f"\n{m} (rank 0, comm_report phases):\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
