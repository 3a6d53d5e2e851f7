"""A torchrun job for tests/test_lifecycle.py: trains 3 epochs of 2 steps, a checkpoint per epoch.

    python -m torch.distributed.run --nproc_per_node 2 --max-restarts 1 ... elastic_train.py OUT STRATEGY KILL_STEP

On the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1 kills itself after optimizer step KILL_STEP
(0: never). torchrun then restarts every worker; they resume from the latest OUT/ckpt/epoch=N.ckpt and rank 0 writes the
final whole weights to OUT/final.pt. ``main`` is also run in forked ranks for the uninterrupted reference.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from tests.helpers.lifecycle_harness import DieOnce, LifecycleModule, make_strategy, trainer, whole_params  # noqa: E402


_Die = DieOnce


def main(out: str, strategy: str, kill_step: int, world_size: int = 2) -> dict:
    torch.set_num_threads(1)
    ckpt_dir = os.path.join(out, "ckpt")
    done = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".ckpt")) if os.path.isdir(ckpt_dir) else []
    resume = os.path.join(ckpt_dir, done[-1]) if done else None  # the latest complete epoch
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1),
                 _Die(kill_step)]
    t = trainer(make_strategy(strategy), world_size, -1, max_epochs=3, limit_train_batches=2, limit_val_batches=0,
                enable_checkpointing=True, callbacks=callbacks)
    model = LifecycleModule(out)
    t.fit(model, ckpt_path=resume)
    weights = whole_params(model, t.strategy)
    if t.global_rank == 0:
        torch.save({"weights": weights, "resumed_from": resume, "global_step": t.global_step},
                   os.path.join(out, "final.pt"))
    return weights


if __name__ == "__main__":  # Lightning makes the default group from torchrun's environment, as for any user
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
