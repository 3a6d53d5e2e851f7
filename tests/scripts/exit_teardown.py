"""A torchrun job for tests/test_exit_teardown.py: a user's script that trains and returns, never destroying
its process group (as Lightning's documented scripts do).

    python -m torch.distributed.run --nproc-per-node 2 ... exit_teardown.py OUT trainer|fabric

Before anything else it registers an atexit handler of its own; atexit runs handlers last-registered
first, so this one runs after any the strategy registered and writes OUT/exit_rank{r}.txt with whether a
process group was still alive when the interpreter began its teardown.
"""

from __future__ import annotations

import atexit
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _report(out: str) -> None:
    rank = os.environ["RANK"]
    with open(os.path.join(out, f"exit_rank{rank}.txt"), "w") as f:
        f.write(f"initialized={dist.is_initialized()}")


def _trainer(out: str) -> None:
    from tests.helpers.lifecycle_harness import LifecycleModule, make_strategy, trainer

    trainer(make_strategy("zero3"), 2, 2).fit(LifecycleModule(out))


def _fabric(out: str) -> None:
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ZeroFabricStrategy(stage=3))
    fabric.launch()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    for _ in range(2):
        loss = model(torch.randn(3, 4)).square().mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    torch.set_num_threads(1)
    atexit.register(_report, sys.argv[1])
    {"trainer": _trainer, "fabric": _fabric}[sys.argv[2]](sys.argv[1])
