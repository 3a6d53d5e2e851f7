"""One launcher: run a function on N local ranks (forked or spawned) and collect every rank's result.

Used by the tests (``tests/helpers/dist_utils.run_distributed``), the tuner and the benches
(``tuning/harness.launch``). Fork keeps the parent's imports (spawn re-imports torch and Lightning per
rank: seconds each) and is what tests and CPU runs use; spawn is the safe choice with CUDA. Each rank
pins torch's thread count before any work: a forked child must not use the parent's OpenMP pool.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous(rank: int, world_size: int, outdir: str, timeout: datetime.timedelta):
    """The ranks' TCPStore, race-free: rank 0 binds port 0 (the OS picks a free one, and holds it from then
    on) and writes the number to ``outdir``; the others read it there. A port picked in the parent and
    bound later by rank 0 could be taken by a concurrent job in between (seen as gloo's connectFullMesh
    failing under load)."""
    path = os.path.join(outdir, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)  # atomic: a reader never sees a half-written number
        return store, store.port
    deadline = time.monotonic() + timeout.total_seconds()
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not publish its store port within {timeout}")
        time.sleep(0.01)
    with open(path) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout), port


def _entry(rank: int, world_size: int, fn: Callable, args: Sequence, outdir: str, backend: str,
           threads: int, timeout_s: float) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    # the exported count also stops Lightning's launchers (``_set_num_threads_if_needed``) from raising it:
    # a forked child whose parent already ran a parallel region deadlocks in its first OpenMP team of 2+
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if dist.is_initialized():  # inherited from the parent by fork
        dist.destroy_process_group()
    store, port = _rendezvous(rank, world_size, outdir, timeout)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # for code that reads them (Lightning)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
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
            mp.start_processes(_entry, args=(world_size, fn, tuple(args), outdir, backend, threads,
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
