"""Whole-tensor optimizers at every ZeRO stage: step time, optimizer-state bytes per rank and traffic, HF GPT-2.

What it measures
----------------
One HF ``GPT2LMHeadModel`` built from a config (random init, nothing downloaded; fp32) on 2 ranks (gloo on
CPU, NCCL with ``--device cuda``), trained by every method on the same per-rank batches from the same seed. A
method is ``<runner>/<optimizer>``:

* runners: ``ddp`` (torch ``DistributedDataParallel``, what Lightning's ``strategy="ddp"`` wraps the model
  in, then each optimizer's ``step()`` / ``zero_grad()``), ``zero1`` / ``zero2`` / ``zero3`` (``ZeroEngine``
  with that stage; stage 3's units are the ``GPT2Block``s), ``zero3_offload`` (stage 3 with
  ``offload_optimizer=True``: masters and optimizer state in host memory, parameters on the device);
* optimizers: ``adamw`` (torch AdamW on every parameter), ``muon`` (``lightning_zero.muon_split``: torch
  Muon on the hidden 2-D matrices, AdamW on embeddings, the tied head, biases and norms), ``adafactor``
  (torch Adafactor on every parameter). Muon and Adafactor are whole-tensor: at stages 1-3 each parameter is
  stepped whole on its owner rank ([Note: owner-rank step], lightning_zero/engine/optim/owner_step.py).

Timing is ``bench/harness.py``'s protocol: every round builds every method, runs ``--warmup`` untimed steps of
each, then ``--steps`` cycles in which the methods take one step each in turn (A B A B ..., the order rotated
per round), a barrier and an untimed lead-in step of the same method before each timed step; a step's time is
the slower rank's. Ratios are medians over cycles of (this method / DDP with the same optimizer, same cycle),
so the shared machine's load swings cancel. "optimizer step" is the part of the step after backward: DDP's
``optimizer.step()`` on every rank; the engine's ``step()`` (the last reductions, the optimizers on the masters
-- a whole-tensor one through its owner step --, the publish).

Bytes are counted, not estimated, after the last round's timed steps, on every rank:

* optimizer state: the tensors in each ``engine.shardeds[k]``'s optimizer state (``state_bytes()``; DDP: its
  optimizers' state tensors), max and min over ranks -- an owner holds the whole state of the parameters it
  owns, so whole-tensor state is balanced only as well as the owners are;
* masters: ``master_bytes()`` (fp32 master slices apart from the parameters), max over ranks; and the bytes of
  the whole masters an owner assembles for the step (freed after it), max over ranks;
* wire: ``engine.comm_report()`` of the last timed step (what this rank sends, by collective); the owner
  step's own share (its gather and scatter all-to-alls) counted from the same counters around its step. DDP's
  all-reduces are counted by a communication hook that all-reduces each bucket as DDP's default does.

No peak RSS: one process runs every method in turn, so its resident peak is the largest method's.

Run::

    python bench/whole_tensor.py                         # GPT-2 6 x 256, vocab 8192 (26 MiB fp32): 16 min at load 8
    python bench/whole_tensor.py --methods ddp/muon,zero2/muon --steps 10 --json /tmp/whole_tensor.json
    python bench/whole_tensor.py --device cuda           # 2 GPUs over NCCL; one GPU: add --world-size 1
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (cycle_ratio, launch, loss_of, make_batches, parse_interleaved_args,  # noqa: E402
                     print_and_dump)

from lightning_zero import muon_split  # noqa: E402
from lightning_zero.engine import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zero.engine.comm import collectives as C  # noqa: E402

RUNNERS = ("ddp", "zero1", "zero2", "zero3", "zero3_offload")
OPTIMIZERS = ("adamw", "muon", "adafactor")
ALL_METHODS = tuple(f"{r}/{o}" for r in RUNNERS for o in OPTIMIZERS)
DEFAULT_METHODS = (
    "ddp/adamw", "ddp/muon", "ddp/adafactor",
    "zero1/adamw", "zero1/muon", "zero2/adamw", "zero2/muon", "zero3/adamw", "zero3/muon",
    "zero3_offload/adamw", "zero3_offload/muon", "zero2/adafactor", "zero3/adafactor",
)


# -- model and optimizers ---------------------------------------------------------------------------
class GPT2Logits(nn.Module):
    """HF GPT-2 with the harness' call signature (tokens -> logits), so its loss and batches apply."""

    def __init__(self, args) -> None:
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.d_model,
                                      n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        self.gpt = transformers.GPT2LMHeadModel(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens).logits


