"""Shared bench harness: model, data, method builders, interleaved timing rounds, spawn launcher.

Used by ``bench/step_time.py`` (ZeRO 0-2 vs DDP), ``bench/peers.py`` (ours vs DDP, ZeroRedundancyOptimizer
and FSDP2) and ``bench/cpu_optimizer.py`` (offload step-time overhead). One method = one *runner*: the
object a Lightning strategy would drive (torch DDP, FSDP2-wrapped module, ``ZeroEngine``), built fresh
from the same seed every round, stepped by :func:`train_step`, measured by :meth:`Runner.measure_memory`.

Timing protocol (built for a small, noisy machine; see step_time.py's docstring): every round builds
all methods, runs ``warmup`` untimed steps of each, then ``steps`` timed cycles in which the methods take
one step each in turn (A B C A B C ..., order rotated per round), barrier before every timed step; a
step's time is the max over ranks. Ratios are medians over cycles of per-cycle ratios, so machine-load
swings cancel.
"""

from __future__ import annotations

import gc
import sys
import time
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine import ZeroConfig, ZeroEngine
# Runner, the launcher and machine_line live in the package, shared with the autotuner (lightning-zero tune)
from lightning_zero.tools.tuning.harness import Runner, _entry, launch, machine_line  # noqa: F401

from deepspeed_peer import DS_METHODS, build_deepspeed  # noqa: E402 -- bench/ is on sys.path

# the summaries of the rounds live in bench/rounds_summary.py; re-exported for the benches importing them from here
from rounds_summary import (  # noqa: E402,F401
    ADAM_STATE_BYTES, WORLD_SIZE, cycle_ratio, loss_check, method_floor, percentile, summarize_methods,
)

# communication variants of the presets: ``*_blocking`` = reduce-scatter (the engine before grad_reduce; the
# publish blocks in step() as by default); ``*_allreduce`` = the all-reduce keeping this rank's rows;
# ``*_overlap`` = the publish overlapped with the next forward;
# ``*_q`` = int8 all-gathers and reduce-scatters (qwZ + qgZ)
COMM_VARIANTS = {
    "zero1_overlap": dict(overlap_publish=True),
    "zero2_overlap": dict(overlap_publish=True),
    "zero1_blocking": dict(grad_reduce="reduce_scatter", overlap_publish=False),
    "zero2_blocking": dict(grad_reduce="reduce_scatter", overlap_publish=False),
    "zero1_allreduce": dict(grad_reduce="all_reduce"),  # gloo's "auto" before all_to_all
    "zero2_allreduce": dict(grad_reduce="all_reduce"),
    "zero1_overlap_allreduce": dict(grad_reduce="all_reduce", overlap_publish=True),
    "zero2_overlap_allreduce": dict(grad_reduce="all_reduce", overlap_publish=True),
    "zero1_b1": dict(bucket_mb=1.0),  # 1 MiB buckets whatever --bucket-mb (DDP's first bucket is 1 MiB too)
    "zero2_b1": dict(bucket_mb=1.0),
    "zero2_q": dict(quantize_weights=True, quantize_grads=True),
    "zero3_q": dict(quantize_weights=True, quantize_grads=True),
    "zero3_noreshard": dict(reshard_after_forward=False),  # FSDP2's fsdp2_noreshard: kept gathered fwd -> bwd
    "zero3_prefetch2": dict(prefetch=2),  # two units gathered ahead
    "zero3_noprefetch": dict(prefetch=0),
}
ZERO_METHODS = ("zero0", "zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload",
                *COMM_VARIANTS)
PEER_METHODS = ("ddp", "zero_opt", "fsdp2", "fsdp2_noreshard", "fsdp2_offload")
ALL_METHODS = PEER_METHODS + ZERO_METHODS + DS_METHODS  # ds_*: optional, see deepspeed_peer.py


