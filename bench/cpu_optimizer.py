"""CPU optimizer throughput (fused vs foreach vs single-tensor AdamW) and the step-time cost of offloading.

Part 1 -- the kernel (issue 5 bench): one process, ``torch.set_num_threads(--kernel-threads)`` (default 1, what
each bench/engine rank uses), a ``--numel`` fp32 shard (default 50M elements, split into ``--tensors``
equal parameter slices as the engine's master shards are) with random gradients, and three AdamW
instances over their own copies: ``fused=True``, ``foreach=True`` and ``foreach=False`` (the
single-tensor loop). One untimed step each materializes the state, then ``--repeats`` timed steps,
interleaved (fused, foreach, single, fused, ...). Reported: median seconds per step, params/s
(numel / median step), ratio fused / foreach and fused / single-tensor (target from issue 5: >= 5x
foreach), and the max abs difference of the parameters after the same steps (the kernels must agree).

Part 2 -- the offload overhead, on the bench model of ``bench/harness.py`` (2 gloo ranks, step-interleaved
rounds): zero2 vs zero2_offload and zero3 vs zero3_offload (offload_optimizer, + offload_params for
stage 3). The offloaded engine swaps the user's AdamW for the fused CPU kernel, so the rows
``zero2_fused`` / ``zero3_fused`` (the non-offloaded stage given ``AdamW(fused=True)`` by the user)
separate the cost of the offload copies from the gain of the kernel. Ratios are per-cycle medians.

Run::

    python bench/cpu_optimizer.py                                   # ~1-2 minutes on 2 loaded cores
    python bench/cpu_optimizer.py --numel 10000000 --repeats 3 --skip-offload
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_peer  # noqa: E402
from harness import (  # noqa: E402
    add_model_args,
    build,
    cycle_ratio,
    launch,
    loss_check,
    machine_line,
    make_batches,
    run_rounds,
    summarize_methods,
)

KERNELS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "single-tensor": dict(foreach=False)}
DS_KERNEL = "deepspeed-cpu"  # DeepSpeedCPUAdam (AdamW mode), a row of its own when DeepSpeed is installed
OFFLOAD_METHODS = ("zero2", "zero2_offload", "zero2_fused", "zero3", "zero3_offload", "zero3_fused")


# -- part 1 ------------------------------------------------------------------------------------------------
def kernel_bench(numel: int, tensors: int, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    sizes = [numel // tensors] * tensors
    sizes[-1] += numel - sum(sizes)
    base = [torch.randn(n, generator=g) * 0.02 for n in sizes]
    grads = [torch.randn(n, generator=g) * 1e-3 for n in sizes]
    runs = {}
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    kernels = dict(KERNELS, **({DS_KERNEL: None} if deepspeed_peer.available() else {}))
    for name, kw in kernels.items():
        params = [torch.nn.Parameter(b.clone()) for b in base]
        for p, gr in zip(params, grads):
            p.grad = gr  # shared, read-only for the optimizer
        opt = (deepspeed_peer.cpu_adam(params, **hyper) if kw is None
               else torch.optim.AdamW(params, **hyper, **kw))
        opt.step()  # materializes exp_avg / exp_avg_sq (untimed)
        runs[name] = (params, opt)
    times = {k: [] for k in kernels}
    for _ in range(repeats):
        for name, (_, opt) in runs.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    ref = runs["single-tensor"][0]
    out = {"numel": numel, "tensors": tensors, "threads": threads, "repeats": repeats, "kernels": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(runs[name][0], ref))
        out["kernels"][name] = {"times_s": ts, "median_s": med, "params_per_s": numel / med, "max_abs_diff": diff}
    return out


# -- part 2 ------------------------------------------------------------------------------------------------
def build_variant(method: str, args):
    if method.endswith("_fused"):  # the non-offloaded stage with the user passing AdamW(fused=True)
        a = copy.copy(args)
        a.fused = True
        return build(method[: -len("_fused")], a)
    return build(method, args)


def offload_body(rank: int, args) -> dict:
    batches = make_batches(args.warmup + args.steps, rank, args.batch, args.seq, args.vocab)
    results = run_rounds(list(OFFLOAD_METHODS), args, batches, rank, build_fn=build_variant)
    r = build("zero2_offload", args)
    fused = bool(r.engine.sharded.uses_fused)
    r.close()
    return {"methods": results, "offload_uses_fused": fused}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=50_000_000, help="elements of the fp32 shard (part 1)")
    p.add_argument("--tensors", type=int, default=64, help="parameter slices the shard is split into")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per kernel (part 1)")
    p.add_argument("--kernel-threads", type=int, default=1, help="torch threads in part 1 (1 = one engine rank)")
    p.add_argument("--skip-offload", action="store_true", help="part 1 only")
    p.add_argument("--steps", type=int, default=10, help="part 2: timed cycles per round")
    p.add_argument("--rounds", type=int, default=4, help="part 2: interleaved rounds")
    p.add_argument("--warmup", type=int, default=2, help="part 2: untimed steps per method per round")
    add_model_args(p)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args()
    t0 = time.perf_counter()

    k = kernel_bench(args.numel, args.tensors, args.repeats, args.kernel_threads)
    ks = k["kernels"]
    lines = [
        f"Part 1: AdamW step on a {args.numel:,}-element fp32 shard ({args.tensors} tensors), "
        f"{args.kernel_threads} thread(s), {args.repeats} timed steps each, interleaved",
        "",
        "| kernel        | median s/step | params/s    | vs foreach | max |diff| vs single-tensor |",
        "|---------------|---------------|-------------|------------|---------------------------|",
    ]
    for name, r in ks.items():
        lines.append(f"| {name:<13} | {r['median_s']:13.3f} | {r['params_per_s']:11.3e} "
                     f"| {r['params_per_s'] / ks['foreach']['params_per_s']:9.2f}x | {r['max_abs_diff']:25.2e} |")
    speedup = ks["fused"]["params_per_s"] / ks["foreach"]["params_per_s"]
    lines += ["", f"fused / foreach = {speedup:.2f}x (target >= 5x: {'met' if speedup >= 5 else 'NOT met'}); "
                  f"fused / single-tensor = {ks['fused']['params_per_s'] / ks['single-tensor']['params_per_s']:.2f}x"]
    if DS_KERNEL in ks:
        lines.append(f"fused / DeepSpeed CPU Adam = {ks['fused']['params_per_s'] / ks[DS_KERNEL]['params_per_s']:.2f}x")
    else:
        lines.append(f"DeepSpeed CPU Adam row left out: DeepSpeed is not installed ({deepspeed_peer.INSTALL_HINT})")
    out = {"kernels": k}
    if not args.skip_offload:
        raw = launch(offload_body, args)
        s = summarize_methods(raw["methods"], bases=())
        ref, bad = loss_check(s, "zero2")
        res = raw["methods"]
        lines += [
            "",
            f"Part 2: offload step-time overhead, bench model (d_model={args.d_model}, layers={args.layers}, "
            f"batch={args.batch}/rank, seq={args.seq}, Psi={s['numel']:,}), 2 ranks gloo, {args.rounds} rounds x "
            f"{args.steps} timed cycles; offloaded engines use fused AdamW: {raw['offload_uses_fused']}",
            "",
            "| method        | median ms | optimizer-step phase ms | ratio vs same stage (foreach) | "
            "ratio vs same stage (fused) | final loss |",
            "|---------------|-----------|-------------------------|-------------------------------|"
            "-----------------------------|------------|",
        ]
        for m, r in s["methods"].items():
            if "error" in r:
                lines.append(f"| {m:<13} | FAILED: {r['error']} |")
                continue
            stage = m[:5]
            rv = cycle_ratio(res[m], res[stage]) if m != stage else 1.0
            rf = cycle_ratio(res[m], res[stage + "_fused"]) if m != stage + "_fused" else 1.0
            lines.append(f"| {m:<13} | {r['median_ms']:9.2f} | {r['phase_medians_ms']['step']:23.2f} "
                         f"| {rv:29.3f} | {rf:27.3f} | {r['final_loss']:.6f} |")
        lines.append("final loss: all agree within 1e-4 relative" if not bad
                     else f"FINAL LOSS MISMATCH vs zero2 {ref:.6f}: {', '.join(bad)}")
        out["offload"] = {"summary": s, "raw": raw}
    lines.append(f"wall time {time.perf_counter() - t0:.0f} s; {machine_line()}")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
