"""Communication on GPUs (NCCL): the gradient-reduction choice, the overlapped publish, int8 bytes and time.

The CPU tables (bench/step_time.py --comm-only, bench/comm_bytes.py) decided ``grad_reduce="auto"`` for gloo;
this script gives the same rows for NCCL, where one rank per GPU is needed:

1. **int8 kernels** (any GPU, one process): quantize + dequantize of an fp32 buffer on the device (ZeRO++'s
   qwZ / qgZ cost before anything travels): ms, GB/s of fp32 input, worst error / its bound (half a step of
   its own block; must be <= 1).
2. **collectives** (>= 2 GPUs, NCCL, one rank each): per bucket size, median ms of all_reduce,
   reduce_scatter_tensor, the all-to-all reduce-scatter, int8 reduce-scatter (qgZ), all_gather_into_tensor
   and int8 all-gather (qwZ), the bytes each sends, and which reduction ``auto`` picks for NCCL
   (``GRAD_REDUCE_BY_BACKEND``: NCCL's own reduce-scatter) beside the fastest measured.
3. **step time** (>= 2 GPUs): ``harness.TinyLM`` at ``--d-model`` on the GPUs, fp32 AdamW, DDP and ZeRO-2
   blocking / overlapped publish / int8, ZeRO-3 and ZeRO-3 int8; median ms per step, ratio vs DDP, final
   loss (exact methods must agree with DDP to ~1e-5 relative), bytes per step from ``engine.comm_report()``.

With one GPU only part 1 runs (two NCCL ranks cannot share a device) and the script says so.
``--dry-run-cpu`` runs parts 2-3 on 2 gloo CPU ranks with small sizes: it checks the script itself on a
machine without a GPU (the numbers then mean nothing for NCCL).

Run::

    python bench/comm_gpu.py                 # on the GPU machine (bench/gpu_check.sh part 5)
    python bench/comm_gpu.py --dry-run-cpu   # script check on CPU, ~30 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BLOCK_CLASS, TinyLM, loss_of, make_batches  # noqa: E402

from lightning_zero import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zero.engine.comm import collectives as C  # noqa: E402
from lightning_zero.engine.comm import quantize as Q  # noqa: E402
from lightning_zero.tools.tuning.harness import launch  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, reps: int, barrier: bool = True) -> float:
    fn()  # first call: NCCL / gloo set up their buffers
    times = []
    for _ in range(reps):
        if barrier:
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    x = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    if barrier:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)  # the slower rank's
    return float(x) * 1e3


# -- 1. the int8 kernels ---------------------------------------------------------------------------------
def kernels(device: torch.device, sizes_mib: list[float], reps: int) -> list[str]:
    lines = [f"int8 kernels on {device}: quantize + dequantize, block {Q.BLOCK}", "",
             "| fp32 MiB | ms | GB/s (fp32 in) | worst error / bound |", "|---|---|---|---|"]
    for mib in sizes_mib:
        n = int(mib * 2**20 / 4)
        x = torch.randn(n, device=device)

        def roundtrip():
            q, s = Q.quantize(x)
            return Q.dequantize(q, s, n), s

        ms = _median_ms(roundtrip, device, reps, barrier=False)
        y, s = roundtrip()
        bound = (s / 2).repeat_interleave(Q.BLOCK, dim=1).view(-1)[:n]  # half a step of each element's block
        worst = float(((y.view(-1) - x).abs() / bound.clamp_min(1e-30)).max())
        lines.append(f"| {mib:g} | {ms:.3f} | {4 * n / ms / 1e6:.1f} | {worst:.3f} |")
    return lines


# -- 2. collectives --------------------------------------------------------------------------------------
def collectives(device: torch.device, sizes_mib: list[float], reps: int) -> dict:
    n = dist.get_world_size()
    out = {}
    for mib in sizes_mib:
        numel = int(mib * 2**20 / 4)
        shard = -(-numel // n)
        full, part = torch.randn(shard * n, device=device), torch.empty(shard, device=device)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, full),
            "all_to_all RS": lambda: Q.reduce_scatter_by_all_to_all(part, full),
            "int8 RS (qgZ)": lambda: Q.reduce_scatter_int8(part, full),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, part),
            "int8 AG (qwZ)": lambda: Q.all_gather_int8(full, part),
        }
        row = {k: _median_ms(op, device, reps) for k, op in ops.items()}
        row["bytes fp32 RS"] = 4 * shard * (n - 1)  # what each rank sends, ring accounting
        row["bytes int8 RS"] = Q.packed_numel(shard) * (n - 1)
        out[f"{mib:g} MiB"] = row
    return out


# -- 3. step time ----------------------------------------------------------------------------------------
METHODS = {
    "ddp": None,
    "zero2": dict(stage=2),
    "zero2_overlap": dict(stage=2, overlap_publish=True),
    "zero2_q": dict(stage=2, quantize_weights=True, quantize_grads=True),
    "zero3": dict(stage=3),
    "zero3_q": dict(stage=3, quantize_weights=True, quantize_grads=True),
}


def _build(method: str, args, device: torch.device):
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.d_model, args.layers, args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    if METHODS[method] is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids), opt, None
    unit = [BLOCK_CLASS] if METHODS[method]["stage"] == 3 else None
    engine = ZeroEngine(model, opt, ZeroConfig(**METHODS[method], unit_classes=unit))
    return model, opt, engine


def step_times(rank: int, device: torch.device, args) -> dict:
    batches = [x.to(device) for x in make_batches(args.steps + 3, rank, args.batch, args.seq, args.vocab)]
    out = {}
    for method in METHODS:
        module, opt, engine = _build(method, args, device)
        times, loss = [], None
        for i, x in enumerate(batches):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            loss = loss_of(module, x, args.vocab)
            loss.backward()
            if engine is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                engine.step()
            _sync(device)
            if i >= 3:  # warm-up steps untimed
                times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        report = engine.comm_report() if engine is not None else None
        out[method] = {"ms": float(t) * 1e3, "loss": float(loss.detach()),
                       "bytes": report.wire_bytes if report is not None else None}
        if engine is not None:
            engine.remove()
    return out


def body(rank: int, args) -> dict:
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    res = {"collectives": collectives(device, args.mib, args.reps)}
    res["steps"] = step_times(rank, device, args)
    res["auto"] = C.grad_reduce_mode("auto")
    return res


def report(res: dict, args) -> list[str]:
    n = args.world_size
    lines = [f"collectives, {n} ranks {args.backend}, fp32, median ms (slower rank):", ""]
    sizes = res["collectives"]
    ops = [k for k in next(iter(sizes.values())) if not k.startswith("bytes")]
    lines += ["| size | " + " | ".join(ops) + " | B sent fp32 RS | int8 RS |", "|---" * (len(ops) + 3) + "|"]
    for size, row in sizes.items():
        lines.append(f"| {size} | " + " | ".join(f"{row[k]:.3f}" for k in ops)
                     + f" | {row['bytes fp32 RS']:,} | {row['bytes int8 RS']:,} |")
    rs = ("all_reduce", "reduce_scatter_tensor", "all_to_all RS")
    best = {size: min(rs, key=lambda k: row[k]) for size, row in sizes.items()}
    lines += ["", f"grad_reduce='auto' on {args.backend}: {res['auto']}; fastest exact reduction by size: "
              + ", ".join(f"{s}: {b}" for s, b in best.items()), ""]
    steps = res["steps"]
    ddp = steps["ddp"]
    lines += [f"step time, TinyLM d_model={args.d_model} layers={args.layers} batch={args.batch}x{args.seq}, "
              f"fp32 AdamW, {n} ranks:", "",
              "| method | median ms | vs DDP | final loss | rel. diff to DDP | wire bytes/step |", "|---|---|---|---|---|---|"]
    for m, r in steps.items():
        rel = abs(r["loss"] - ddp["loss"]) / abs(ddp["loss"])
        b = "-" if r["bytes"] is None else f"{r['bytes']:,}"
        lines.append(f"| {m} | {r['ms']:.2f} | {r['ms'] / ddp['ms']:.3f} | {r['loss']:.6f} | {rel:.2e} | {b} |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run-cpu", action="store_true", help="parts 2-3 on 2 gloo CPU ranks, small sizes")
    p.add_argument("--mib", type=float, nargs="+", default=[2.5, 25, 100], help="bucket sizes (fp32 MiB)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count()
    if args.dry_run_cpu:
        args.mib, args.reps, args.d_model, args.layers, args.seq, args.vocab, args.steps = [0.5], 3, 64, 2, 32, 500, 3
        args.backend, args.world_size = "gloo", 2
    else:
        if gpus == 0:
            raise SystemExit("no CUDA device: run with --dry-run-cpu to check the script on CPU")
        print("\n".join(kernels(torch.device("cuda", 0), args.mib, args.reps)), flush=True)
        if gpus < 2:
            print(f"\nonly {gpus} GPU visible: the NCCL collectives and step times need >= 2 (one rank per GPU); "
                  "they wait for a multi-GPU machine.")
            return
        args.backend, args.world_size = "nccl", gpus
    res = launch(body, SimpleNamespace(**vars(args), threads=1), world_size=args.world_size, start_method="spawn")
    print("\n" + "\n".join(report(res, args)))


if __name__ == "__main__":
    main()
