"""The trade of the bounded buffer pool (issue 45): zero1/2/3 step time with the code before the issue and
with this code, FSDP2 in the same runs, interleaved repetitions, and the bytes each holds beside it.

What it measures
----------------
The code before the issue kept up to six free communication buffers from one step to the next (a CPU rank
then never page-faults a fresh one); this code drops every free buffer when a backward or a step ends
(``engine/comm/buffer_pool.py``), so each phase's first use of a buffer makes it anew. Two code trees cannot
share one process, so each repetition runs one child process per tree (``PYTHONPATH`` = that tree), the
order alternating between repetitions; each child runs ``harness.run_rounds`` over ``fsdp2``, ``zero1``,
``zero2``, ``zero3`` on HF T5 built from its config (``--model``, default T5-small, random init), AdamW,
2 gloo ranks, one thread each: the methods take one step each in turn, a barrier and an untimed lead-in
step before every timed step, a step's time the max over ranks (see ``harness.py``). FSDP2 does not depend
on the tree, so its per-cycle ratio cancels the load of the shared machine between children.

Reported per tree and method: the median step time over all timed steps of all repetitions, the median of
the per-cycle ratios to FSDP2, and the bytes after a backward (``memory_report()``: model states + the
engine's communication buffers; FSDP2: its local shards); then after / before of both.

Run::

    python bench/pool_step_time.py --before /work/wt/base45      # ~30 minutes on 2 cores at load 10-12
    python bench/pool_step_time.py --before ../base --model t5_mini --reps 2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import build, launch, print_and_dump, run_rounds  # noqa: E402
from rounds_summary import cycle_ratio  # noqa: E402
from seed_table import make_t5, t5_block_class, t5_config  # noqa: E402
from lightning_zero.tools.tuning.harness import t5_batch  # noqa: E402

METHODS = ("fsdp2", "zero1", "zero2", "zero3")


def hf_loss(module, batch) -> torch.Tensor:
    return module(**batch).loss


def child_body(rank: int, args) -> dict:
    batches = [t5_batch(args, rank, i, args.batch, torch.device("cpu")) for i in range(args.warmup + args.steps)]
    k = args.rotate % len(METHODS)
    order = list(METHODS[k:] + METHODS[:k])
    build_fn = lambda m, a: build(m, a, make_model=make_t5, block_class=t5_block_class())  # noqa: E731
    return run_rounds(order, args, batches, rank, build_fn, hf_loss)


def run_child(tree: str, rep: int, args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "child.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--model", args.model,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--src-len", str(args.src_len), "--tgt-len", str(args.tgt_len), "--rotate", str(rep)]
        subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per tree and method: median step time, median per-cycle ratio to FSDP2, bytes after a backward."""
    out: dict[str, dict] = {}
    for tree, reps in runs.items():
        out[tree] = {}
        for m in METHODS:
            rounds = [r for rep in reps for r in rep[m] if "times_ms" in r]
            if not rounds:
                out[tree][m] = {"error": next((r["error"] for rep in reps for r in rep[m] if "error" in r), "-")}
                continue
            ratios = [cycle_ratio([r], [f]) for rep in reps for r, f in zip(rep[m], rep["fsdp2"])
                      if "times_ms" in r and "times_ms" in f]
            mem = rounds[-1]["memory"]
            out[tree][m] = {
                "median_ms": statistics.median(t for r in rounds for t in r["times_ms"]),
                "step_phase_ms": statistics.median(p[2] for r in rounds for p in r["phases_ms"]),
                "vs_fsdp2": statistics.median(ratios) if ratios else None,
                "rep_medians_ms": [statistics.median(r["times_ms"]) for r in rounds],
                "state_bytes": int(mem["model_states"]) + int(mem.get("comm_buffers", 0)),
                "comm_buffers": int(mem.get("comm_buffers", 0)),
            }
    return out


def print_table(s: dict, args, numel: int) -> list[str]:
    before, after = s["before"], s["after"]
    lines = [
        f"model: T5 {args.model} from its config, Psi = {numel:,}; AdamW; 2 ranks gloo, 1 thread each; batch "
        f"{args.batch}/rank, src {args.src_len} / tgt {args.tgt_len}; {args.reps} repetitions x (before, after "
        f"alternating), each {args.warmup} warm-up + {args.steps} timed cycles; before = {args.before}, after = "
        f"{args.after}",
        "",
        "| method | median ms before -> after | x | optimizer-step phase ms before -> after | vs FSDP2 before -> "
        "after | x | state after backward MiB before -> after | of which buffers MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    for m in METHODS:
        b, a = before.get(m, {}), after.get(m, {})
        if "error" in a or "error" in b:
            lines.append(f"| {m} | FAILED: before {b.get('error', 'ok')}; after {a.get('error', 'ok')} |")
            continue
        vs = (f"{b['vs_fsdp2']:.3f} -> {a['vs_fsdp2']:.3f} | {a['vs_fsdp2'] / b['vs_fsdp2']:.3f}"
              if m != "fsdp2" else "1 -> 1 | -")
        lines.append(
            f"| {m} | {b['median_ms']:.0f} -> {a['median_ms']:.0f} | {a['median_ms'] / b['median_ms']:.3f} "
            f"| {b['step_phase_ms']:.0f} -> {a['step_phase_ms']:.0f} | {vs} "
            f"| {mib(b['state_bytes'])} -> {mib(a['state_bytes'])} | {mib(b['comm_buffers'])} -> "
            f"{mib(a['comm_buffers'])} |")
    lines.append("per-repetition medians ms (before | after): " + "; ".join(
        f"{m} {[round(x) for x in before[m].get('rep_medians_ms', [])]} | "
        f"{[round(x) for x in after[m].get('rep_medians_ms', [])]}" for m in METHODS))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=None, metavar="PATH", help="a checkout of the code before the issue")
    p.add_argument("--after", default=os.path.dirname(HERE), metavar="PATH", help="default: this checkout")
    p.add_argument("--model", default="t5_small", help="preset of lightning_zero/tools/t5_dims.T5_PRESETS")
    p.add_argument("--reps", type=int, default=3, help="repetitions (each: one child per tree)")
    p.add_argument("--steps", type=int, default=5, help="timed cycles per child")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--src-len", type=int, default=32)
    p.add_argument("--tgt-len", type=int, default=16)
    p.add_argument("--rotate", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.reps < 1:
        p.error("--steps, --warmup and --reps must be >= 1")
    args.lr, args.seed, args.bucket_mb, args.backend, args.threads, args.rounds = 1e-4, 0, 25.0, "gloo", 1, 1
    args.vocab = t5_config(args).vocab_size
    if args.child:
        with open(args.child, "w") as f:
            json.dump(launch(child_body, args), f)
        return
    for knob in ("before", "after"):
        tree = getattr(args, knob)
        if tree is None or not os.path.isdir(os.path.join(tree, "lightning_zero")):
            p.error(f"--{knob} {tree!r}: give a checkout holding lightning_zero/ (before: the code before the issue)")
    t0 = time.perf_counter()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for rep in range(args.reps):
        for tree in (("before", "after") if rep % 2 == 0 else ("after", "before")):
            runs[tree].append(run_child(os.path.abspath(getattr(args, tree)), rep, args))
            print(f"  repetition {rep + 1}/{args.reps}: {tree} done", file=sys.stderr, flush=True)
    s = summarize(runs)
    numel = next(r["numel"] for r in runs["after"][0]["zero1"] if "numel" in r)
    print_and_dump(print_table(s, args, numel), t0, args, {"summary": s, "runs": runs})


if __name__ == "__main__":
    main()
