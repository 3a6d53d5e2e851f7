"""Our ZeRO 1/2/3 (+ offload) against torch's own sharding peers on the same model and data, 2 gloo ranks, one run.

Methods (each the object its Lightning strategy would drive; built by ``bench/harness.py``):

* ``ddp``              torch ``DistributedDataParallel`` + AdamW (baseline);
* ``zero_opt``         DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=AdamW)``;
* ``fsdp2``            ``torch.distributed.fsdp.fully_shard`` on every transformer block, then the root,
                       ``reshard_after_forward=True`` (the FSDP2 default; the reference for stage 3);
* ``fsdp2_noreshard``  the same with ``reshard_after_forward=False`` (params stay gathered fwd -> bwd);
* ``fsdp2_offload``    ``fsdp2`` + ``CPUOffloadPolicy`` (on a CPU-only machine: the same RAM, extra copies);
* ``zero1``, ``zero2``, ``zero3``  ``ZeroEngine(model, opt, ZeroConfig(stage=..., unit_classes=[block]))``;
* ``zero2_offload``    ``offload_optimizer=True``; ``zero3_offload``: ``offload_optimizer`` + ``offload_params``;
* ``ds_zero1``, ``ds_zero2``, ``ds_zero3``, ``ds_zero2_offload``, ``ds_zero3_offload``  DeepSpeed's engines
                       (optional: in the defaults only when DeepSpeed is installed; see ``deepspeed_peer.py``).

Same model (``harness.TinyLM``: causal ``nn.TransformerEncoder`` LM, fp32, AdamW), same seed, same
batches per rank for every method; step-interleaved rounds (see ``harness.py``). Reported per method:
median / p90 step time, tokens/s (global: ranks x batch x seq / median step), per-cycle ratio to DDP,
to FSDP2 (reshard True) and, for our presets, to DeepSpeed's same preset (``zero2`` / ``ds_zero2``),
model-state bytes per rank measured after a backward, before the step (ours:
``engine.memory_report().model_states``; FSDP2: local shard bytes of the DTensor params, grads and
optimizer state; DDP / ZeRO-Opt: bytes of params, ``.grad`` and the (local) optimizer-state tensors), the
model-state floor of the ZeRO stage each method matches, stage 3's ``partitioner.peak_gathered_bytes``, and
the final loss, which must agree across methods (flagged otherwise). A method that fails to build or
to take its first step is reported in its row instead of stopping the run.

Run::

    python bench/peers.py                        # defaults: ~1.5-2.5 minutes on 2 loaded cores
    python bench/peers.py --rounds 3 --steps 8 --methods ddp,fsdp2,zero3 --json /tmp/peers.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_peer  # noqa: E402
from harness import (  # noqa: E402
    ALL_METHODS,
    WORLD_SIZE,
    cycle_ratio,
    parse_interleaved_args,
    run_and_report,
    loss_check,
    make_batches,
    run_rounds,
    summarize_methods,
)

DEFAULT_METHODS = ("ddp", "zero_opt", "fsdp2", "fsdp2_noreshard", "fsdp2_offload",
                   "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
if deepspeed_peer.available():
    DEFAULT_METHODS += deepspeed_peer.DS_METHODS


def body(rank: int, args) -> dict:
    batches = make_batches(args.warmup + args.steps, rank, args.batch, args.seq, args.vocab)
    return {"methods": run_rounds(list(args.methods), args, batches, rank)}


def print_table(s: dict, args) -> list[str]:
    numel = s["numel"]
    ref, bad = loss_check(s, "ddp")
    tokens = WORLD_SIZE * args.batch * args.seq
    lines = [
        f"model: TransformerEncoder LM, d_model={args.d_model}, layers={args.layers}, vocab={args.vocab}, "
        f"seq={args.seq}, batch={args.batch}/rank, fp32, AdamW; Psi={numel:,} params; "
        f"{WORLD_SIZE} ranks gloo, 1 thread/rank; units / FSDP2 groups: one per TransformerEncoderLayer + root",
        f"rounds={args.rounds} x (warmup {args.warmup} + {args.steps} timed steps) per method, interleaved",
        "",
        "| method           | median ms | p90 ms | tokens/s | vs DDP | vs FSDP2 | vs DeepSpeed | model-state B/rank "
        "| (Psi) | floor (Psi) | stage-3 peak gathered B | final loss | rel. diff |",
        "|------------------|-----------|--------|----------|--------|----------|--------------|--------------------"
        "|-------|-------------|-------------------------|------------|-----------|",
    ]
    for m, r in s["methods"].items():
        if "error" in r:
            lines.append(f"| {m:<16} | FAILED: {r['error']} |")
            continue
        rv = r["ratio_vs"]
        f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        peak = r["memory_report"].get("peak_gathered")
        rel = abs(r["final_loss"] - ref) / abs(ref)
        lines.append(
            f"| {m:<16} | {r['median_ms']:9.2f} | {r['p90_ms']:6.2f} | {tokens / r['median_ms'] * 1e3:8.0f} "
            f"| {f(rv.get('ddp')):>6} | {f(rv.get('fsdp2')):>8} | {f(rv.get('deepspeed')):>12} "
            f"| {r['model_state_bytes']:>18,} "
            f"| {r['model_state_bytes'] / numel:5.2f} | {r['floor_bytes'] / numel:11.2f} "
            f"| {'-' if peak is None else f'{peak:,}':>23} | {r['final_loss']:.6f} | {rel:9.2e} |"
        )
        if r["errors"]:
            lines.append(f"|   (failed in {len(r['errors'])} round(s): {r['errors'][0]}) |")
    lines.append("")
    lines.append("phase medians, ms (forward | backward | optimizer step) | cores busy (CPU s of all ranks / step s) "
                 "| vs DDP with a free step ((forward + backward) / DDP's step) | stage 3: exposed all-gather wait:")
    ddp = s["methods"].get("ddp", {}).get("median_ms")
    for m, r in s["methods"].items():
        if "phase_medians_ms" in r:
            ph = r["phase_medians_ms"]
            busy = "-" if r.get("cores_busy") is None else f"{r['cores_busy']:.2f} of {os.cpu_count()}"
            free = f"{(ph['forward'] + ph['backward']) / ddp:.2f}" if ddp else "-"
            wait = "" if r.get("gather_wait_ms") is None else f" | {r['gather_wait_ms']:.2f} ms"
            lines.append(f"  {m:<16} {ph['forward']:7.2f} | {ph['backward']:7.2f} | {ph['step']:7.2f} | {busy} | {free}"
                         + wait)
    lines.append("")
    if not deepspeed_peer.available():
        lines.append(f"DeepSpeed rows (ds_*) left out: DeepSpeed is not installed ({deepspeed_peer.INSTALL_HINT}).")
    elif any(m.startswith("ds_") for m in s["methods"]):
        lines.append("ds_* bytes: every distinct storage reachable from the DeepSpeed engine, its preallocated "
                     "buckets included (an upper bound of its model states).")
    lines.append("floor = model-state fp32 floor of the matching ZeRO stage (ddp 0, zero_opt 1, fsdp2* 3), "
                 "offloaded bytes included; host (offloaded) share of the measured bytes:")
    for m, r in s["methods"].items():
        if r.get("host_bytes"):
            lines.append(f"  {m}: {r['host_bytes']:,} B = {r['host_bytes'] / numel:.2f} Psi")
    worst = max((abs(x - ref) / abs(ref) for r in s["methods"].values() for x in r.get("final_loss_per_round", [])),
                default=0.0)
    lines.append(
        f"final loss: all methods and rounds agree within 1e-4 relative (reference DDP {ref:.6f}, worst rel. diff "
        f"{worst:.2e})" if not bad else
        f"FINAL LOSS MISMATCH (>1e-4 relative to DDP {ref:.6f}): "
        + "; ".join(f"{m} {s['methods'][m]['final_loss_per_round']}" for m in bad)
    )
    return lines


def summarize(raw: dict, _args) -> dict:
    """Ratios to DDP and FSDP2 for every row, and each of our presets to DeepSpeed's same preset."""
    results = raw["methods"]
    s = summarize_methods(results, bases=("ddp", "fsdp2"))
    for m, row in s["methods"].items():
        if "ratio_vs" in row and f"ds_{m}" in results:
            row["ratio_vs"]["deepspeed"] = cycle_ratio(results[m], results[f"ds_{m}"])
    return s


def main() -> None:
    args = parse_interleaved_args(__doc__, ALL_METHODS, DEFAULT_METHODS, steps=10, warmup=2)
    run_and_report(body, args, summarize, print_table)


if __name__ == "__main__":
    main()
