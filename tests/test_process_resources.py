"""Process resources stay flat over many Trainers in one process (what a torchrun/SLURM script does: fit,
fit again, ... in the ranks torchrun made). Groups and meshes are made once per process (engine/layout/groups.py);
a Trainer that made its own again each time (the TP mesh did, in every ``setup_environment``) leaks the
sockets and threads of their gloo pairs: ~30 file descriptors per Trainer at 2 ranks.

Per mode, each of 2 forked gloo ranks runs five fits of a fresh Trainer and strategy and counts, after
each, its open file descriptors (/proc/self/fd), Python threads and OS threads (/proc/self/task, gloo's
included) and its process groups; every count after the first fit must equal the first fit's.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_utils import run_distributed

FITS = 5


def _strategy_and_module(mode: str, out: str):
    from lightning_zero import ZeroPipelineStrategy, ZeroStrategy
    from tests.helpers.lifecycle_harness import STAGES, LifecycleModule

    if mode in ("zero2", "zero3"):
        return ZeroStrategy(**STAGES[mode]), LifecycleModule(out)
    if mode == "hybrid":
        return ZeroStrategy(**STAGES["zero3"], shard_group_size=1), LifecycleModule(out)
    if mode == "tp":
        from tests.helpers.tp_models import tp_lightning_module

        return ZeroStrategy(stage=1, tensor_parallel_size=2), tp_lightning_module(out, "tp", tensor_parallel=True)
    from tests.helpers.pipeline_gpt2 import M
    from tests.helpers.pipeline_lightning import PipeGPT2

    return ZeroPipelineStrategy(stage=1, pipeline_parallel_size=2, pipeline_microbatches=M), PipeGPT2(out, "pipe")


def _counts() -> dict:
    gc.collect()
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "os_threads": len(os.listdir("/proc/self/task")), "groups": len(dist.distributed_c10d._world.pg_names)}


def _fits(rank, world_size, mode, out):
    from lightning.pytorch import Trainer

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    counts = []
    for i in range(FITS):
        os.makedirs(os.path.join(out, f"fit{i}"), exist_ok=True)
        strategy, module = _strategy_and_module(mode, os.path.join(out, f"fit{i}"))
        trainer = Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2,
                          limit_train_batches=2, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module)
        del trainer, strategy, module
        counts.append(_counts())
    return counts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["zero2", "zero3", "hybrid", "tp", "pipeline"])
def test_five_fits_in_one_process_keep_fds_threads_and_groups_flat(tmp_path, mode):
    for rank, counts in enumerate(run_distributed(_fits, 2, mode, str(tmp_path))):
        first = counts[0]
        # never above the first fit's (an fd or two of Python's own may close later; a leak only grows)
        grown = [c for c in counts[1:] if any(c[k] > first[k] for k in first)]
        assert not grown and all(c["groups"] == first["groups"] for c in counts), \
            f"rank {rank} {mode}: after each of {FITS} fits: {counts}"
