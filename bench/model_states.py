"""Every model-state byte a rank holds on HF T5-small, after the backward and after the step (issue 45),
with the code before the issue beside it: one run, one table.

What it counts
--------------
T5-small built from its config (``T5ForConditionalGeneration``, d_model 512, d_ff 2048, 6 + 6 layers, 8 heads,
vocab 32128, tied embeddings: 60.5M parameters; random init, nothing downloaded), torch AdamW, 2 gloo ranks,
one thread each. Each method takes ``--steps`` training steps (the optimizer state exists after the first),
then one more forward + backward, measured ("after backward": the step's peak of model states, the gradients
reduced and the state present), then its step, measured again ("after step": what the rank holds between
steps). Per method and point:

* **state**: model states + the engine's own communication buffers held then, MiB per rank, split
  device / host (the bytes an offloaded store keeps in host memory; on this CPU machine both are RAM, the split
  is where a GPU run would keep them). Ours: ``engine.memory_report()`` -- ``model_states`` (params,
  ``.grad``, gradient shards, masters and their bf16 compensation, optimizer state) + ``comm_buffers``
  (``engine/comm/buffer_pool.py``). Peers, the way ``bench/peers.py`` counts them: FSDP2 the local shards
  of its DTensor parameters, gradients and optimizer state; DDP parameters, ``.grad`` and optimizer state;
  DeepSpeed every distinct storage reachable from its engine (its buckets included).
* **buffers**: of which the engine's own communication buffers (ours only).
* **B/param**: the state column's bytes over Psi (per rank: DDP's fp32 Adam is 16).
* **live**: a cross-check of "every tensor the rank holds": the distinct storages of all tensors the
  garbage collector can see in the rank's process (the model's, the optimizer's, the engine's, the batch),
  MiB. It is what the process really keeps alive, whatever the report's bookkeeping says.

Methods: ``ddp``, ``fsdp2`` (every T5Block, then the root), ``ds_zero1`` / ``ds_zero2`` / ``ds_zero3`` (when
DeepSpeed is installed), ``zero1`` / ``zero2`` / ``zero3`` (+ ``_offload``: optimizer states, and at stage 3
parameter shards, in host memory); suffixes: ``_bf16`` bf16 compute (``compute_dtype=torch.bfloat16``;
FSDP2: ``MixedPrecisionPolicy(param_dtype=bf16)``), then ``_bf16moments`` (``optimizer_state_dtype="bf16"``)
and ``_bf16masters`` (``master_dtype="bf16"``), e.g. ``zero3_offload_bf16_bf16moments_bf16masters``.

``--before PATH`` runs our rows a second time in a child process importing ``lightning_zero`` from ``PATH``
(a checkout of the code before the issue; rows using a knob that code lacks are left out) and prints
``before -> after`` in each cell.

Run::

    python bench/model_states.py --before /work/wt/base45          # ~15 minutes on 2 cores at load 10
    python bench/model_states.py --model t5_tiny --methods fsdp2,zero3,zero3_bf16_bf16moments_bf16masters
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import deepspeed_peer  # noqa: E402
from harness import build, launch, machine_line, state_dtypes, train_step  # noqa: E402
from seed_table import make_t5, t5_block_class, t5_config  # noqa: E402
from lightning_zero.tools.tuning.harness import t5_batch  # noqa: E402

PEERS = ("ddp", "fsdp2", "fsdp2_bf16")
OURS_FP32 = ("zero1", "zero2", "zero3")
DEFAULT_METHODS = (
    ("ddp", "fsdp2")
    + (("ds_zero1", "ds_zero2", "ds_zero3") if deepspeed_peer.available() else ())
    + OURS_FP32 + tuple(f"{m}_bf16moments" for m in OURS_FP32)
    + ("fsdp2_bf16",)
    + tuple(f"{m}_bf16{s}" for m in OURS_FP32 for s in ("", "_bf16moments", "_bf16moments_bf16masters"))
    + tuple(f"{m}_offload" for m in OURS_FP32)
    + tuple(f"{m}_offload_bf16{s}" for m in OURS_FP32 for s in ("", "_bf16moments", "_bf16moments_bf16masters"))
)
POINTS = ("after_backward", "after_step")
OUR_PRESETS = OURS_FP32 + tuple(f"{m}_offload" for m in OURS_FP32)
GRAMMAR = ("ddp, fsdp2, ds_zero1..ds_zero3 (DeepSpeed installed) or zero1..zero3 with an optional _offload; then "
           "_bf16 (bf16 compute; not for ddp); then, for ours only, _bf16moments and/or _bf16masters (masters: "
           "with _bf16 only)")


def parse(method: str) -> tuple[str, dict, bool]:
    """(harness method, state-dtype options, bf16 compute) of a method name of this table."""
    base, states = state_dtypes(method)
    mixed = base.endswith("_bf16")
    return (base[: -len("_bf16")] if mixed else base), states, mixed


def check_method(method: str) -> None:
    """One clear error for a name outside this table's grammar, before any rank starts."""
    base, states, mixed = parse(method)
    peer = base in ("ddp", "fsdp2") or base in deepspeed_peer.DS_METHODS[:3]
    ok = (peer and not states and not (mixed and base == "ddp")) or (
        base in OUR_PRESETS and (mixed or "master_dtype" not in states))
    if not ok:
        raise ValueError(f"unknown method {method!r}; allowed: {GRAMMAR}")
    if base.startswith("ds_") and not deepspeed_peer.available():
        raise ValueError(f"{method} needs DeepSpeed, which is not installed: {deepspeed_peer.INSTALL_HINT}")


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector sees in this process."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not torch.is_tensor(obj) or obj.device.type == "meta" or hasattr(obj, "to_local"):
            continue  # a DTensor's local shard is a tensor of its own, seen on its own
        try:
            st = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
            continue
        if st.nbytes():
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def point(runner, finalize: bool) -> dict:
    mem = runner.state_bytes(finalize=finalize)
    buffers = int(mem.get("comm_buffers", 0))
    total = int(mem["model_states"]) + buffers
    host = int(mem.get("host", 0))
    return {"total": total, "host": host, "device": total - host, "buffers": buffers, "live": live_tensor_bytes(),
            "report": {k: int(v) for k, v in mem.items() if isinstance(v, (int, float))}}


