"""A torchrun job for tests/test_elastic_restart.py: the user's script, nothing done to the process group.

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 ... elastic_resume.py OUT MODE KILL_STEP

Lightning makes the default group from torchrun's environment (env://, the agent's store) as for any user.
MODE is a strategy that makes process groups of its own: zero3 (the stage-3 reduce-scatter group), hybrid
(stage 3 with shard_group_size=1: shard and replicate groups), tp (tensor_parallel_size=2: the 2-D mesh),
pipeline (pipeline_parallel_size=2: stage and data-parallel groups). 4 epochs of 2 steps, a checkpoint at
each epoch's end (so a resume starts at an epoch boundary, where an uninterrupted run is too), resumed
with ``ckpt_path="last"``. In attempt 0 only (TORCHELASTIC_RESTART_COUNT=0) rank 1 kills itself after
optimizer step KILL_STEP (0: never): torchrun restarts both workers. Every rank writes its final whole
weights to OUT/final_rank{r}.pt.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_zero import ZeroPipelineStrategy, ZeroStrategy  # noqa: E402
from tests.helpers.lifecycle_harness import DieOnce, STAGES, LifecycleModule, whole_params  # noqa: E402

EPOCHS, STEPS_PER_EPOCH = 4, 2


_Die = DieOnce


def _mode(mode: str, out: str):
    """(strategy, module, what the module's weights are once fit returns)"""
    if mode in ("zero3", "hybrid"):
        extra = {"shard_group_size": 1} if mode == "hybrid" else {}
        module = LifecycleModule(out)
        return ZeroStrategy(**STAGES["zero3"], **extra), module, lambda t: whole_params(module, t.strategy)
    if mode == "tp":
        from tests.helpers.tp_models import tp_lightning_module

        module = tp_lightning_module(out, "tp", tensor_parallel=True)  # writes tp_rank{r}.pt at on_train_end
        return (ZeroStrategy(stage=1, tensor_parallel_size=2), module,
                lambda t: torch.load(f"{out}/tp_rank{t.global_rank}.pt", weights_only=False)["params"])
    if mode == "pipeline":
        from tests.helpers.pipeline_gpt2 import M
        from tests.helpers.pipeline_lightning import PipeGPT2

        module = PipeGPT2(out, "pipe")  # writes piperank{r}.pt (this stage's weights) at on_train_end
        return (ZeroPipelineStrategy(stage=1, pipeline_parallel_size=2, pipeline_microbatches=M), module,
                lambda t: torch.load(f"{out}/piperank{t.global_rank}.pt", weights_only=False)["named"])
    raise ValueError(f"unknown mode {mode!r}. Allowed: zero3, hybrid, tp, pipeline.")


def main(out: str, mode: str, kill_step: int) -> None:
    torch.set_num_threads(1)
    strategy, module, weights = _mode(mode, out)
    saves = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{epoch}", save_last=True,
                            every_n_epochs=1)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS,
                      limit_train_batches=STEPS_PER_EPOCH, limit_val_batches=0, num_sanity_val_steps=0,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[saves, _Die(kill_step)])
    trainer.fit(module, ckpt_path="last")  # attempt 0: nothing saved yet, so a fresh start (a warning)
    final = {"weights": {k: v.detach().clone().float() for k, v in weights(trainer).items()},
             "global_step": trainer.global_step,
             "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    torch.save(final, os.path.join(out, f"final_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
