"""Buffers (BatchNorm running statistics) follow torch DDP's broadcast rule on every rank, at every stage.

DDP broadcasts rank 0's buffers in a forward only if the previous forward ran with grad enabled outside
``no_sync``: under ``accumulate_grad_batches=2`` the boundary micro-batch keeps the statistics its own rank's
first micro-batch wrote, and the first validation forward after a synced step takes rank 0's. Training losses
cannot show this (BatchNorm normalizes by the batch in training); every rank's buffers after fit and the
validation losses (running statistics) can. Reference: Lightning ``strategy="ddp_fork"``, same seed and data.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from lightning_zero import ZeroStrategy
from tests.helpers.lightning_models import _params, load_rank_files, trainer_kwargs
from tests.helpers.zoo_models import ZOO

RTOL, ATOL = 1e-5, 1e-6


class Images(Dataset):
    def __init__(self, n: int, salt: int) -> None:
        self.n, self.salt = n, salt

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(977 * i + self.salt)
        return torch.randn(3, 16, 16, generator=g) * (1.0 + 0.3 * (i % 3)), torch.randint(0, 3, (), generator=g)


class ResNetModule(pl.LightningModule):
    """HF ``ResNetForImageClassification`` (BatchNorm after every convolution) built from a small config."""

    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ZOO["resnet"][0]()
        self.out, self.tag = out, tag
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # forked ranks (see tests/helpers/lightning_models.py)

    def train_dataloader(self):
        return DataLoader(Images(16, 1), batch_size=2)

    def val_dataloader(self):
        return DataLoader(Images(8, 2), batch_size=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model(pixel_values=x, labels=y).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(self.model(pixel_values=x, labels=y).loss.item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self):
        torch.save({"losses": self.losses, "val_losses": self.val_losses, "state": _params(self)},
                   f"{self.out}/{self.tag}train_rank{self.global_rank}.pt")


def _fit(out: str, tag: str, strategy, validate: bool):
    val = dict(limit_val_batches=2, check_val_every_n_epoch=1) if validate else {}
    pl.Trainer(strategy=strategy, **trainer_kwargs(max_steps=-1, max_epochs=2, accum=2, **val)).fit(
        ResNetModule(out, tag))
    return load_rank_files(out, tag, "train", 2)


_REF: dict = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("validate", [False, True], ids=["accumulate", "accumulate+validate"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_ranks_buffers_follow_ddp_under_accumulation(tmp_path_factory, stage, validate):
    if validate not in _REF:
        _REF[validate] = _fit(str(tmp_path_factory.mktemp("ddp")), "ddp_", "ddp_fork", validate)
    ref = _REF[validate]
    got = _fit(str(tmp_path_factory.mktemp(f"zero{stage}")), "zero_", ZeroStrategy(stage=stage, start_method="fork"),
               validate)
    buffers = [k for k in ref[0]["state"] if "running_" in k]
    assert buffers, "the model has BatchNorm running statistics"
    # the reference really has rank-dependent buffers (else the comparison below could not fail)
    assert not validate or len(ref[0]["val_losses"]) == 4
    assert any(not torch.equal(ref[0]["state"][k], ref[1]["state"][k]) for k in buffers) != validate
    for rank, (z, d) in enumerate(zip(got, ref)):
        for what in ("losses", "val_losses"):
            torch.testing.assert_close(torch.tensor(z[what]), torch.tensor(d[what]), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {what}: {m}")
        assert z["state"].keys() == d["state"].keys()
        for k in d["state"]:  # parameters and every buffer (running_mean / running_var / num_batches_tracked)
            torch.testing.assert_close(z["state"][k], d["state"][k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {k}: {m}")
