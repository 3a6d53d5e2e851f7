"""The reference ZeRO table (issue 8): largest micro-batch under a memory cap, train and eval time, peak memory.

Reference (t5-large, two 24 GB GPUs): ``Method | Max batch | Train time | Eval time`` for DDP, fp16,
sharded DDP, DeepSpeed with and without CPU offload. This script fills the same table for our methods:

* ``ddp``            torch DDP, fp32;            ``ddp_bf16``  DDP + ``torch.autocast(bf16)`` (fp32 states);
* ``zero1``, ``zero2``, ``zero3`` ``ZeroEngine`` fp32 (stage 3: one unit per ``T5Block``);
* ``zero2_bf16``, ``zero3_bf16``: ``compute_dtype=torch.bfloat16`` (bf16 params/grads, fp32 master shards);
* ``zero2_offload``, ``zero3_offload`` (optimizer offload; stage 3 also offloads the param shards), and
  their ``_bf16`` variants (used for t5-3b on a GPU).

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
  excluded; autocast's bf16 weight copies count). Transient buffers (communication buckets, the
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
import contextlib
import gc
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from harness import build, launch, machine_line  # noqa: E402

CPU_METHODS = ("ddp", "ddp_bf16", "zero1", "zero2", "zero2_bf16", "zero3", "zero2_offload", "zero3_offload")
ALL_METHODS = CPU_METHODS + ("zero3_bf16", "zero2_offload_bf16", "zero3_offload_bf16")


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
    """(harness method, options): ``_bf16`` -> autocast for DDP, compute_dtype for ours."""
    bf16 = method.endswith("_bf16")
    base = method[: -len("_bf16")] if bf16 else method
    if base == "ddp":
        return "ddp", {"autocast": torch.bfloat16 if bf16 else None, "compute_dtype": None}
    return base, {"autocast": None, "compute_dtype": torch.bfloat16 if bf16 else None}


def make_batch(args, rank: int, step: int, b: int, device) -> dict:
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randint(2, args.vocab, (b, args.src_len), generator=g)
    y = torch.randint(2, args.vocab, (b, args.tgt_len), generator=g)
    return {"input_ids": x.to(device), "attention_mask": torch.ones_like(x).to(device), "labels": y.to(device)}


class SavedBytes:
    """Bytes of the tensors autograd saves in a forward (each storage once, parameters excluded)."""

    def __init__(self, params) -> None:
        self.param_ids = {id(p) for p in params}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.param_ids and not isinstance(t, nn.Parameter):
            st = t.untyped_storage()
            if st.data_ptr() not in self.seen:
                self.seen.add(st.data_ptr())
                self.bytes += st.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _oom_types() -> tuple:
    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                 if t is not None)


class Trial:
    """One method on one rank: built lazily, rebuilt after an OOM (its state may be half-updated then)."""

    def __init__(self, method: str, args, rank: int, device) -> None:
        self.method, self.args, self.rank, self.device = method, args, rank, device
        self.base, self.opts = parse_method(method)
        self.runner = None
        self.gpu = device.type == "cuda"

    def amp(self):
        dt = self.opts["autocast"]
        return torch.autocast(self.device.type, dtype=dt) if dt is not None else contextlib.nullcontext()

    def ensure(self) -> None:
        if self.runner is None:
            self.runner = build(self.base, self.args, make_model=make_t5, block_class=t5_block_class(),
                                compute_dtype=self.opts["compute_dtype"])
            self.step(1, step_index=0)  # materializes the optimizer state (and stage 3's recorded order)

    def drop(self) -> None:
        self.runner = None
        gc.collect()
        if self.gpu:
            torch.cuda.empty_cache()

    def step(self, b: int, step_index: int, measure: bool = False) -> int:
        """One training step at micro-batch ``b``; returns this rank's peak bytes if ``measure``."""
        r = self.runner
        batch = make_batch(self.args, self.rank, step_index, b, self.device)
        if self.gpu and measure:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        saved = SavedBytes(r.model.parameters()) if measure and not self.gpu else None
        r.pre()
        with self.amp(), (saved.hooks() if saved else contextlib.nullcontext()):
            loss = r.module(**batch).loss
        loss.backward()
        peak = 0
        if saved is not None:
            mem = r.state_bytes()
            device_states = mem["model_states"] - mem.get("host", 0)
            device_states += mem.get("peak_gathered", 0) - mem.get("gathered_now", 0)
            peak = device_states + saved.bytes
        r.step()
        if self.gpu and measure:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        return peak

    def probe(self, b: int, step_index: int) -> tuple[bool, int]:
        """Does micro-batch ``b`` fit on every rank? (fits, max peak bytes over ranks)."""
        oom = 0
        peak = 0
        try:
            self.ensure()
            peak = self.step(b, step_index, measure=True)
        except _oom_types():
            oom = 1
        if oom:
            self.drop()
        flags = torch.tensor([oom, peak], dtype=torch.float64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        oom, peak = int(flags[0]), int(flags[1])
        fits = not oom and (self.gpu or peak <= self.args.budget_bytes)
        return fits, peak


def search(trial: Trial, args, log) -> dict:
    probes: list[tuple[int, bool, int]] = []
    ok, fail, b, idx = 0, None, max(1, min(args.start_batch, args.max_batch)), 1
    peak_at = {}
    while True:
        fits, peak = trial.probe(b, idx)
        idx += 1
        probes.append((b, fits, peak))
        if not fits:
            fail = b
            break
        ok, peak_at[b] = b, peak
        if b >= args.max_batch:
            break
        b = min(2 * b, args.max_batch)
    while fail is not None and fail - ok > max(1, int(ok * args.bisect_tol)):
        mid = (ok + fail) // 2
        fits, peak = trial.probe(mid, idx)
        idx += 1
        probes.append((mid, fits, peak))
        if fits:
            ok, peak_at[mid] = mid, peak
        else:
            fail = mid
    log(f"  {trial.method}: probes " + " ".join(f"{b}{'+' if f else '-'}" for b, f, _ in probes) + f" -> {ok}")
    return {"max_batch": ok, "first_fail": fail, "peak_bytes": peak_at.get(ok), "probes": probes}


def timed(trial: Trial, args, b: int, world: int, train: bool) -> float | None:
    """Seconds (max over ranks) to train on / evaluate ``--train-samples`` / ``--eval-samples`` at batch b."""
    n = args.train_samples if train else args.eval_samples
    steps = max(1, math.ceil(n / (b * world)))
    err = 0
    try:
        trial.ensure()  # a rebuild after the search's last OOM is not part of the timed work
    except _oom_types():
        err = 1
        trial.drop()
    dist.barrier()
    t0 = time.perf_counter()
    try:
        if err:
            raise torch.OutOfMemoryError("rebuild failed")
        r = trial.runner
        if train:
            for i in range(steps):
                trial.step(b, 10_000 + i)
        else:
            r.module.eval()
            with torch.no_grad(), trial.amp():
                for i in range(steps):
                    if r.engine is not None:
                        r.engine.prepare_forward()
                    r.module(**make_batch(args, trial.rank, 20_000 + i, b, trial.device)).loss.item()
            r.module.train()
        if trial.gpu:
            torch.cuda.synchronize()
    except _oom_types():
        err = 1
        trial.drop()
    dt = torch.tensor([time.perf_counter() - t0, err], dtype=torch.float64, device=trial.device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return None if dt[1] else float(dt[0])


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
        trial = Trial(m, args, rank, device)
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
    lines = [
        f"model: T5 {args.model} (random init), src {args.src_len} / tgt {args.tgt_len} tokens, AdamW; "
        f"Psi={args.numel:,}; {args.world_size} rank(s) {'nccl' if gpu else 'gloo'}; {cap}; "
        f"train {args.train_samples} samples, eval {args.eval_samples} samples (global)",
        "",
        "| Method             | Max batch | Train time s | Eval time s | Peak MB/rank | batch vs DDP | train vs DDP "
        "| eval vs DDP |",
        "|--------------------|-----------|--------------|-------------|--------------|--------------|--------------"
        "|-------------|",
    ]

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    def sec(x):
        return f"{x:.2f}" if x is not None else "-"

    for m, r in ms.items():
        if "error" in r:
            lines.append(f"| {m:<18} | FAILED: {r['error']} |")
            continue
        b = r["max_batch"]
        mb = f"{r['peak_bytes'] / 2**20:.2f}" if r.get("peak_bytes") else "-"
        bs = f"{b}" if b else "OOM at 1"
        if b and b >= args.max_batch:
            bs = f">={b}"
        elif b and r["first_fail"] and r["first_fail"] - b > 1:
            bs = f"{b}-{r['first_fail'] - 1}"  # bisection stopped early (--bisect-tol)
        lines.append(
            f"| {m:<18} | {bs:>9} | {sec(r['train_s']):>12} | {sec(r['eval_s']):>11} | {mb:>12} "
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