def make_optimizers(which: str, model: GPT2Logits, args) -> list[torch.optim.Optimizer]:
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    if which == "adamw":
        return [torch.optim.AdamW(model.parameters(), **adamw)]
    if which == "muon":
        hidden, rest = muon_split(model.gpt)  # the HF model: its get_output_embeddings() names the head
        return [torch.optim.Muon(hidden, lr=20 * args.lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, **adamw)]
    return [torch.optim.Adafactor(model.parameters(), lr=10 * args.lr)]


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _ddp_counting_hook(state: dict, bucket):
    """DDP's default all-reduce of the bucket's mean, counted (ring: 2(N-1)/N of the bucket leaves each rank)."""
    n = dist.get_world_size()
    buf = bucket.buffer()
    state["calls"] += 1
    state["payload"] += buf.numel() * buf.element_size()
    state["wire"] += int(buf.numel() * buf.element_size() * 2 * (n - 1) / n)
    return dist.all_reduce(buf.div_(n), async_op=True).get_future().then(lambda f: f.value()[0])


class Method:
    """One method on one rank: the model, its optimizers, the DDP wrapper or the engine, and their byte counts."""

    def __init__(self, name: str, args, device: torch.device) -> None:
        runner, which = name.split("/")
        self.name, self.device = name, device
        torch.manual_seed(args.seed)
        self.model = GPT2Logits(args).to(device)
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.opts = make_optimizers(which, self.model, args)
        self.engine, self.ddp_count, self.owner_rows = None, None, {}
        if runner == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [device.index] if device.type == "cuda" else None
            self.module = DDP(self.model, device_ids=ids, bucket_cap_mb=args.bucket_mb)
            self.ddp_count = {"calls": 0, "payload": 0, "wire": 0}
            self.module.register_comm_hook(self.ddp_count, _ddp_counting_hook)
            return
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        stage = int(runner[4])
        cfg = ZeroConfig(stage=stage, offload_optimizer=runner.endswith("_offload"), bucket_mb=args.bucket_mb,
                         unit_classes=[GPT2Block] if stage == 3 else None)
        self.module = self.model
        self.engine = ZeroEngine(self.model, self.opts, cfg)
        for s in self.engine.shardeds:
            if s.owner is not None:
                self._count_owner_traffic(s.owner)

    def _count_owner_traffic(self, owner) -> None:
        """The collectives' counters read around the owner step (its gather and scatter), the step unchanged."""
        inner = owner.step

        def counted(run_step) -> None:
            before = C.stats.snapshot()
            inner(run_step)
            for key, row in C.stats.snapshot().items():
                prev = before.get(key, [0, 0, 0])
                acc = self.owner_rows.setdefault(f"{key[0]}@{key[1]}", [0, 0, 0])
                for i in range(3):
                    acc[i] += row[i] - prev[i]

        owner.step = counted

    def train_step(self, x: torch.Tensor, vocab: int, marks: Optional[list] = None) -> torch.Tensor:
        """One step; appends a perf_counter mark after backward to ``marks`` if given (the step phase follows)."""
        if self.engine is not None:
            self.engine.sync_buffers()  # ZeroStrategy.training_step does this (DDP broadcasts in forward)
        loss = loss_of(self.module, x, vocab)
        loss.backward()
        if marks is not None:
            _sync(self.device)
            marks.append(time.perf_counter())
        self.owner_rows = {}
        if self.engine is not None:
            self.engine.step()
        else:
            for o in self.opts:
                o.step()
                o.zero_grad(set_to_none=True)
            self.ddp_last = dict(self.ddp_count)  # the hook counted this step's backward
            self.ddp_count.update(calls=0, payload=0, wire=0)
        return loss.detach()

    def bytes_now(self) -> dict:
        """This rank's counted bytes: optimizer state, masters, the owner's whole masters, last step's wire."""
        if self.engine is None:
            last = self.ddp_last
            wire = {"all_reduce@ddp": [last["calls"], last["payload"], last["wire"]]}
            return {"state": sum(_state_bytes(o) for o in self.opts), "master": 0, "owner_whole": 0,
                    "wire_rows": wire, "wire": self.ddp_last["wire"], "owner_wire": 0,
                    "state_by_optimizer": {type(o).__name__: _state_bytes(o) for o in self.opts}}
        rep = self.engine.comm_report()
        by_opt: dict[str, int] = {}
        for s in self.engine.shardeds:
            by_opt[type(s.optimizer).__name__] = by_opt.get(type(s.optimizer).__name__, 0) + s.state_bytes()
        whole = sum(4 * it.spec.numel for s in self.engine.shardeds if s.owner is not None
                    for it in s.owner.owned(s.owner.rank))
        return {"state": sum(by_opt.values()), "master": sum(s.master_bytes() for s in self.engine.shardeds),
                "owner_whole": whole, "wire_rows": {f"{op}@{g}": v for (op, g), v in rep.rows.items()},
                "wire": rep.wire_bytes, "owner_wire": sum(r[2] for r in self.owner_rows.values()),
                "state_by_optimizer": by_opt}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.remove()


