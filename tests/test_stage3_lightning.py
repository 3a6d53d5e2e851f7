"""ZeRO-3 under a Trainer: a model built in ``configure_model`` (meta device, materialized already sharded)
trains exactly like the same model built eagerly, and the trained module comes back whole."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


class Regressor(LightningModule):
    def __init__(self, out: str, deferred: bool) -> None:
        super().__init__()
        self.out, self.deferred = out, deferred
        self.net = None if deferred else _net()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = _net()  # on the meta device under ZeroStrategy(stage=3): no rank holds it whole
            self.meta_at_build = all(p.is_meta for p in self.net.parameters())

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        state = {"losses": self.losses, "meta_at_build": getattr(self, "meta_at_build", None)}
        torch.save(state, os.path.join(self.out, f"{int(self.deferred)}_rank{self.global_rank}.pt"))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(tmp_path, deferred: bool) -> Regressor:
    torch.manual_seed(0)
    model = Regressor(str(tmp_path), deferred)
    strategy = ZeroStrategy(stage=3, unit_classes=["Linear"], persist_numel=0, start_method="fork")
    Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(model)
    return model


def test_configure_model_on_meta_equals_eager(tmp_path):
    _fit(tmp_path, deferred=False)
    _fit(tmp_path, deferred=True)
    for rank in range(2):
        eager = torch.load(tmp_path / f"0_rank{rank}.pt")
        lazy = torch.load(tmp_path / f"1_rank{rank}.pt")
        assert lazy["meta_at_build"] is True
        torch.testing.assert_close(torch.tensor(lazy["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-6)


class Diverging(Regressor):
    """Rank 1 runs an extra unit on its third step: its collectives would no longer match rank 0's."""

    def __init__(self, out: str) -> None:
        super().__init__(out, deferred=False)
        self.extra = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 2:
            loss = loss + self.extra(loss.reshape(1, 1)).sum()
        return loss


@pytest.mark.timeout(120)
def test_diverging_rank_fails_fast_with_a_clear_error(tmp_path):
    strategy = ZeroStrategy(stage=3, unit_classes=["Linear"], persist_numel=0, start_method="fork")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(Exception, match="RankDivergenceError"):
        trainer.fit(Diverging(str(tmp_path)))
