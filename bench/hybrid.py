"""Hybrid sharding: bytes on the wire per step, by group, and step time -- ours beside FSDP2's HYBRID_SHARD.

Four gloo ranks seen as 2 "nodes" x 2 ranks. Methods (stage 3 / fully sharded, the bench model of
``bench/harness.py``, one unit per transformer block):

* ``zero3``         -- ``ZeroConfig(stage=3)``: shard over all 4 ranks (K = N);
* ``zero3_hybrid``  -- ``ZeroConfig(stage=3, shard_group_size=2)``: shard inside each node, replicate across;
* ``fsdp2``         -- ``fully_shard(mesh=init_device_mesh("cpu", (4,)))``;
* ``fsdp2_hybrid``  -- ``fully_shard(mesh=init_device_mesh("cpu", (2, 2)))``: FSDP2's HYBRID_SHARD (HSDP).

Traffic: one step of each method (after a warm-up step) with ``torch.distributed``'s collectives wrapped,
so ours and FSDP2 are counted by the same code, by group -- "shard" (inside a node), "replicate" (across
nodes, one rank per node) or "world" (all 4 ranks: crosses nodes). Two figures per rank: the bytes handed
to collectives (all-gather: its input shard; reduce-scatter: the full input; all-reduce / broadcast: the
tensor) and the bytes a ring implementation puts on the wire for them over a group of n ranks
(all-gather (n-1) x input, reduce-scatter (n-1)/n x input, all-reduce 2 (n-1)/n x tensor, broadcast 1 x).
Step time: the interleaved rounds of the harness (A B C D A B C D ..., max over ranks, median).

Run::

    python bench/hybrid.py                       # ~1-2 minutes on 2 loaded cores
    python bench/hybrid.py --d-model 256 --layers 4 --rounds 3 --json out.json
"""

from __future__ import annotations

import contextlib
import inspect
import os
import statistics
import sys
import warnings
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    BLOCK_CLASS, Runner, build, launch, machine_line, make_adamw, make_batches, make_tiny_lm, parse_interleaved_args,
    run_rounds, train_step)

from lightning_zero.engine import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zero.engine.comm import collectives as C  # noqa: E402

WORLD, NODE = 4, 2
METHODS = ("zero3", "zero3_hybrid", "fsdp2", "fsdp2_hybrid")
_OPS = ("all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
        "reduce_scatter_tensor", "all_reduce", "broadcast")
_INPUT = {"all_gather": "tensor", "all_gather_single": "input_tensor", "all_gather_into_tensor": "input_tensor",
          "reduce_scatter": "input_list", "reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
          "all_reduce": "tensor", "broadcast": "tensor"}


def build_hybrid(method: str, args) -> Runner:
    if method == "zero3_hybrid":
        torch.manual_seed(args.seed)
        model = make_tiny_lm(args)
        opt = make_adamw(model.parameters(), args)
        cfg = ZeroConfig(stage=3, shard_group_size=NODE, bucket_mb=args.bucket_mb, unit_classes=[BLOCK_CLASS])
        return Runner(method, model, model, opt, ZeroEngine(model, opt, cfg))
    if method == "fsdp2_hybrid":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        torch.manual_seed(args.seed)
        model = make_tiny_lm(args)
        mesh = _hsdp_mesh()
        for m in model.modules():
            if isinstance(m, BLOCK_CLASS):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Runner(method, model, model, make_adamw(model.parameters(), args))
    return build(method, args)


_MESH: list = []


def _hsdp_mesh():
    if not _MESH:  # made once: a mesh per build would make new groups every round
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD // NODE, NODE), mesh_dim_names=("replicate", "shard"))
        for dim in ("replicate", "shard"):
            C.name_group(mesh.get_group(dim), dim)
        _MESH.append(mesh)
    return _MESH[0]