# -- model and data -----------------------------------------------------------------------------------
class TinyLM(nn.Module):
    """Causal LM: token + learned position embedding, pre-norm TransformerEncoder blocks, linear head."""

    def __init__(self, vocab: int, d_model: int, layers: int, seq: int, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos[:t]
        h = self.encoder(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


BLOCK_CLASS = nn.TransformerEncoderLayer  # the transformer block: one FSDP2 / ZeRO-3 unit each


def make_batches(n: int, rank: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    """Learnable sequences: x[t+1] = (a * x[t] + c) mod vocab, with 10% random tokens; differ by rank and step."""
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(10_000 * rank + step)
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            x[:, t + 1] = (7 * x[:, t] + 3) % vocab
        noise = torch.rand(batch, seq + 1, generator=g) < 0.1
        x[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
        out.append(x)
    return out


def loss_of(model: nn.Module, x: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(x[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))


def make_tiny_lm(args) -> nn.Module:
    return TinyLM(args.vocab, args.d_model, args.layers, args.seq)


def make_adamw(params, args) -> torch.optim.Optimizer:
    """AdamW as every method gets it; ``args.fused=True`` asks for torch's fused kernel (runs on CPU too)."""
    kw = {"fused": True} if getattr(args, "fused", False) else {}
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01, **kw)


# -- runners ----------------------------------------------------------------------------------------------
# ``Runner`` (one method on one rank + its model-state byte accounting) is imported from the package above.


def build(method: str, args, make_model: Callable = make_tiny_lm, block_class: type = BLOCK_CLASS,
          compute_dtype: Optional[torch.dtype] = None, activations: Optional[dict] = None,
          states: Optional[dict] = None) -> Runner:
    """A fresh model + AdamW under ``method``, seeded identically on every rank and every call.

    ``activations``: ZeroConfig's activation options for our methods (activation_checkpointing, offload_activations);
    ``states``: its state dtypes (``optimizer_state_dtype`` / ``master_dtype``, see :func:`state_dtypes`), passed
    only when given, so the same bench also runs on code without those knobs. ``compute_dtype=torch.bfloat16``:
    our engine's and DeepSpeed's bf16 mode, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``.
    """
    if method in DS_METHODS:
        return build_deepspeed(method, args, make_model, compute_dtype)
    torch.manual_seed(args.seed)
    model = make_model(args)
    bucket_mb = getattr(args, "bucket_mb", 25.0)
    if method in ("ddp", "zero_opt"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=bucket_mb)  # Lightning's ddp: torch defaults otherwise
        if method == "ddp":
            return Runner(method, model, ddp, make_adamw(model.parameters(), args))
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
        )
        return Runner(method, model, ddp, opt)
    if method.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        kw = dict(mesh=init_device_mesh(dev, (dist.get_world_size(),)),
                  reshard_after_forward=method != "fsdp2_noreshard")
        if method == "fsdp2_offload":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if compute_dtype is not None:  # fp32 sharded parameters (FSDP2's masters), bf16 gathered ones
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype)
        for m in model.modules():
            if isinstance(m, block_class):
                fully_shard(m, **kw)
        fully_shard(model, **kw)
        return Runner(method, model, model, make_adamw(model.parameters(), args))
    if method in ZERO_METHODS:
        stage = int(method[4])
        offload = method.endswith("_offload")
        cfg = ZeroConfig(**{**dict(stage=stage, offload_optimizer=offload, offload_params=offload and stage == 3,
                                   bucket_mb=bucket_mb, unit_classes=[block_class] if stage == 3 else None),
                            **(activations or {}), **(states or {}), **COMM_VARIANTS.get(method, {})})
        opt = make_adamw(model.parameters(), args)
        runner = Runner(method, model, model, opt, ZeroEngine(model, opt, cfg, compute_dtype=compute_dtype))
        if stage == 3:
            runner.gather_wait = time_gather_waits(runner.engine)
        return runner
    raise ValueError(f"unknown method {method!r}; allowed: {', '.join(ALL_METHODS)}")


# state-dtype suffixes of a method name, in this order: ``zero3_bf16moments_bf16masters``
STATE_SUFFIXES = (("_bf16masters", "master_dtype"), ("_bf16moments", "optimizer_state_dtype"))


def state_dtypes(method: str) -> tuple[str, dict]:
    """(method without them, ZeroConfig options) for the suffixes ``_bf16moments`` (``optimizer_state_dtype=
    "bf16"``: Adam's moments in bf16 between steps) and ``_bf16masters`` (``master_dtype="bf16"``: bf16 master +
    bf16 compensation; needs bf16 compute)."""
    opts = {}
    for suffix, knob in STATE_SUFFIXES:
        if method.endswith(suffix):
            method, opts[knob] = method[: -len(suffix)], "bf16"
    return method, opts


def time_gather_waits(engine: ZeroEngine) -> list[float]:
    """Stage 3's exposed communication: seconds the compute thread blocks on an all-gather it needs (the part
    prefetch did not hide), accumulated into the returned one-element list."""
    acc = [0.0]
    part = engine.partitioner
    finish = part._finish_gather

    def timed(u) -> None:
        if u.inflight is not None:
            t = time.perf_counter()
            u.inflight[0].wait()  # the original's own wait then returns at once
            acc[0] += time.perf_counter() - t
        finish(u)

    part._finish_gather = timed
    return acc


def train_step(r: Runner, x, vocab: int, marks: Optional[list] = None,
               loss_fn: Optional[Callable] = None) -> torch.Tensor:
    """One step; appends perf_counter marks after forward and after backward to ``marks`` if given.
    ``loss_fn(module, batch)``: the loss of another model's batches (default: :func:`loss_of` on TinyLM's)."""
    r.pre()
    loss = loss_fn(r.module, x) if loss_fn is not None else loss_of(r.module, x, vocab)
    if marks is not None:
        marks.append(time.perf_counter())
    r.backward(loss)
    if marks is not None:
        marks.append(time.perf_counter())
    r.step()
    return loss.detach()


# -- one round ---------------------------------------------------------------------------------------------
def run_round(methods: list[str], args, batches: list, build_fn: Callable = build,
              loss_fn: Optional[Callable] = None) -> dict:
    """Build every method from the same seed, then run them step by step: A B C A B C ...

    A method whose build or first step raises is dropped from the round and reported as
    ``{"error": ...}`` (the exception is the same on every rank, so the ranks stay in step).
    """
    built: dict[str, Runner] = {}
    errors: dict[str, str] = {}
    for m in methods:
        try:
            built[m] = build_fn(m, args)
            train_step(built[m], batches[0], args.vocab, loss_fn=loss_fn)
        except Exception as e:  # noqa: BLE001 -- reported in the table row
            errors[m] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            built.pop(m, None)
            dist.barrier()
    live = [m for m in methods if m in built]
    for i in range(1, args.warmup):
        for m in live:
            train_step(built[m], batches[i], args.vocab, loss_fn=loss_fn)
    gc.collect()
    gc.disable()
    times: dict[str, list[list[float]]] = {m: [] for m in live}  # per step: total, fwd, bwd, opt
    last: dict[str, torch.Tensor] = {}
    for i in range(args.warmup, args.warmup + args.steps):
        for m in live:
            dist.barrier()  # both ranks start the timed step together
            # a lead-in step right before the timed one, with nothing in between: work a step leaves in
            # flight (an overlapped parameter all-gather) then lands in the timed step, as in training,
            # instead of completing for free during the other methods' steps (or in the barrier, which
            # waits for all earlier work of its group)
            train_step(built[m], batches[i], args.vocab, loss_fn=loss_fn)
            wait = getattr(built[m], "gather_wait", [0.0])
            w0 = wait[0]
            t0, c0 = time.perf_counter(), time.process_time()
            marks: list[float] = []
            last[m] = train_step(built[m], batches[i], args.vocab, marks, loss_fn)
            t3, c3 = time.perf_counter(), time.process_time()
            t1, t2 = marks
            # the process's CPU time (every thread: gloo's too) over the wall time tells whether cores were idle
            times[m].append([t3 - t0, t1 - t0, t2 - t1, t3 - t2, c3 - c0, wait[0] - w0])
    gc.enable()
    out: dict[str, dict] = {m: {"error": e} for m, e in errors.items()}
    for m in live:
        r = built[m]
        t = torch.tensor(times[m], dtype=torch.float64)
        cpu = t[:, 4].clone()
        dist.all_reduce(cpu)  # CPU seconds of all ranks
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step's (and phase's) time is the slower rank's
        busy = (cpu / t[:, 0]).tolist()  # cores kept busy on average during the step
        waits = (t[:, 5] * 1e3).tolist()  # the slower rank's, like the phases
        t = t[:, :4] * 1e3
        loss = last[m].clone().double()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
        mem = r.measure_memory(lambda mod: loss_fn(mod, batches[0]) if loss_fn is not None
                               else loss_of(mod, batches[0], args.vocab))
        r.close()
        out[m] = {"times_ms": t[:, 0].tolist(), "phases_ms": t[:, 1:].tolist(), "cores_busy": busy,
                  "gather_wait_ms": waits if hasattr(r, "gather_wait") else None, "final_loss": float(loss),
                  "memory": mem, "numel": r.numel}
    del built
    return out


def run_rounds(methods: list[str], args, batches: list, rank: int,
               build_fn: Callable = build, loss_fn: Optional[Callable] = None) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {m: [] for m in methods}
    for r in range(args.rounds):
        k = r % len(methods)
        order = methods[k:] + methods[:k]  # rotate so no method always runs first / after the same one
        for m, res in run_round(order, args, batches, build_fn, loss_fn).items():
            res["round"] = r
            results[m].append(res)
        if rank == 0:
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return results


def add_model_args(p) -> None:
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap for DDP and the engine (MiB)")


def parse_interleaved_args(doc: str, allowed, default_methods, steps: int, warmup: int, rounds: int = 5,
                           extra: Optional[Callable] = None):
    """Command line shared by the interleaved benches: timing, model size, methods, JSON output;
    ``extra(parser)`` adds a bench's own flags."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help="timed steps (cycles) per method per round")
    p.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (each rebuilds every method)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps per method per round (>= 1)")
    add_model_args(p)
    p.add_argument("--methods", default=",".join(default_methods),
                   help=f"comma list from {','.join(allowed)} (default: {','.join(default_methods)})")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in allowed]
    if unknown:
        p.error(f"unknown method(s) {unknown}; allowed: {', '.join(allowed)}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 1:
        p.error("--steps, --rounds and --warmup must be >= 1 (warmup >= 1 materializes the optimizer state)")
    return args


def run_and_report(body, args, summarize, print_table) -> None:
    """Launch ``body`` on the ranks, print the table (plus wall time and machine), write --json."""
    import time

    t0 = time.perf_counter()
    raw = launch(body, args)
    summary = summarize(raw, args)
    print_and_dump(print_table(summary, args), t0, args, {"summary": summary, "raw": raw})


def print_and_dump(lines: list[str], t0: float, args, payload: dict) -> None:
    """A bench's table printed with its wall time (since ``t0``) and machine; ``payload`` to ``--json``."""
    import json
    import time

    lines = lines + [f"wall time {time.perf_counter() - t0:.0f} s; {machine_line()}"]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **payload}, f, indent=1)
