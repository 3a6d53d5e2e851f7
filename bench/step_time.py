"""Step time of ZeRO stages 0-2 (and the optimizer-offload variants) against torch DDP, 2 gloo ranks.

What it measures
----------------
Wall time of one training step -- forward + backward + optimizer step, ``time.perf_counter`` around it --
of a small causal transformer LM (``nn.TransformerEncoder``, fp32, AdamW) on 2 CPU processes over gloo,
for each method:

* ``ddp``            torch ``DistributedDataParallel`` (what Lightning's ``strategy="ddp"`` wraps the model in),
                     then ``optimizer.step(); optimizer.zero_grad()``;
* ``zero0..zero2``   ``lightning_zero.ZeroEngine(model, optimizer, ZeroConfig(stage=...))``, then
                     ``loss.backward(); engine.step()`` (what ``ZeroStrategy`` / ``strategy="zero2"`` drives);
* ``zero1_offload``, ``zero2_offload``  the same with ``offload_optimizer=True``.

The harness is plain ``torch.distributed`` + ``torch.multiprocessing.spawn`` rather than a Lightning
``Trainer``: the strategies run exactly these objects per step (ZeroStrategy drives the same ZeroEngine,
Lightning's ddp drives torch DDP), and leaving the Trainer out removes its per-step bookkeeping -- noise
that is the same for every method -- from the comparison.

Built for a small, noisy machine (2 shared cores; the same method's step time moves by up to ~1.6x
between runs): each process uses ``torch.set_num_threads(1)``; every round builds all methods from the
same seed (fresh model, optimizer, DDP wrapper / engine), runs ``--warmup`` untimed steps of each, then
``--steps`` timed cycles in which the methods take one step each, in turn (A B C A B C ..., the order
rotated every round), with a barrier before every timed step and an untimed lead-in step of the same
method right before it (so what a step leaves in flight -- the overlapped parameter all-gather of
``*_overlap`` -- is paid inside the next timed step, as in training, not during the other methods' steps).
A step's time is the max over the two
ranks. Reported per method: median and p90 step time over all timed steps; the ratio to DDP as the
median over cycles of (this method's step time / DDP's step time in the same cycle), so load changes
of the shared machine cancel; model-state bytes per rank (``engine.memory_report().model_states`` taken
after a backward, before the step, with the optimizer state materialized; for DDP the bytes of the
params, their ``.grad`` and the optimizer-state tensors); the model-state floor (``lightning_zero.engine.memory.floors.model_state_floor``, fp32, Adam K=8,
offloaded bytes counted too); and the final loss (mean over ranks of the last step's loss; all methods
compute the same thing, so these must agree to ~1e-4 relative -- a mismatch is flagged).

Model, data, builders, the interleaved rounds and the spawn launcher live in ``bench/harness.py``
(shared with ``bench/peers.py`` and ``bench/cpu_optimizer.py``); this file adds the collective
microbenchmark and its own table.

Run::

    python bench/step_time.py                      # defaults: ~1-2 minutes on 2 cores
    python bench/step_time.py --rounds 7 --steps 30 --json /tmp/step_time.json
    python bench/step_time.py --methods ddp,zero2 --d-model 256 --layers 4
    python bench/step_time.py --comm-only --comm-mib 1,2.5,8,25   # the collectives alone, by bucket size
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402  -- the shared bench harness (model, data, builders, rounds, launcher)
    ALL_METHODS as HARNESS_METHODS,
    TinyLM,
    WORLD_SIZE,
    parse_interleaved_args,
    run_and_report,
    loss_check,
    loss_of,
    make_batches,
    method_floor,
    percentile,
    run_rounds,
    summarize_methods,
)

ALL_METHODS = ("ddp", "zero0", "zero1", "zero2", "zero1_offload", "zero2_offload")
# also selectable: zero1_overlap, zero2_overlap (publish overlapped with the next forward), zero1_blocking,
# zero2_blocking (gloo's reduce-scatter), zero1_allreduce, zero2_allreduce, zero*_overlap_allreduce (all-reduce
# instead of gloo's all-to-all), zero*_b1 (1 MiB buckets), zero2_q (int8), see harness.COMM_VARIANTS
__all__ = ["TinyLM", "make_batches", "loss_of", "percentile"]  # re-exported for older importers


def comm_microbench(numel: int, reps: int) -> dict:
    """Median ms of the collectives a step issues on ``numel`` fp32 elements, interleaved (A B C A B C ..., a
    barrier before each; a rep's time is the slower rank's). The engine's own entry points are timed where
    they differ from torch's flat calls: gloo's list forms, the all-gather of 2 ranks as one exchange, and
    the all-to-all reduce-scatter (``grad_reduce="all_to_all"``: one all-to-all of the rank-major rows, then
    the N rows summed here)."""
    from lightning_zero.engine.comm import collectives as C
    from lightning_zero.engine.comm import quantize as Q

    n = dist.get_world_size()
    shard = (numel + n - 1) // n
    full = torch.randn(shard * n)
    part = torch.empty(shard)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter_tensor": lambda: reduce_scatter(part, full),
        "reduce_scatter (list)": lambda: C.reduce_scatter(part, full),
        "all_to_all RS": lambda: Q.reduce_scatter_by_all_to_all(part, full),
        "all_gather_into_tensor": lambda: all_gather(full, part),
        "all_gather (engine)": lambda: C.all_gather(full, part),
    }
    t: dict[str, list[float]] = {k: [] for k in ops}
    for op in ops.values():  # one untimed call each: gloo sets up its buffers on first use
        op()
    for _ in range(reps):
        for k, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op()
            t[k].append(time.perf_counter() - t0)
    out = {}
    for k, v in t.items():
        x = torch.tensor(v, dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        out[k] = float(x.median()) * 1e3
    return out


def comm_sizes(rank: int, args) -> dict:
    """:func:`comm_microbench` at every ``--comm-mib`` size (MiB of fp32), plus the model's own Psi."""
    out = {}
    for mib in args.comm_mib:
        numel = int(mib * 2**20 / 4)
        out[f"{mib:g} MiB"] = comm_microbench(numel, reps=max(5, int(args.comm_reps * 2.5 / max(mib, 2.5))))
    return out