# -- rounds ---------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_round(methods: list[str], args, batches: list[torch.Tensor], device: torch.device) -> dict:
    """Build every method, warm up, then timed cycles A B A B ...; per method its times, loss and every rank's bytes."""
    built = {m: Method(m, args, device) for m in methods}
    for i in range(args.warmup):
        for m in methods:
            built[m].train_step(batches[i], args.vocab)
    times: dict[str, list[list[float]]] = {m: [] for m in methods}  # per step: whole step, optimizer step
    last: dict[str, torch.Tensor] = {}
    for i in range(args.warmup, args.warmup + args.steps):
        for m in methods:
            dist.barrier()
            built[m].train_step(batches[i], args.vocab)  # lead-in: what a step leaves in flight lands in the next
            _sync(device)
            t0, marks = time.perf_counter(), []
            last[m] = built[m].train_step(batches[i], args.vocab, marks)
            _sync(device)
            t2 = time.perf_counter()
            times[m].append([t2 - t0, t2 - marks[0]])
    out = {}
    for m in methods:
        t = torch.tensor(times[m], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        loss = last[m].double().clone()
        dist.all_reduce(loss)
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, built[m].bytes_now())
        out[m] = {"times_ms": (t[:, 0] * 1e3).tolist(), "step_phase_ms": (t[:, 1] * 1e3).tolist(),
                  "final_loss": float(loss) / dist.get_world_size(), "ranks": per_rank, "numel": built[m].numel}
        built[m].close()
    return out


def body(rank: int, args) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    batches = [x.to(device) for x in make_batches(args.warmup + args.steps, rank, args.batch, args.seq,
                                                  args.vocab)]
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for r in range(args.rounds):
        k = r % len(args.methods)
        for m, res in run_round(args.methods[k:] + args.methods[:k], args, batches, device).items():
            results[m].append(res)
        if rank == 0:
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return results


# -- summary ------------------------------------------------------------------------------------------------
def base_of(method: str) -> str:
    return "ddp/" + method.split("/")[1]


def summarize(raw: dict, args) -> dict:
    out = {}
    for m, rounds in raw.items():
        ranks = rounds[-1]["ranks"]
        state = [r["state"] for r in ranks]
        base = raw.get(base_of(m))
        out[m] = {
            "median_ms": statistics.median(t for r in rounds for t in r["times_ms"]),
            "ratio_vs_ddp": cycle_ratio(rounds, base) if base is not None else None,
            "step_phase_ms": statistics.median(t for r in rounds for t in r["step_phase_ms"]),
            "state_bytes_per_rank": state,
            "state_by_optimizer_per_rank": [r["state_by_optimizer"] for r in ranks],
            "master_bytes_per_rank": [r["master"] for r in ranks],
            "owner_whole_bytes_per_rank": [r["owner_whole"] for r in ranks],
            "wire_bytes_per_rank": [r["wire"] for r in ranks],
            "owner_wire_bytes_per_rank": [r["owner_wire"] for r in ranks],
            "wire_rows_rank0": ranks[0]["wire_rows"],
            "final_loss": rounds[-1]["final_loss"],
            "final_loss_per_round": [r["final_loss"] for r in rounds],
            "numel": rounds[-1]["numel"],
        }
    return out


