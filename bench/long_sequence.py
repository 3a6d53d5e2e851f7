"""GPT-2 at long sequences: the longest sequence that trains one step under a per-rank memory cap, plain vs tiled
MLP + tiled loss vs tiled + activation checkpointing, with tokens/s and the bytes on the wire.

What it measures
----------------
An HF GPT-2 from its config (default ``n_embd`` 256, 4 layers, 8 heads, GPT-2's vocabulary of 50257, dropout
off, fp32, batch 1), trained by ``ZeroEngine`` (``--stage``, default 3; AdamW), one step = forward + backward +
optimizer step of HF's causal LM loss on a random sequence of ``n`` tokens, for:

* ``plain``       the model as HF builds it: the (1, n, 4h) MLP intermediates and the (1, n, V) logits whole
                  (V = 50257: 200 KB per token in fp32, several copies alive in backward);
* ``tiled``       ``tile_mlp`` + ``tile_lm_loss`` (``lightning_zero.sequence_parallel``, ``--tile`` tokens per
                  tile): one tile of MLP intermediates and of logits at a time, each recomputed in backward;
* ``tiled_ckpt``  tiled, plus the engine's activation checkpointing (``activation_checkpointing="auto"``: every
                  ``GPT2Block`` keeps only its input).

Each measured step runs in its own process (and its ranks), after an uncapped warm-up step at ``--warmup``
tokens (AdamW's state, thread pools); each rank then caps its own address space (``RLIMIT_AS``, or torch's
CUDA memory fraction with ``--device cuda``) at what it maps plus ``--cap-gib`` (bench/cap_ladder.py, the
harness of bench/sparse_attention.py): the step fits when every rank's step does. The longest length: a
ladder doubling from ``--start``, then a bisection to ``--resolution`` tokens. tokens/s = n / the step's wall
time (the slowest rank); wire bytes = ``engine.comm_report()`` of the measured step on rank 0.

Sequence parallelism: ``--sp S`` (S > 1) runs S ranks (gloo on CPU, NCCL with ``--device cuda``) forming one
sequence-parallel group: ``apply_sequence_parallel(model, group)`` and ``sharding.shard_batch(batch)`` from
``lightning_zero.sequence_parallel`` (Ulysses attention, the whole sequence's loss on every rank); the cap is
per rank, so the longest sequence should grow about S-fold (target >= 1.8x per doubling of S).

Run (the numbers in docs/benchmarks.md: 2 shared CPU cores, 1 torch thread per rank)::

    PYTHONPATH=. python bench/long_sequence.py --cap-gib 1
    PYTHONPATH=. python bench/long_sequence.py --probe 2048 4096          # these lengths, uncapped
    PYTHONPATH=. python bench/long_sequence.py --sp 2 --cap-gib 1         # needs apply_sequence_parallel
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from cap_ladder import cap_address_space, cuda_cap, longest, reset_peak, step_peak  # noqa: E402 (bench/ on sys.path)

KINDS = ("plain", "tiled", "tiled_ckpt")
FAILED = "the step did not fit:"


def build(kind: str, n_positions: int, args):
    """The model of ``kind`` (before its engine), seeded."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=args.embd, n_layer=args.layers, n_head=args.heads, vocab_size=args.vocab,
                                  n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    # the position table has a row per token of the longest sequence: trained, its gradient, AdamW's two moments
    # and the step's temporaries would grow with n on their own (~6 KB per token); frozen, only its rows remain
    model.transformer.wpe.weight.requires_grad_(False)
    return model


def apply_sp():
    """``apply_sequence_parallel`` (the Ulysses attention and data path), or None where this checkout lacks it."""
    try:
        from lightning_zero.sequence_parallel import apply_sequence_parallel
    except ImportError:
        return None
    return apply_sequence_parallel


def sequence_parallel(model, args):
    """This rank's sequence sharding over the one group of S ranks (S > 1), or None."""
    if args.sp == 1:
        return None
    import torch.distributed as dist

    return apply_sp()(model, dist.group.WORLD)