def measure(method: str, args, rank: int) -> dict:
    base, states, mixed = parse(method)
    runner = build(base, args, make_model=make_t5, block_class=t5_block_class(),
                   compute_dtype=torch.bfloat16 if mixed else None, states=states or None)
    loss_fn = lambda module, batch: module(**batch).loss  # noqa: E731
    batch = lambda i: t5_batch(args, rank, i, args.batch, torch.device("cpu"))  # noqa: E731
    loss = None
    for i in range(args.steps):
        loss = train_step(runner, batch(i), args.vocab, loss_fn=loss_fn)
    runner.pre()
    runner.backward(loss_fn(runner.module, batch(args.steps)))
    out = {"after_backward": point(runner, finalize=True)}
    runner.step()
    out["after_step"] = point(runner, finalize=False)
    out["loss"] = float(loss)
    out["numel"] = runner.numel
    runner.close()
    return out


def body(rank: int, args) -> dict:
    import lightning_zero

    out = {"code": os.path.dirname(os.path.dirname(os.path.abspath(lightning_zero.__file__))), "methods": {}}
    for m in args.methods:
        t0 = time.perf_counter()
        try:
            out["methods"][m] = measure(m, args, rank)
        except Exception as e:  # noqa: BLE001 -- one method's failure is its row (the same on every rank)
            out["methods"][m] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:240]}
        gc.collect()
        if rank == 0:
            print(f"  {m}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def run_before(args) -> dict:
    """Our rows without the new knobs, in a child process whose ``lightning_zero`` is the one at ``--before``."""
    ours = [m for m in args.methods if not m.startswith(("ddp", "fsdp2", "ds_")) and not parse(m)[1]]
    if not ours:
        return {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "before.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--steps", str(args.steps),
               "--batch", str(args.batch), "--src-len", str(args.src_len), "--tgt-len", str(args.tgt_len),
               "--methods", ",".join(ours), "--json", path]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.before)}
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)["raw"]


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def cell(after: dict, before: dict | None, fmt) -> str:
    return fmt(after) if before is None else f"{fmt(before)} -> {fmt(after)}"