def _mb(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _collective(key: str) -> str:
    op, group = key.split("@")
    return op if group in ("world", "ddp") else f"{op} ({group})"


def table(s: dict, args) -> list[str]:
    numel = next(iter(s.values()))["numel"]
    lines = [
        f"model: HF GPT2LMHeadModel from config, n_embd={args.d_model}, n_layer={args.layers}, n_head={args.heads}, "
        f"vocab={args.vocab}, seq={args.seq}, batch={args.batch}/rank, fp32; Psi={numel:,} params "
        f"({_mb(4 * numel)} MiB fp32); {args.world_size} ranks {args.backend} on {args.device}, "
        f"{args.threads} thread(s)/rank; bucket {args.bucket_mb} MiB",
        f"rounds={args.rounds} x (warmup {args.warmup} + {args.steps} timed steps) per method, interleaved; "
        "MiB per rank; wire: what a rank sends in one step",
        "",
        "| method | median ms | vs DDP (same opt.) | optimizer step ms | opt. state max | opt. state min | max/min "
        "| masters max | owner's whole masters max / min | wire max | of which owner step "
        "| wire by collective (rank 0: calls x MiB) | final loss | rel. diff vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for m, r in s.items():
        st = r["state_bytes_per_rank"]
        ratio = "-" if r["ratio_vs_ddp"] is None else f"{r['ratio_vs_ddp']:.2f}"
        imbalance = f"{max(st) / min(st):.2f}" if min(st) else "-"
        by_op = "; ".join(f"{_collective(k)} {v[0]} x {_mb(v[2])}" for k, v in sorted(r["wire_rows_rank0"].items()))
        base = s.get(base_of(m))
        rel = "-" if base is None else f"{abs(r['final_loss'] - base['final_loss']) / abs(base['final_loss']):.1e}"
        whole = r["owner_whole_bytes_per_rank"]
        lines.append(
            f"| {m} | {r['median_ms']:.1f} | {ratio} | {r['step_phase_ms']:.1f} | {_mb(max(st))} | {_mb(min(st))} "
            f"| {imbalance} | {_mb(max(r['master_bytes_per_rank']))} | {_mb(max(whole))} / {_mb(min(whole))} "
            f"| {_mb(max(r['wire_bytes_per_rank']))} | {_mb(max(r['owner_wire_bytes_per_rank']))} | {by_op} "
            f"| {r['final_loss']:.5f} | {rel} |"
        )
    lines += ["", "optimizer state by optimizer class, MiB per rank (rank 0, rank 1, ...):"]
    for m, r in s.items():
        per = r["state_by_optimizer_per_rank"]
        lines.append(f"  {m}: " + "; ".join(f"{name} " + ", ".join(_mb(p.get(name, 0)) for p in per)
                                            for name in per[0]))
    return lines


def _extra_args(p) -> None:
    p.set_defaults(d_model=256, layers=6, vocab=8192, batch=4)  # GPT-2 6 x 256: 6.85 M params, 26 MiB fp32
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")


def main() -> None:
    args = parse_interleaved_args(__doc__, ALL_METHODS, DEFAULT_METHODS, steps=8, warmup=2, rounds=4,
                                  extra=_extra_args)
    args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--device cuda --world-size {args.world_size} needs {args.world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible: pass --world-size {max(1, torch.cuda.device_count())}")
    t0 = time.perf_counter()
    raw = launch(body, args, world_size=args.world_size, start_method="spawn" if args.device == "cuda" else "fork")
    summary = summarize(raw, args)
    print_and_dump(table(summary, args), t0, args, {"summary": summary, "raw": raw})


if __name__ == "__main__":
    main()