@contextlib.contextmanager
def count_bytes(out: Counter):
    """Wrap torch.distributed's collectives: ``out[(group name, op)] += bytes`` this rank sends."""
    saved = {op: getattr(dist, op) for op in _OPS if hasattr(dist, op)}

    def wrap(op, fn):
        sig = inspect.signature(fn)

        def counted(*a, **k):
            bound = sig.bind(*a, **k)
            t = bound.arguments[_INPUT[op]]
            nbytes = sum(x.numel() * x.element_size() for x in t) if isinstance(t, list) else t.numel() * t.element_size()
            kind = "all_gather" if "gather" in op else "reduce_scatter" if "scatter" in op else op
            group = bound.arguments.get("group")
            out[(C.group_name(group), kind, dist.get_world_size(group))] += nbytes
            return fn(*a, **k)

        return counted

    for op, fn in saved.items():
        setattr(dist, op, wrap(op, fn))
    try:
        yield
    finally:
        for op, fn in saved.items():
            setattr(dist, op, fn)


def traffic(method: str, args, batches) -> dict:
    r = build_hybrid(method, args)
    train_step(r, batches[0], args.vocab)  # warm-up: stage 3 records its unit order, state is created
    counts: Counter = Counter()
    with count_bytes(counts):
        train_step(r, batches[1], args.vocab)
    r.close()
    return {f"{g}/{op}/{n}": v for (g, op, n), v in sorted(counts.items())}


_WIRE = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
         "all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}


def body(rank: int, args) -> dict:
    batches = make_batches(args.warmup + args.steps + 2, rank, args.batch, args.seq, args.vocab)
    _hsdp_mesh()
    bytes_by = {m: traffic(m, args, batches) for m in args.methods}
    timed = run_rounds(args.methods, args, batches, rank, build_hybrid)
    return {"bytes": bytes_by, "rounds": timed}


def table(raw: dict, args) -> list[str]:
    groups = ("shard", "replicate", "world")
    lines = [f"bytes per step per rank (MB) by group and step time; {WORLD} gloo ranks as {WORLD // NODE} nodes x "
             f"{NODE}; TinyLM d_model={args.d_model} layers={args.layers}",
             "MB handed to collectives (on the wire, ring)",
             "| method | " + " | ".join(f"{g} MB" for g in groups) + " | crosses nodes MB | median step ms | "
             "vs fsdp2_hybrid |", "|---|" + "---|" * (len(groups) + 3)]
    med = {m: statistics.median([t for r in raw["rounds"][m] if "times_ms" in r for t in r["times_ms"]])
           for m in args.methods if any("times_ms" in r for r in raw["rounds"][m])}
    for m in args.methods:
        b = raw["bytes"][m]
        per = {g: sum(v for k, v in b.items() if k.startswith(g + "/")) / 1e6 for g in groups}
        wire = {g: sum(v * _WIRE[k.split("/")[1]](int(k.split("/")[2])) for k, v in b.items()
                       if k.startswith(g + "/")) / 1e6 for g in groups}
        ratio = f"{med[m] / med['fsdp2_hybrid']:.2f}" if m in med and "fsdp2_hybrid" in med else "-"
        lines.append(f"| {m} | " + " | ".join(f"{per[g]:.3f} ({wire[g]:.3f})" for g in groups)
                     + f" | {per['replicate'] + per['world']:.3f} ({wire['replicate'] + wire['world']:.3f})"
                     + f" | {med.get(m, float('nan')):.1f} | {ratio} |")
    lines.append("by group/op/ranks: " + "; ".join(
        f"{m}: " + ", ".join(f"{k} {v / 1e6:.3f}" for k, v in raw["bytes"][m].items()) for m in args.methods))
    return lines


def main() -> None:
    import json
    import time

    args = parse_interleaved_args(__doc__, METHODS, METHODS, steps=5, warmup=2, rounds=3)
    t0 = time.perf_counter()
    raw = launch(body, args, world_size=WORLD, start_method="fork")
    lines = table(raw, args)
    lines.append(f"wall time {time.perf_counter() - t0:.0f} s; {machine_line()}")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "raw": raw}, f, indent=1)


if __name__ == "__main__":
    main()