def rank_step(rank: int, world_size: int, args) -> dict:
    """One rank: warm-up step, the cap, the measured step at ``args.n`` tokens."""
    import torch

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.sequence_parallel import tile_lm_loss, tile_mlp

    dev = torch.device("cuda", rank % max(1, torch.cuda.device_count())) if args.device == "cuda" else None
    model = build(args.kind, args.n, args)
    sharding = sequence_parallel(model, args)
    if args.kind != "plain":
        tile_mlp(model, args.tile)
        tile_lm_loss(model, args.tile)
    if dev is not None:
        model = model.to(dev)
    cfg = ZeroConfig(stage=args.stage, activation_checkpointing="auto" if args.kind == "tiled_ckpt" else None)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg)

    def step(n: int) -> float:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, args.vocab, (1, n), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        if sharding is not None:  # this rank's slice; the labels shifted on the whole sequence first
            batch = sharding.shard_batch(batch)
        if dev is not None:
            batch = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}
        engine.prepare_forward()
        loss = model(**batch).loss
        loss.backward()
        engine.step()
        return loss.item()

    step(args.warmup)
    out = {"rank": rank, "n": args.n, "kind": args.kind}
    if dev is not None:
        base = cuda_cap(args.cap_gib)
    else:
        out["mapped_before"] = cap_address_space(args.cap_gib)
        rss0 = reset_peak()
    t0 = time.perf_counter()
    try:
        out["loss"] = step(args.n)
        if dev is not None:
            torch.cuda.synchronize()
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        # raised, not returned: the rank's exit ends the others, which would wait in a collective otherwise
        raise RuntimeError(f"{FAILED} {str(e).splitlines()[0][:160]}") from None
    out["seconds"] = time.perf_counter() - t0
    out["peak_bytes"] = torch.cuda.max_memory_allocated() - base if dev is not None else step_peak(rss0)
    report = engine.comm_report()
    return {**out, "ok": True, "wire_bytes": report.wire_bytes, "calls": report.calls}


