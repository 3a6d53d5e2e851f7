"""The reference ZeRO table (issue 8): largest micro-batch under a memory cap, train and eval time, peak memory.

Reference (t5-large, two 24 GB GPUs): ``Method | Max batch | Train time | Eval time`` for DDP, fp16,
sharded DDP, DeepSpeed with and without CPU offload. This script fills the same table for our methods:

* ``ddp``            torch DDP, fp32;            ``ddp_bf16``  DDP + ``torch.autocast(bf16)`` (fp32 states);
* ``zero1``, ``zero2``, ``zero3`` ``ZeroEngine`` fp32 (stage 3: one unit per ``T5Block``);
* ``zero2_bf16``, ``zero3_bf16``: ``compute_dtype=torch.bfloat16`` (bf16 params/grads, fp32 master shards);
* ``zero2_offload``, ``zero3_offload`` (optimizer offload; stage 3 also offloads the param shards), and
  their ``_bf16`` variants (used for t5-3b on a GPU);
* ``_bf16moments`` (last): + ``optimizer_state_dtype="bf16"`` (Adam's moments in bf16 between steps);
  ``_bf16moments_bf16masters``: + ``master_dtype="bf16"`` too (the bf16 parameter as the master, plus a bf16
  compensation term; bf16 compute only), e.g. ``zero3_offload_bf16_bf16moments_bf16masters`` (issue 45);
* ``_ckpt``: + ``activation_checkpointing="auto"`` (every T5Block recomputed in backward); ``_ckpt_offact``: +
  ``offload_activations=True`` too (the blocks' saved inputs in host memory), for zero2, zero3 and
  zero3_offload (and ``zero2_offload``; ``_bf16`` after them, e.g. ``zero3_offload_ckpt_offact_bf16``);
* ``ds_zero2``, ``ds_zero3``, ``ds_zero2_offload``, ``ds_zero3_offload`` (+ ``_bf16``): DeepSpeed's engines,
  the reference table's own method (optional: in the defaults when DeepSpeed is installed; see
  ``deepspeed_peer.py``). Their CPU bytes are every storage reachable from the engine (buckets included)
  minus the offloaded partitions; parameters DeepSpeed gathers during stage 3's forward are not counted.

Model: ``T5ForConditionalGeneration`` built from ``examples/t5_module.make_t5_config(--model)`` (random
init, nothing downloaded), AdamW, synthetic token batches (``--src-len`` / ``--tgt-len``, different per
rank and step): the table measures memory and speed, not learning.

Memory cap and "OOM":

* GPU (``torch.cuda.is_available()``): ``torch.cuda.set_per_process_memory_fraction(cap_gb / total)`` on
  each rank and a real ``torch.OutOfMemoryError``; peak = ``torch.cuda.max_memory_allocated`` of the probe
  step. One rank per GPU (``--world-size``, default: the number of GPUs), NCCL.
* CPU (default here): 2 gloo ranks and a byte budget ``--budget-mb`` per rank (default: 2x the DDP fp32
  model states, 16 Psi -- the ratio of the reference, 24 GB for t5-large's 11.8 GB). A probe step "fits"
  when the measured peak of *device-side* model states + activations is within the budget: model states
  from ``engine.memory_report()`` (DDP: params + grads + optimizer-state tensors) after the backward,
  minus the offloaded (host) bytes (what a GPU would not hold), plus for stage 3 the peak of gathered
  units (``partitioner.peak_gathered_bytes``) in place of the currently gathered ones; activations = the
  bytes of the tensors autograd saves for backward during the forward (a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook, each storage counted once, parameters
  excluded; autocast's bf16 weight copies count; offloaded activations are host bytes) plus, with
  checkpointing, the largest recompute's saves in backward. Transient buffers (communication buckets, the
  backward's intermediate gradients) are not counted: the CPU figure is a lower bound of a GPU's.

Search: one real training step per probe at batch 1, 2, 4, ... (``--start-batch``) until one does not fit
(or ``--max-batch``), then bisection between the last fit and the first failure (to ``--bisect-tol``; on
a GPU the method is rebuilt after every OOM, since an OOM can leave a step half done). Then ``--train-samples`` samples (global) are
trained at the method's largest batch (train time) and ``--eval-samples`` evaluated under ``no_grad``
(eval time); both are the max over ranks. Ratios are to ``ddp``.

Run::

    python bench/seed_table.py                                 # CPU, t5_tiny, 2 ranks, ~1-2 minutes
    python bench/seed_table.py --budget-mb 12 --methods ddp,zero2,zero3
    python bench/seed_table.py --model t5_large --cap-gb 24    # on a CUDA machine (1 rank per GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import deepspeed_peer  # noqa: E402
from harness import build, launch, machine_line, state_dtypes  # noqa: E402
# the probe / search / timing code is the package's, shared with `lightning-zero tune`
from lightning_zero.tools.tuning.harness import Trial, search, t5_batch, timed  # noqa: E402

ACT_METHODS = tuple(f"{m}{a}" for m in ("zero2", "zero3", "zero3_offload") for a in ("_ckpt", "_ckpt_offact"))
CPU_METHODS = ("ddp", "ddp_bf16", "zero1", "zero2", "zero2_bf16", "zero3", "zero2_offload", "zero3_offload") \
    + ACT_METHODS
DS_TABLE_METHODS = ("ds_zero2", "ds_zero3", "ds_zero2_offload", "ds_zero3_offload")
ALL_METHODS = CPU_METHODS + ("zero3_bf16", "zero2_offload_bf16", "zero3_offload_bf16") + DS_TABLE_METHODS \
    + tuple(f"{m}_bf16" for m in DS_TABLE_METHODS) + ("zero2_offload_ckpt", "zero2_offload_ckpt_offact") \
    + tuple(f"{m}_bf16" for m in ACT_METHODS + ("zero2_offload_ckpt", "zero2_offload_ckpt_offact"))
# low-precision optimizer states (issue 45): bf16 moments, and bf16 moments + bf16 masters under bf16 compute
STATE_METHODS = tuple(f"{m}_bf16moments" for m in ("zero2", "zero3")) + tuple(
    f"{m}_bf16{s}" for m in ("zero2", "zero3", "zero2_offload", "zero3_offload")
    for s in ("_bf16moments", "_bf16moments_bf16masters"))
ALL_METHODS += STATE_METHODS
if deepspeed_peer.available():
    CPU_METHODS += DS_TABLE_METHODS


def t5_config(args):
    from t5_module import make_t5_config  # lazy: imports lightning + torchmetrics

    return make_t5_config(args.model, dropout_rate=0.0)


def make_t5(args) -> nn.Module:
    from transformers import T5ForConditionalGeneration

    cfg = t5_config(args)
    if torch.cuda.is_available():
        with torch.device("cuda"):  # init on the device: fast, and no full host copy of a 3B model
            return T5ForConditionalGeneration(cfg)
    return T5ForConditionalGeneration(cfg)


def t5_block_class() -> type:
    from transformers.models.t5.modeling_t5 import T5Block

    return T5Block


def parse_method(method: str) -> tuple[str, dict]:
    """(harness method, options): ``_bf16moments`` / ``_bf16masters`` -> the engine's state dtypes; ``_bf16`` ->
    autocast for DDP, compute_dtype for ours; ``_ckpt`` / ``_ckpt_offact`` -> the engine's activation options."""
    method, states = state_dtypes(method)
    bf16 = method.endswith("_bf16")
    base = method[: -len("_bf16")] if bf16 else method
    activations = {}
    for suffix, opts in (("_ckpt_offact", dict(activation_checkpointing="auto", offload_activations=True)),
                         ("_ckpt", dict(activation_checkpointing="auto"))):
        if base.endswith(suffix):
            base, activations = base[: -len(suffix)], opts
            break
    if base == "ddp":
        return "ddp", {"autocast": torch.bfloat16 if bf16 else None, "compute_dtype": None, "activations": None,
                       "states": None}
    return base, {"autocast": None, "compute_dtype": torch.bfloat16 if bf16 else None, "activations": activations,
                  "states": states or None}


