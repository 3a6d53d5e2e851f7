"""Block-sparse attention against dense SDPA: time and activation memory per sequence length, and the longest
sequence whose attention activations fit a memory cap.

What it measures
----------------
One attention layer of T5-small's shape (batch 1, 8 heads, head dim 64; ``--heads`` / ``--head-dim``),
forward + backward of ``(out * w).sum()``, for:

* ``sdpa``        ``F.scaled_dot_product_attention(q, k, v)``, no bias: torch's fused CPU kernel (O(n) saved,
                  O(n^2) time). What a model without a position bias gets;
* ``sdpa+bias``   the same with T5's (1, H, n, n) relative position bias as ``attn_mask`` (what a T5 layer needs:
                  the bias and its gradient are O(H n^2));
* ``sparse``      ``SparseSelfAttention`` with ``--layout`` (default BSLongformer: a 3-block sliding window and
                  global block 0, ``--block`` 16) and T5's bias as a ``RelativeBias`` (2n - 1 values per head).

Time: median of ``--reps`` runs (after one warm-up). Memory: the bytes autograd saves for backward, counted
with ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages), plus the bias tensor the layer is
handed (for ``sdpa+bias`` the (1, H, n, n) bias; ``sparse``: its table). The longest sequence under
``--cap-gib``: these bytes are measured at each length, fitted (sparse: linear, sdpa+bias: quadratic) and
solved for the cap; the sparse answer is then checked by a real run at that length (``--verify``).
Lengths where the dense bias alone exceeds the cap are not run (``over cap``).

Run (the numbers in docs/benchmarks.md: 2 shared CPU cores, torch threads 2)::

    python bench/sparse_attention.py --lengths 1024 2048 4096 8192 16384 --reps 3 --cap-gib 2 --verify
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from lightning_zero.sparse_attention import RelativeBias, SparseSelfAttention, make_sparsity_config


def saved_bytes(fn) -> tuple[int, object]:
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def case(kind: str, n: int, args) -> tuple[float, int]:
    H, d, dev = args.heads, args.head_dim, torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, d, generator=g).to(dev).requires_grad_() for _ in range(3))
    w = torch.randn(1, H, n, d, generator=g).to(dev)
    table = torch.randn(H, 2 * n - 1, generator=g).to(dev).requires_grad_()
    if kind == "sparse":
        att = SparseSelfAttention(make_sparsity_config(args.layout, H, args.block, **args.options))
        att.plan(att.padded_length(n))  # the layout is made once per length, outside the timing
        extra = table.numel() * 4

        def fwd():
            return att(q, k, v, bias=RelativeBias(table, n - 1), scale=1.0)
    elif kind == "sdpa+bias":
        extra = H * n * n * 4

        def fwd():
            rel = torch.arange(n, device=dev)[None, :] - torch.arange(n, device=dev)[:, None] + n - 1
            return F.scaled_dot_product_attention(q, k, v, attn_mask=table[:, rel][None], scale=1.0)
    else:
        extra = 0

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, scale=1.0)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step():
        out = fwd()
        (out * w).sum().backward()
        sync()

    nbytes, out = saved_bytes(fwd)
    del out
    step()  # warm-up
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), nbytes + extra


def longest(lengths, nbytes, cap, degree):
    coef = np.polyfit(np.array(lengths, float), np.array(nbytes, float), degree)
    roots = np.roots(coef - np.array([0] * degree + [cap]))
    real = [r.real for r in roots if abs(r.imag) < 1e-6 and r.real > 0]
    return int(max(real)) if real else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="bslongformer")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--option", action="append", default=[], help="layout option key=value (int values)")
    p.add_argument("--cap-gib", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--verify", action="store_true", help="run sparse at its predicted longest length")
    p.add_argument("--device", default="cpu", help="cpu | cuda (bench/gpu_check.sh part 6)")
    p.add_argument("--kinds", default="sdpa,sdpa+bias,sparse", help="which of sdpa, sdpa+bias, sparse to run")
    args = p.parse_args(argv)
    args.options = {k: int(v) for k, v in (o.split("=", 1) for o in args.option)}
    torch.set_num_threads(args.threads)
    cap = args.cap_gib * 2 ** 30
    print(f"# heads {args.heads}, head dim {args.head_dim}, batch 1, fp32, layout {args.layout} block {args.block} "
          f"{args.options or ''}; torch {torch.__version__}, {args.device}, {args.threads} threads; "
          f"cap {args.cap_gib:g} GiB")
    print("| tokens | sdpa ms | sdpa MiB | sdpa+bias ms | sdpa+bias MiB | sparse ms | sparse MiB "
          "| sparse / sdpa+bias time |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    res: dict = {k: {} for k in ("sdpa", "sdpa+bias", "sparse")}
    for n in args.lengths:
        row = [str(n)]
        for kind in res:
            if kind not in args.kinds.split(","):
                row += ["-", "-"]
                continue
            if kind == "sdpa+bias" and args.heads * n * n * 4 * 3 > cap:  # bias, its grad, the gathered copy
                row += ["over cap", "over cap"]
                continue
            t, b = case(kind, n, args)
            res[kind][n] = (t, b)
            row += [f"{t * 1e3:.0f}", f"{b / 2 ** 20:.1f}"]
        dense = res["sdpa+bias"].get(n)
        sparse = res["sparse"].get(n)
        row.append(f"{sparse[0] / dense[0]:.2f}" if dense and sparse else "-")
        print("| " + " | ".join(row) + " |", flush=True)
    sl = sorted(res["sparse"])
    dl = sorted(res["sdpa+bias"])
    n_sparse = longest(sl, [res["sparse"][n][1] for n in sl], cap, 1) if len(sl) >= 2 else None
    n_dense = longest(dl, [res["sdpa+bias"][n][1] for n in dl], cap, 2) if len(dl) >= 3 else None
    fl = sorted(res["sdpa"])
    n_flash = longest(fl, [res["sdpa"][n][1] for n in fl], cap, 1) if len(fl) >= 2 else None
    print(f"\nlongest sequence under {args.cap_gib:g} GiB of attention activations (fitted): "
          f"sdpa+bias {n_dense}, sparse {n_sparse}"
          + (f" ({n_sparse / n_dense:.1f}x)" if n_sparse and n_dense else "")
          + f"; sdpa without a bias (fused kernel, O(n) saved, O(n^2) time) {n_flash}")
    if args.verify and n_sparse:
        n = n_sparse // args.block * args.block
        args.reps = 1
        t, b = case("sparse", n, args)
        print(f"verified: sparse at {n} tokens saves {b / 2 ** 30:.2f} GiB ({t:.1f} s forward + backward)")


if __name__ == "__main__":
    main()