def child(args) -> dict:
    """The measured step on ``args.sp`` ranks; every rank's verdict joined (fits only if every rank's step fits)."""
    import torch

    from lightning_zero.tools.launch import run_ranks

    torch.set_num_threads(args.threads)
    backend = "nccl" if args.device == "cuda" else "gloo"
    try:
        ranks = run_ranks(rank_step, args.sp, (args,), start_method="spawn" if args.device == "cuda" else "fork",
                          backend=backend, threads=args.threads, timeout_s=args.timeout)
    except RuntimeError as e:  # a step past the cap, or a rank killed (past the cap outside Python's sight)
        text = str(e)
        error = text[text.index(FAILED) + len(FAILED):].splitlines()[0].strip() if FAILED in text else \
            text.strip().splitlines()[-1]
        return {"ok": False, "n": args.n, "kind": args.kind, "error": error[:160]}
    return {"ok": True, "n": args.n, "kind": args.kind, "seconds": max(r["seconds"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks), "wire_bytes": ranks[0]["wire_bytes"],
            "calls": ranks[0]["calls"], "loss": ranks[0]["loss"]}


def run_child(kind: str, n: int, args, cap_gib: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, str(n), "--cap-gib", str(cap_gib),
           "--sp", str(args.sp), "--stage", str(args.stage), "--tile", str(args.tile), "--embd", str(args.embd),
           "--layers", str(args.layers), "--heads", str(args.heads), "--vocab", str(args.vocab),
           "--threads", str(args.threads), "--warmup", str(args.warmup), "--device", args.device,
           "--timeout", str(args.timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout + 60)
    except subprocess.TimeoutExpired:
        return {"ok": False, "n": n, "kind": kind, "error": f"no result in {args.timeout + 60:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"ok": False, "n": n, "kind": kind, "error": f"exit {p.returncode}: {p.stderr.strip()[-160:]}"}
    return json.loads(lines[-1])


def _describe(r: dict) -> str:
    return (f"ok, peak {r['peak_bytes'] / 2 ** 20:.0f} MiB, {r['seconds']:.1f} s, "
            f"{r['n'] / r['seconds']:.0f} tokens/s, wire {r['wire_bytes'] / 2 ** 20:.1f} MiB")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cap-gib", type=float, default=1.0, help="memory a rank's step may add (0: no cap)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel size S: ranks in the one SP group")
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    p.add_argument("--tile", type=int, default=256, help="tokens per tile of the tiled kinds")
    p.add_argument("--start", type=int, default=1024, help="first length of the ladder (then doubled)")
    p.add_argument("--resolution", type=int, default=256, help="bisection stops at this many tokens")
    p.add_argument("--multiple", type=int, default=256, help="lengths are multiples of this (S must divide it)")
    p.add_argument("--max-tokens", type=int, default=1 << 20)
    p.add_argument("--probe", type=int, nargs="*", help="only measure these lengths, uncapped")
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--warmup", type=int, default=256, help="tokens of the uncapped warm-up step")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per measured step")
    p.add_argument("--device", default="cpu", help="cpu (RLIMIT_AS) | cuda (a memory fraction; gpu_check.sh)")
    p.add_argument("--json", help="write every run here")
    p.add_argument("--child", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    if any(k not in KINDS for k in kinds) or args.sp < 1 or args.multiple % args.sp or args.warmup % args.sp:
        p.error(f"--kinds takes {', '.join(KINDS)}; --sp a positive int dividing --multiple and --warmup")
    if args.sp > 1 and apply_sp() is None:
        p.error(f"--sp {args.sp} needs lightning_zero.sequence_parallel.apply_sequence_parallel (Ulysses attention), "
                "which this checkout lacks; --sp 1 runs without it")
    if args.child:
        args.kind, args.n = args.child[0], int(args.child[1])
        print(json.dumps(child(args)), flush=True)
        return
    head = (f"# GPT-2 n_embd {args.embd}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, batch 1, "
            f"fp32, ZeRO stage {args.stage}, AdamW; SP {args.sp} rank(s), {args.threads} thread(s) each; "
            f"tile {args.tile}")
    if args.probe:
        print(head + "; uncapped")
        print("| tokens | kind | peak MiB | s | tokens/s | wire MiB |\n|---:|---|---:|---:|---:|---:|")
        for n in args.probe:
            for kind in kinds:
                r = run_child(kind, n, args, 0)
                print(f"| {n} | {kind} | " + (f"{r['peak_bytes'] / 2 ** 20:.0f} | {r['seconds']:.1f} | "
                      f"{n / r['seconds']:.0f} | {r['wire_bytes'] / 2 ** 20:.1f} |" if r["ok"] else
                      f"failed: {r['error']} | | | |"), flush=True)
        return
    cap = "torch's memory fraction: what is allocated" if args.device == "cuda" else \
        "RLIMIT_AS = what the rank maps"
    print(head + f"; {cap} after the warm-up + {args.cap_gib:g} GiB per rank")
    found = {kind: longest(lambda n, kind=kind: run_child(kind, n, args, args.cap_gib), kind, args.start,
                           args.max_tokens, args.resolution, args.multiple, _describe) for kind in kinds}
    print("\n| kind | SP | longest that trained | peak MiB there | s | tokens/s | wire MiB / step | "
          "first that failed |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, (ok, bad, _) in found.items():
        cells = ([f"{ok['n']}", f"{ok['peak_bytes'] / 2 ** 20:.0f}", f"{ok['seconds']:.1f}",
                  f"{ok['n'] / ok['seconds']:.0f}", f"{ok['wire_bytes'] / 2 ** 20:.1f}"] if ok else ["none"] + ["-"] * 4)
        print(f"| {kind} | {args.sp} | " + " | ".join(cells) + f" | {bad['n'] if bad else '-'} |")
    plain = found.get("plain", (None,))[0]
    for kind in ("tiled", "tiled_ckpt"):
        ok = found.get(kind, (None,))[0]
        if plain and ok:
            print(f"{kind} trains {ok['n'] / plain['n']:.1f}x the tokens of plain under {args.cap_gib:g} GiB per rank")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": {k: v[2] for k, v in found.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