def make_trial(method: str, args, rank: int, device) -> Trial:
    """The shared harness's :class:`Trial` for one method of this table (T5, ``_bf16`` variants)."""
    base, opts = parse_method(method)

    def build_fn():
        return build(base, args, make_model=make_t5, block_class=t5_block_class(), compute_dtype=opts["compute_dtype"],
                     activations=opts["activations"], states=opts["states"])

    return Trial(method, args, rank, device, build_fn, lambda r, step, b, dev: t5_batch(args, r, step, b, dev),
                 autocast=opts["autocast"])


def body(rank: int, args) -> dict:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 2**30 / total), device)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if rank == 0 else (lambda s: None)
    out = {}
    for m in args.methods:
        t0 = time.perf_counter()
        trial = make_trial(m, args, rank, device)
        try:
            res = search(trial, args, log)
            b = res["max_batch"]
            res["train_s"] = timed(trial, args, b, args.world_size, train=True) if b else None
            res["eval_s"] = timed(trial, args, b, args.world_size, train=False) if b else None
        except Exception as e:  # noqa: BLE001 -- one method's failure is a table row, not the end of the run
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
            log(f"  {m}: FAILED {res['error']}")
        res["wall_s"] = time.perf_counter() - t0
        if "error" not in res:  # partial results survive a timeout of the whole run (gpu_check.sh)
            mb = f"{res['peak_bytes'] / 2**20:.0f} MiB" if res.get("peak_bytes") else "-"
            log(f"  {m}: max batch {res['max_batch']} (first fail {res['first_fail']}), peak {mb}, "
                f"train {res['train_s'] or float('nan'):.2f} s, eval {res['eval_s'] or float('nan'):.2f} s, "
                f"{res['wall_s']:.0f} s wall")
        trial.drop()
        out[m] = res
    return {"methods": out}


