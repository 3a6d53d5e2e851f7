"""Block-sparse attention against dense attention with T5's bias: the longest sequence whose forward + backward
step trains under a real memory cap, and the step's measured peak memory.

What it measures
----------------
One attention layer of T5-small's shape (batch 1, 8 heads, head dim 64; ``--heads`` / ``--head-dim``, fp32),
one forward + backward of ``(out * w).sum()``, for:

* ``dense``   ``F.scaled_dot_product_attention`` with T5's (1, H, n, n) relative position bias as ``attn_mask``
              (what a T5 layer needs; the bias and its gradient are O(H n^2));
* ``sparse``  ``SparseSelfAttention`` with ``--layout`` (default BSLongformer: a 3-block sliding window and
              global block 0, ``--block`` 16) and T5's bias as a ``RelativeBias`` table (2n - 1 values per head).

[Note: the cap is the kernel's address space] Each step runs in its own subprocess. The child imports torch,
builds the inputs and runs a warm-up step at ``--warmup`` tokens (so thread pools and malloc arenas exist),
then caps its own address space with ``RLIMIT_AS`` at what it already maps plus ``--cap-gib``: every byte the
step allocates -- saved tensors, temporaries, gradients, the bias -- counts, and an allocation past the cap
fails (``RuntimeError`` / ``MemoryError``), which is what "does not fit" means here. The sparse layer's
layout and gather plan are made inside the capped step (a model's first step makes them). No model: the saved
bytes are counted too (``saved_tensors_hooks``, distinct storages), but the verdict is the real run.
Peak memory: the child resets its high-water mark (``/proc/self/clear_refs``) after the warm-up and
reports ``VmHWM - VmRSS`` before the step (the step's own resident peak).

The longest length: a ladder doubling from ``--start`` until a step fails, then a bisection between the
last length that trained and the first that did not, to ``--resolution`` tokens (multiples of ``--block``).

Run (the numbers in docs/sparse_attention.md: 2 shared CPU cores, 1 torch thread)::

    python bench/sparse_attention.py --cap-gib 2
    python bench/sparse_attention.py --probe 4096            # one length, both kinds, no cap
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from cap_ladder import cap_address_space, cuda_cap, longest as ladder, reset_peak, step_peak  # noqa: E402

KINDS = ("dense", "sparse")


def _saved_bytes(fn):
    import torch

    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def make_step(kind: str, n: int, args):
    """The inputs of one layer at length ``n`` and a function running its forward + backward."""
    import torch
    import torch.nn.functional as F

    from lightning_zero.sparse_attention import RelativeBias, SparseSelfAttention, make_sparsity_config

    H, d, dev = args.heads, args.head_dim, torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, d, generator=g).to(dev).requires_grad_() for _ in range(3))
    w = torch.randn(1, H, n, d, generator=g).to(dev)
    table = torch.randn(H, 2 * n - 1, generator=g).to(dev).requires_grad_()
    if kind == "sparse":
        # the layout and its plan are made in the first (measured) step, as in a model's first step
        att = SparseSelfAttention(make_sparsity_config(args.layout, H, args.block, **args.options))

        def fwd():
            return att(q, k, v, bias=RelativeBias(table, n - 1), scale=1.0)
    else:
        def fwd():
            rel = torch.arange(n, device=dev)[None, :] - torch.arange(n, device=dev)[:, None] + n - 1
            return F.scaled_dot_product_attention(q, k, v, attn_mask=table[:, rel][None], scale=1.0)

    def step(count_saved: bool = False):
        saved, out = _saved_bytes(fwd) if count_saved else (0, fwd())
        (out * w).sum().backward()
        return saved

    return step


def cuda_child(args, step) -> dict:
    """The same step on a GPU: the cap is torch's per-process memory fraction over what is allocated already,
    the peak ``max_memory_allocated`` (run by bench/gpu_check.sh part 6)."""
    import torch

    base = cuda_cap(args.cap_gib)
    t0 = time.perf_counter()
    try:
        saved = step(count_saved=True)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        return {"ok": False, "n": args.n, "kind": args.kind, "error": str(e).splitlines()[0][:160]}
    return {"ok": True, "n": args.n, "kind": args.kind, "seconds": time.perf_counter() - t0,
            "peak_bytes": torch.cuda.max_memory_allocated() - base, "saved_bytes": saved, "mapped_before": base}


def child(args) -> dict:
    """One step of ``args.kind`` at ``args.n`` tokens under the cap; the result as a dict (printed as JSON)."""
    import torch

    torch.set_num_threads(args.threads)
    make_step(args.kind, args.warmup, args)()  # thread pools, allocator arenas, lazy library state
    step = make_step(args.kind, args.n, args)
    if args.device == "cuda":
        return cuda_child(args, step)
    mapped = cap_address_space(args.cap_gib)
    rss0 = reset_peak()
    t0 = time.perf_counter()
    try:
        saved = step(count_saved=True)
    except (RuntimeError, MemoryError) as e:
        return {"ok": False, "n": args.n, "kind": args.kind, "error": str(e).splitlines()[0][:160]}
    return {"ok": True, "n": args.n, "kind": args.kind, "seconds": time.perf_counter() - t0,
            "peak_bytes": step_peak(rss0), "saved_bytes": saved, "mapped_before": mapped}


def run_child(kind: str, n: int, args, cap_gib: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, str(n), "--cap-gib", str(cap_gib),
           "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--layout", args.layout,
           "--block", str(args.block), "--threads", str(args.threads), "--warmup", str(args.warmup),
           "--device", args.device]
    cmd += [a for o in args.option for a in ("--option", o)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:  # killed (an allocation past the cap outside a Python-visible path)
        return {"ok": False, "n": n, "kind": kind, "error": f"exit {p.returncode}: {p.stderr.strip()[-160:]}"}
    return json.loads(lines[-1])


def longest(kind: str, args) -> tuple[dict | None, dict | None, list]:
    """The ladder then the bisection (cap_ladder.py): (longest run that trained, shortest that failed, every run)."""
    return ladder(lambda n: run_child(kind, n, args, args.cap_gib), kind, args.start, args.max_tokens,
                  args.resolution, args.block,
                  lambda r: f"ok, peak {r['peak_bytes'] / 2 ** 20:.0f} MiB, {r['seconds']:.1f} s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cap-gib", type=float, default=2.0, help="address space the step may add (0: no cap)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--start", type=int, default=1024, help="first length of the ladder (then doubled)")
    p.add_argument("--resolution", type=int, default=256, help="bisection stops at this many tokens")
    p.add_argument("--max-tokens", type=int, default=1 << 20)
    p.add_argument("--probe", type=int, nargs="*", help="only measure these lengths, uncapped")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="bslongformer")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--option", action="append", default=[], help="layout option key=value (int values)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=256, help="tokens of the uncapped warm-up step")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per child step")
    p.add_argument("--device", default="cpu", help="cpu (RLIMIT_AS) | cuda (a memory fraction; gpu_check.sh)")
    p.add_argument("--child", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.options = {k: int(v) for k, v in (o.split("=", 1) for o in args.option)}
    if args.child:
        args.kind, args.n = args.child[0], int(args.child[1])
        print(json.dumps(child(args)), flush=True)
        return
    kinds = args.kinds.split(",")
    head = (f"# heads {args.heads}, head dim {args.head_dim}, batch 1, fp32, layout {args.layout} block "
            f"{args.block} {args.options or ''}; {args.threads} thread(s)")
    if args.probe:
        print(head + "; uncapped")
        print("| tokens | kind | peak MiB | saved MiB | peak / saved | s |\n|---:|---|---:|---:|---:|---:|")
        for n in args.probe:
            for kind in kinds:
                r = run_child(kind, n, args, 0)
                print(f"| {n} | {kind} | {r['peak_bytes'] / 2 ** 20:.1f} | {r['saved_bytes'] / 2 ** 20:.1f} | "
                      f"{r['peak_bytes'] / r['saved_bytes']:.1f} | {r['seconds']:.2f} |", flush=True)
        return
    cap = "torch's memory fraction: what is allocated" if args.device == "cuda" else \
        "RLIMIT_AS = what the process maps"
    print(head + f"; {cap} after the warm-up + {args.cap_gib:g} GiB")
    found = {kind: longest(kind, args) for kind in kinds}
    print("\n| kind | longest that trained | peak MiB there | saved MiB there | s | first that failed |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, (ok, bad, _) in found.items():
        cells = ([f"{ok['n']}", f"{ok['peak_bytes'] / 2 ** 20:.0f}", f"{ok['saved_bytes'] / 2 ** 20:.0f}",
                  f"{ok['seconds']:.1f}"] if ok else ["none", "-", "-", "-"])
        print(f"| {kind} | " + " | ".join(cells) + f" | {bad['n'] if bad else '-'} |")
    (dok, _, _), (sok, _, _) = found.get("dense", (None,) * 3), found.get("sparse", (None,) * 3)
    if dok and sok:
        print(f"\nsparse trains {sok['n'] / dok['n']:.1f}x the tokens of dense with T5's bias under "
              f"{args.cap_gib:g} GiB")


if __name__ == "__main__":
    main()
