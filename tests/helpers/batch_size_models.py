"""LightningModules whose step memory grows with the batch size, for the batch-size finder tests and the
``lightning-zero tune --module`` / ``estimate --module`` factories (importable: fork, spawn, subprocess).

* :class:`GPT2Module`: an HF GPT-2 built from a tiny config (dropout off), the batch size in ``hparams``;
* :class:`MLPModule`: a plain ``nn.Sequential``, the batch size as a module attribute (or, with
  :func:`mlp_with_datamodule`, in a LightningDataModule).
Each records its per-step losses; ``final_params()`` is the fp32 weights after fit (whole, any stage).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers.zoo_models import VOCAB, gpt2

SEQ = 16


class Tokens(Dataset):
    def __init__(self, length: int = 512, seq: int = SEQ) -> None:
        self.length, self.seq = length, seq

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7919 * i + 3)
        return torch.randint(0, VOCAB, (self.seq,), generator=g)


class Features(Dataset):
    def __init__(self, length: int = 512, dim: int = 32) -> None:
        self.length, self.dim = length, dim

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(104729 * i + 1)
        return torch.randn(self.dim, generator=g), torch.randint(0, 10, (), generator=g)


def gpt2_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def mlp_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


class _Recording(pl.LightningModule):
    net: nn.Module

    out: str | None = None  # set: every rank writes {out}/rank{r}.pt at the end of fit

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_end(self) -> None:
        if self.out is not None:
            torch.save({"losses": self.losses, "params": self.final_params(), "global_step": self.global_step,
                        "batch_size": self.trainer.train_dataloader.batch_size},
                       f"{self.out}/rank{self.global_rank}.pt")

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # forked ranks: see tests/helpers/lightning_models.py ParityModule.setup

    def training_step(self, batch, batch_idx):
        loss = self.loss(self.net, batch)
        self.losses.append(loss.detach().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2, weight_decay=0.01)

    def final_params(self) -> dict[str, torch.Tensor]:
        strategy = self.trainer.strategy
        ctx = strategy.gathered_params() if hasattr(strategy, "gathered_params") else torch.no_grad()
        with ctx:
            return {k: v.detach().float().clone() for k, v in self.net.state_dict().items()}


class GPT2Module(_Recording):
    def __init__(self, batch_size: int = 2, length: int = 512) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = gpt2()
        self.loss = gpt2_loss

    def train_dataloader(self):
        return DataLoader(Tokens(self.hparams.length), batch_size=self.hparams.batch_size, shuffle=False)


def mlp(width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class MLPNet(_Recording):
    """The plain module without data (a datamodule brings it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.loss = mlp_loss


class MLPModule(MLPNet):
    def __init__(self, batch_size: int = 2, length: int = 512) -> None:
        super().__init__()
        self.batch_size, self.length = batch_size, length

    def train_dataloader(self):
        return DataLoader(Features(self.length), batch_size=self.batch_size, shuffle=False)


class FeatureData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 2, length: int = 512) -> None:
        super().__init__()
        self.batch_size, self.length = batch_size, length

    def train_dataloader(self):
        return DataLoader(Features(self.length), batch_size=self.batch_size, shuffle=False)


# -- factories (``pkg.mod:factory``) -------------------------------------------------------------------
def gpt2_factory() -> GPT2Module:
    return GPT2Module()


def mlp_factory() -> MLPModule:
    return MLPModule()


def mlp_with_datamodule():
    return MLPNet(), FeatureData()