def state_cell(p: dict) -> str:
    return mib(p["device"]) + (f" / {mib(p['host'])}" if p["host"] else "")


def print_table(raw: dict, before: dict, args) -> list[str]:
    rows, prev = raw["methods"], (before or {}).get("methods", {})
    numel = next(r["numel"] for r in rows.values() if "numel" in r)
    lines = [
        f"model: T5 {args.model} from its config, Psi = {numel:,} params; AdamW; 2 ranks gloo, 1 thread each; "
        f"batch {args.batch}/rank, src {args.src_len} / tgt {args.tgt_len} tokens; measured after {args.steps} "
        f"steps; code: {raw['code']}" + (f"; before: {before['code']}" if before else ""),
        "state = model states + the engine's communication buffers, MiB per rank, device / host; buffers = of "
        "which communication buffers; B/param = state bytes / Psi; live = every tensor storage the process holds "
        "(gc)" + ("; `before -> after` where the code before the issue runs the row" if before else ""),
        "",
        "| method | after backward: state MiB | buffers MiB | B/param | live MiB | after step: state MiB | buffers MiB "
        "| B/param | live MiB | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, r in rows.items():
        if "error" in r:
            lines.append(f"| {m} | FAILED: {r['error']} |")
            continue
        b = prev.get(m) if "error" not in prev.get(m, {"error": 1}) else None
        cells = []
        for pt in POINTS:
            pb = b[pt] if b else None
            cells += [cell(r[pt], pb, state_cell), cell(r[pt], pb, lambda p: mib(p["buffers"])),
                      cell(r[pt], pb, lambda p: f"{p['total'] / numel:.2f}"), cell(r[pt], pb, lambda p: mib(p["live"]))]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {r['loss']:.4f} |")
    lines += ["", "after backward, by kind (B/param per rank, this code): params | grads | grad shards | masters "
              "(+ compensation) | optimizer state | host"]
    for m, r in rows.items():
        if "error" not in r and not m.startswith("ds_"):
            k = r["after_backward"]["report"]
            lines.append(f"  {m}: " + " | ".join(f"{k.get(x, 0) / numel:.2f}" for x in
                                                 ("params", "grads", "grad_shards", "master", "optimizer_state", "host")))
    failed_before = {m: r["error"] for m, r in prev.items() if "error" in r}
    if failed_before:
        lines.append("before: failed rows: " + "; ".join(f"{m}: {e}" for m, e in failed_before.items()))
    if not deepspeed_peer.available():
        lines.append(f"DeepSpeed rows (ds_*) left out: DeepSpeed is not installed ({deepspeed_peer.INSTALL_HINT}).")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="t5_small", help="preset of lightning_zero/tools/t5_dims.T5_PRESETS")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--steps", type=int, default=2, help="training steps before the measured one (>= 1)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--src-len", type=int, default=16)
    p.add_argument("--tgt-len", type=int, default=8)
    p.add_argument("--before", default=None, metavar="PATH",
                   help="also run our rows with lightning_zero imported from PATH (the code before the issue)")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.steps < 1:
        p.error("--steps must be >= 1 (the first step creates the optimizer state)")
    try:
        for m in args.methods:
            check_method(m)
    except ValueError as e:
        p.error(str(e))
    if args.before and not os.path.isdir(os.path.join(args.before, "lightning_zero")):
        p.error(f"--before {args.before!r}: not a checkout holding lightning_zero/ (the code before the issue)")
    args.lr, args.seed, args.bucket_mb, args.backend, args.threads = 1e-4, 0, 25.0, "gloo", 1
    args.vocab = t5_config(args).vocab_size
    t0 = time.perf_counter()
    before = run_before(args) if args.before else {}
    raw = launch(body, args)
    lines = print_table(raw, before, args)
    lines.append(f"wall time {time.perf_counter() - t0:.0f} s; {machine_line()}")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "raw": raw, "before": before}, f, indent=1)


if __name__ == "__main__":
    main()