def body(rank: int, args) -> dict:
    if args.comm_only:
        return {"methods": {}, "comm_ms": {}, "comm_sizes_ms": comm_sizes(rank, args)}
    batches = make_batches(args.warmup + args.steps, rank, args.batch, args.seq, args.vocab)
    results = run_rounds(list(args.methods), args, batches, rank)
    numel = next(r["numel"] for rs in results.values() for r in rs if "numel" in r)
    return {"methods": results, "comm_ms": comm_microbench(numel, reps=2 * args.steps),
            "comm_sizes_ms": comm_sizes(rank, args) if args.comm_mib else {}}


# -- summary -------------------------------------------------------------------------------------------
def floor_bytes(method: str, numel: int) -> dict:
    return method_floor(method, numel)


def summarize(raw: dict, args) -> dict:
    if args.comm_only:
        return {"comm_sizes_ms": raw["comm_sizes_ms"]}
    s = summarize_methods(raw["methods"], bases=("ddp",))
    for r in s["methods"].values():
        if "ratio_vs" in r:
            r["ratio_vs_ddp"] = r["ratio_vs"].get("ddp")
    s["comm_ms"] = raw["comm_ms"]
    s["comm_sizes_ms"] = raw["comm_sizes_ms"]
    return s


def comm_table(sizes: dict) -> list[str]:
    if not sizes:
        return []
    ops = list(next(iter(sizes.values())))
    lines = [f"collectives on {WORLD_SIZE} gloo ranks, fp32, median ms (interleaved):", "",
             "| size | " + " | ".join(ops) + " |", "|---" * (len(ops) + 1) + "|"]
    for size, row in sizes.items():
        lines.append(f"| {size} | " + " | ".join(f"{row[k]:.2f}" for k in ops) + " |")
    return lines


