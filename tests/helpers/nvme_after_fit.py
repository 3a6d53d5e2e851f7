"""A training script as a user writes it: fit with an NVMe preset, ``trainer.save_checkpoint`` after fit
(full, ``weights_only=True``, full again), then resume from the last (``ckpt_path=``) and train the same run uninterrupted.

Run by tests/test_nvme_lifetime.py as ``python tests/helpers/nvme_after_fit.py KIND DEVICES OUT SCRATCH``:
with 2 devices Lightning's default launcher starts the second rank by running this file again. Every rank
writes ``OUT/rank{r}.pt``: the weights after the first fit, after the resumed fit and after the uninterrupted
one, the weights-only checkpoint read back, and the scratch files this rank held after the saves. The test
looks at ``SCRATCH`` once every process has exited.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroPipelineStrategy
from lightning_zero.engine.placement.nvme import NVME_PATH_ENV
from lightning_zero.engine.pipeline.split import split_gpt2

BATCHES = 3  # per epoch and rank: the first fit ends at an epoch's end, the resumed one starts the next


def _rows(rank_count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(16, generator=g) for _ in range(4 * BATCHES * rank_count)]


class TinyRegressor(pl.LightningModule):
    """Three Linear layers, AdamW: the plain strategies' model."""

    def __init__(self, devices: int = 1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.devices = devices

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(_rows(self.devices), batch_size=4)


class PipeTiny(pl.LightningModule):
    """The tiny HF GPT-2 cut into ``pipeline_parallel_size`` stages (ZeroPipelineStrategy's model)."""

    def __init__(self, devices: int = 1, seed: int = 0) -> None:
        super().__init__()
        self.stage = None
        self.devices, self.seed = devices, seed

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def configure_model(self):
        from tests.helpers.pipeline_gpt2 import gpt2_model

        if self.stage is None:
            s = self.trainer.strategy
            self.stage = split_gpt2(gpt2_model(), s.pipeline_parallel_size, s.pipeline_stage_index)
            if self.seed:  # other weights: only a checkpoint that loads makes this run the trained one
                g = torch.Generator().manual_seed(self.seed)
                with torch.no_grad():
                    for p in self.stage.parameters():
                        p.add_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.stage(x)

    def pipeline_loss(self, output, target):
        from tests.helpers.pipeline_gpt2 import lm_loss

        return lm_loss(output, target)

    def training_step(self, batch, batch_idx):
        raise AssertionError("the pipeline strategy runs the schedule instead")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        from tests.helpers.pipeline_gpt2 import global_batch

        return DataLoader([global_batch(i)[0] for i in range(4 * BATCHES)], batch_size=4)


def make(kind: str, devices: int, scratch: str, seed: int = 0):
    if kind == "pipeline":  # all devices in the pipeline: P = devices, one data-parallel replica
        return ZeroPipelineStrategy(pipeline_parallel_size=devices, pipeline_microbatches=2, stage=2,
                                    offload_optimizer="nvme", nvme_path=scratch), PipeTiny(devices, seed)
    return kind, TinyRegressor(devices, seed)  # the registered preset: nvme_path from the environment


def weights(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def main(kind: str, devices: int, out: str, scratch: str) -> None:
    os.environ[NVME_PATH_ENV] = scratch

    def trainer(strategy, epochs: int) -> Trainer:
        return Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    strategy, model = make(kind, devices, scratch)
    first = trainer(strategy, 1)
    first.fit(model)
    rank = first.global_rank
    record = {"trained": weights(model)}
    first.save_checkpoint(os.path.join(out, "full"))
    first.save_checkpoint(os.path.join(out, "weights"), weights_only=True)
    first.save_checkpoint(os.path.join(out, "again"))  # the states written back after each save, read again
    record["held"] = sorted(f for f in os.listdir(scratch) if f"-rank{rank}-" in f)
    kept = first.strategy.pipe.engines if kind == "pipeline" else [first.strategy.model_side.trained_engine]
    record["in_memory"] = sum(e.sharded.states.resident_bytes() for e in kept)  # between saves: only the file
    record["on_disk"] = sum(e.sharded.states.swapped_bytes() for e in kept)

    strategy, resumed = make(kind, devices, scratch, seed=1)  # the checkpoint must bring weights and moments
    trainer(strategy, 2).fit(resumed, ckpt_path=os.path.join(out, "again"))
    record["resumed"] = weights(resumed)
    strategy, straight = make(kind, devices, scratch)
    trainer(strategy, 2).fit(straight)
    record["straight"] = weights(straight)
    if kind != "pipeline":  # the weights-only directory, as a user reads it back
        record["loaded"] = weights(TinyRegressor.load_from_checkpoint(os.path.join(out, "weights")))
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    for proc in getattr(first.strategy.launcher, "procs", []):  # rank 0: the ranks Lightning started have exited
        proc.wait()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
