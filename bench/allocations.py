"""Tensor allocations per training step: DDP against the ZeRO stages, and which of ours the engine makes.

A ``TorchDispatchMode`` sees every aten call of one steady-state step (after 3 warm-up steps, so optimizer
state and stage-3 orders exist) on 2 gloo ranks, HF GPT-2 built from its config (no downloads). An output
whose storage is none of the inputs' (and is not a view) is one allocation; those whose innermost
``lightning_zero`` frame is engine code (not the user's optimizer called from it) are listed by call site.
Counted, not timed, so the load of the machine does not change the numbers.

    python bench/allocations.py                      # ddp zero1 zero2 zero3
    python bench/allocations.py --methods zero2 --width 128
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_STEP_CALL = "optimizer.py"  # the engine's call of the user's optimizer: its allocations are the optimizer's


class AllocationCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count, self.nbytes, self.engine = 0, 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and not t._is_view() and t.untyped_storage().nbytes()
                    and id(t.untyped_storage()) not in inputs):
                self.count += 1
                self.nbytes += t.untyped_storage().nbytes()
                ours = [f for f in traceback.extract_stack()[:-2] if "lightning_zero" in f.filename]
                if ours and not (ours[-1].filename.endswith(_STEP_CALL) and "step" in ours[-1].line):
                    self.engine[f"{os.path.relpath(ours[-1].filename)}:{ours[-1].lineno} {func}"] += 1
        return out


def _rank(rank: int, world: int, method: str, width: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from tests.helpers.zoo_models import gpt2

    torch.manual_seed(0)
    model = gpt2(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = None
    if method == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(model)
    else:
        engine = ZeroEngine(model, opt, ZeroConfig(stage=int(method[-1]),
                                                   unit_classes=["GPT2Block"] if method == "zero3" else None))
        runner = model
    ids = torch.randint(0, 100, (2, 8))

    def step() -> None:
        runner(ids, labels=ids).loss.backward()
        if engine is None:
            opt.step()
            opt.zero_grad()
        else:
            engine.step()

    for _ in range(3):
        step()
    counter = AllocationCounter()
    with counter:
        step()
    if rank == 0:
        queue.put((method, counter.count, counter.nbytes, counter.engine.most_common()))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="ddp,zero1,zero2,zero3")
    p.add_argument("--width", type=int, default=64, help="GPT-2 n_embd (2 blocks, vocab 100)")
    args = p.parse_args()
    ctx = mp.get_context("fork")
    print("| method | allocations / step | bytes / step | engine's own | engine call sites (count) |")
    print("|---|---:|---:|---:|---|")
    for i, method in enumerate(args.methods.split(",")):
        queue = ctx.SimpleQueue()
        mp.start_processes(_rank, args=(2, method, args.width, 29800 + i, queue), nprocs=2, start_method="fork")
        name, count, nbytes, engine = queue.get()
        sites = "; ".join(f"{k} ({v})" for k, v in engine) or "-"
        print(f"| {name} | {count} | {nbytes:,} | {sum(v for _, v in engine)} | {sites} |")


if __name__ == "__main__":
    main()
