"""Tiled MLP + tiled loss under Lightning's Trainer: ``ZeroStrategy(stage=3)`` with the engine's activation
checkpointing and offload on a tiled HF GPT-2 against Lightning's plain DDP (``ddp_fork``) on the untiled model,
same seed and data, 2 CPU ranks, Trainer defaults otherwise (fp32): every step's loss and the final weights
equal at rtol 1e-5 (SGD with momentum: linear in the gradients)."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.sequence_parallel import tile_lm_loss, tile_mlp
from tests.helpers.lightning_models import _params, trainer_kwargs
from tests.helpers.tiled_models import SEQ, VOCAB, gpt2


class GPT2Module(LightningModule):
    def __init__(self, out: str, tag: str, tiled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = gpt2()
        if tiled:
            tile_mlp(self.model, 5)
            tile_lm_loss(self.model, 7)
        self.out, self.tag, self.losses = out, tag, []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # forked ranks (see tests/helpers/lightning_models.py)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        out = self.model(input_ids=ids, labels=ids)
        self.losses.append(out.loss.item())
        self.logits_returned = out.logits is not None
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self) -> None:
        torch.save({"losses": self.losses, "state": _params(self), "logits": self.logits_returned},
                   os.path.join(self.out, f"{self.tag}{self.global_rank}.pt"))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (12, SEQ), generator=g)), batch_size=2)


@pytest.mark.timeout(240)
def test_tiled_zero3_with_checkpointing_and_offload_under_the_trainer_equals_ddp(tmp_path):
    runs = (("ddp", "ddp_fork", False),
            ("tiled", ZeroStrategy(stage=3, start_method="fork", activation_checkpointing="auto",
                                   offload_activations=True), True))
    for tag, strategy, tiled in runs:
        Trainer(**trainer_kwargs(max_steps=3), strategy=strategy).fit(GPT2Module(str(tmp_path), tag, tiled))
    for rank in range(2):
        ddp, tiled = (torch.load(tmp_path / f"{t}{rank}.pt") for t in ("ddp", "tiled"))
        assert ddp["logits"] and not tiled["logits"]
        torch.testing.assert_close(torch.tensor(tiled["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0)
        for k, v in ddp["state"].items():
            torch.testing.assert_close(tiled["state"][k], v, rtol=1e-5, atol=1e-7, msg=k)
