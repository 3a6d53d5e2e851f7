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
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

def _rank(rank: int, world: int, method: str, width: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from tests.helpers.allocations import AllocationCounter
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