def print_table(raw: dict, args) -> list[str]:
    ms = raw["methods"]
    base = ms.get("ddp", {})
    gpu = torch.cuda.is_available()
    cap = f"cap {args.cap_gb} GB/GPU (set_per_process_memory_fraction)" if gpu else \
        f"budget {args.budget_bytes / 2**20:.2f} MiB/rank (model states + saved activations)"
    w = max([30] + [len(m) for m in ms])  # the method column fits the longest name
    lines = [
        f"model: T5 {args.model} (random init), src {args.src_len} / tgt {args.tgt_len} tokens, AdamW; "
        f"Psi={args.numel:,}; {args.world_size} rank(s) {'nccl' if gpu else 'gloo'}; {cap}; "
        f"train {args.train_samples} samples, eval {args.eval_samples} samples (global)",
        "",
        f"| {'Method':<{w}} | Max batch | Train time s | Eval time s | Peak MB/rank | batch vs DDP | train vs DDP "
        "| eval vs DDP |",
        f"|{'-' * (w + 2)}|-----------|--------------|-------------|--------------|--------------|--------------"
        "|-------------|",
    ]

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    def sec(x):
        return f"{x:.2f}" if x is not None else "-"

    for m, r in ms.items():
        if "error" in r:
            lines.append(f"| {m:<{w}} | FAILED: {r['error']} |")
            continue
        b = r["max_batch"]
        mb = f"{r['peak_bytes'] / 2**20:.2f}" if r.get("peak_bytes") else "-"
        bs = f"{b}" if b else "OOM at 1"
        if b and b >= args.max_batch:
            bs = f">={b}"
        elif b and r["first_fail"] and r["first_fail"] - b > 1:
            bs = f"{b}-{r['first_fail'] - 1}"  # bisection stopped early (--bisect-tol)
        lines.append(
            f"| {m:<{w}} | {bs:>9} | {sec(r['train_s']):>12} | {sec(r['eval_s']):>11} | {mb:>12} "
            f"| {ratio(b, base.get('max_batch')):>12} | {ratio(r['train_s'], base.get('train_s')):>12} "
            f"| {ratio(r['eval_s'], base.get('eval_s')):>11} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    p.add_argument("--model", default="t5_large" if gpu else "t5_tiny", help="preset of examples/t5_module.T5_PRESETS")
    p.add_argument("--methods", default=",".join(CPU_METHODS), help=f"comma list from {','.join(ALL_METHODS)}")
    p.add_argument("--budget-mb", type=float, default=None,
                   help="CPU: per-rank byte budget in MiB (default: 2 x the DDP fp32 model states, 16 Psi)")
    p.add_argument("--cap-gb", type=float, default=24.0, help="GPU: per-process memory cap in GB")
    p.add_argument("--world-size", type=int, default=(torch.cuda.device_count() if gpu else 2))
    p.add_argument("--src-len", type=int, default=128 if gpu else 16)
    p.add_argument("--tgt-len", type=int, default=128 if gpu else 8)
    p.add_argument("--max-batch", type=int, default=1024, help="search ceiling")
    p.add_argument("--start-batch", type=int, default=1, help="first probe of the doubling search")
    p.add_argument("--bisect-tol", type=float, default=0.1 if gpu else 0.0,
                   help="stop bisecting when first-fail - max-fit <= max(1, tol * max-fit) (GPU: each OOM rebuilds)")
    p.add_argument("--train-samples", type=int, default=256 if gpu else 1024, help="global samples to time")
    p.add_argument("--eval-samples", type=int, default=256 if gpu else 1024, help="global samples to time")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: 1 on CPU, cores / ranks on GPU for the CPU optimizer)")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in ALL_METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; allowed: {', '.join(ALL_METHODS)}")
    args.backend = "nccl" if gpu else "gloo"
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size) if gpu else 1
    cfg = t5_config(args)
    args.vocab = cfg.vocab_size
    from transformers import T5ForConditionalGeneration

    with torch.device("meta"):
        args.numel = sum(p.numel() for p in T5ForConditionalGeneration(cfg).parameters())
    args.budget_bytes = int(args.budget_mb * 2**20) if args.budget_mb else 2 * 16 * args.numel
    t0 = time.perf_counter()
    raw = launch(body, args, world_size=args.world_size)
    lines = print_table(raw, args)
    lines.append(f"wall time {time.perf_counter() - t0:.0f} s; {machine_line()}")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "raw": raw}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
