"""Helpers to run a function on N gloo ranks from pytest (forked ranks; Lightning's popen launcher would re-run pytest).

Fork keeps the parent's imports (spawn re-imports torch and Lightning per rank: seconds each). Each rank
pins torch to one thread before any work: a forked child must not use the parent's OpenMP pool.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if dist.is_initialized():  # inherited from the parent by fork
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:  # report the failure to the parent, then let the process die
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"rank{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        try:
            mp.start_processes(_entry, args=(world_size, port, fn, args, outdir), nprocs=world_size, join=True,
                               start_method="fork")
        except Exception:
            pass  # the rank files below say what went wrong
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result")
            out = torch.load(path, weights_only=False)
            if not out["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{out['error']}")
            results.append(out["result"])
        return results