def print_table(s: dict, args) -> list[str]:
    if args.comm_only:
        return comm_table(s["comm_sizes_ms"])
    numel = s["numel"]
    ref, bad = loss_check(s, "ddp")
    lines = [
        f"model: TransformerEncoder LM, d_model={args.d_model}, layers={args.layers}, vocab={args.vocab}, "
        f"seq={args.seq}, batch={args.batch}/rank, fp32, AdamW; Psi={numel:,} params; "
        f"{WORLD_SIZE} ranks gloo, 1 thread/rank; bucket {args.bucket_mb} MiB",
        f"rounds={args.rounds} x (warmup {args.warmup} + {args.steps} timed steps) per method, interleaved",
        "",
        f"| {'method':<13} | median ms | p90 ms | ratio vs DDP | model-state B/rank | (Psi) "
        f"| floor B | (Psi) | final loss | rel. diff |",
        "|" + "|".join(["-" * 15, "-" * 11, "-" * 8, "-" * 14, "-" * 20, "-" * 7, "-" * 16, "-" * 7, "-" * 12, "-" * 11])
        + "|",
    ]
    for m, r in s["methods"].items():
        if "error" in r:
            lines.append(f"| {m:<13} | FAILED: {r['error']} |")
            continue
        ratio = "-" if r["ratio_vs_ddp"] is None else f"{r['ratio_vs_ddp']:.3f}"
        rel = abs(r["final_loss"] - ref) / abs(ref)
        lines.append(
            f"| {m:<13} | {r['median_ms']:9.2f} | {r['p90_ms']:6.2f} | {ratio:>12} | {r['model_state_bytes']:>18,} "
            f"| {r['model_state_bytes'] / numel:5.2f} | {int(r['floor_bytes']):>14,} | {r['floor_bytes'] / numel:5.2f} "
            f"| {r['final_loss']:.6f} | {rel:9.2e} |"
        )
    lines.append("")
    lines.append("phase medians, ms (forward | backward incl. gradient reduction | optimizer step incl. param all-gather):")
    for m, r in s["methods"].items():
        if "phase_medians_ms" in r:
            ph = r["phase_medians_ms"]
            lines.append(f"  {m:<13} {ph['forward']:7.2f} | {ph['backward']:7.2f} | {ph['step']:7.2f}")
    lines.append(
        f"collectives on Psi fp32 elements ({4 * numel / 2**20:.2f} MiB), median ms: "
        + "; ".join(f"{k} {v:.2f}" for k, v in s["comm_ms"].items())
    )
    lines.append("")
    lines.append(
        "Model-state bytes: measured after a backward, before the step (optimizer state present): zero*: "
        "engine.memory_report().model_states (offload: master + optimizer state counted too; they live in host "
        "memory = the same RAM on CPU); DDP: bytes of params + .grad + optimizer.state tensors."
    )
    for m, r in s["methods"].items():
        if r.get("host_bytes"):
            lines.append(f"  {m}: of which host (offloaded) {r['host_bytes']:,} B = {r['host_bytes'] / numel:.2f} Psi")
    lines.append(
        "final loss: all methods and rounds agree within 1e-4 relative"
        if not bad else f"FINAL LOSS MISMATCH (>1e-4 relative to {ref:.6f}): {', '.join(bad)}"
    )
    lines += [""] + comm_table(s["comm_sizes_ms"])
    return lines


def _comm_args(p) -> None:
    p.add_argument("--comm-mib", default="", metavar="LIST",
                   help="also time the collectives at these sizes, MiB of fp32 (e.g. 1,2.5,8,25)")
    p.add_argument("--comm-reps", type=int, default=30, help="reps per collective at <= 2.5 MiB (fewer above)")
    p.add_argument("--comm-only", action="store_true", help="only the collective table (needs --comm-mib)")


def main() -> None:
    args = parse_interleaved_args(__doc__, HARNESS_METHODS, ALL_METHODS, steps=15, warmup=3, extra=_comm_args)
    args.comm_mib = [float(x) for x in args.comm_mib.split(",") if x.strip()]
    run_and_report(body, args, summarize, print_table)


if __name__ == "__main__":
    main()
