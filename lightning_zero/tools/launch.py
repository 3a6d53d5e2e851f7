"""One launcher: run a function on N local ranks (forked or spawned) and collect every rank's result.

Used by the tests (``tests/dist_utils.run_distributed``), the tuner and the benches
(``tuning/harness.launch``). Fork keeps the parent's imports (spawn re-imports torch and Lightning per
rank: seconds each) and is what tests and CPU runs use; spawn is the safe choice with CUDA. Each rank
pins torch's thread count before any work: a forked child must not use the parent's OpenMP pool.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: Sequence, outdir: str, backend: str,
           threads: int, timeout_s: float) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads))
    # the exported count also stops Lightning's launchers (``_set_num_threads_if_needed``) from raising it:
    # a forked child whose parent already ran a parallel region deadlocks in its first OpenMP team of 2+
    torch.set_num_threads(threads)
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if dist.is_initialized():  # inherited from the parent by fork
        dist.destroy_process_group()
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:  # report the failure to the parent, then let the process die
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"rank{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, args: Sequence = (), start_method: str = "fork", backend: str = "gloo",
              threads: int = 1, timeout_s: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; the per-rank results, in rank order.

    A failing rank raises ``RuntimeError("rank r failed: <its traceback>")`` here (or "died without a
    result" when it was killed); ``fn`` must be picklable for ``start_method="spawn"``.
    """
    with tempfile.TemporaryDirectory() as outdir:
        launch_error = None
        try:
            mp.start_processes(_entry, args=(world_size, free_port(), fn, tuple(args), outdir, backend, threads,
                                             timeout_s), nprocs=world_size, join=True, start_method=start_method)
        except Exception as err:  # the rank files below say what went wrong; this says why a rank wrote none
            launch_error = err
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result ({launch_error})")
            out = torch.load(path, weights_only=False)
            if not out["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{out['error']}")
            results.append(out["result"])
        return results
