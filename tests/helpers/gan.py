"""The small GAN of the multi-optimizer and zero_grad tests: its data, its two nets, and the Fabric module
that runs one forward per backward (what DDP needs)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

LATENT, DATA = 4, 6


class RealData(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(31 * i + 5)
        return torch.randn(DATA, generator=g) * 0.5 + 1.0


def mlp(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, 8), nn.Tanh(), nn.Linear(8, o))


class FabricGan(nn.Module):
    """The generator's loss, or the discriminator's on a detached fake. ``extra=True``: a head that joins the
    discriminator (and its optimizer, through Fabric's optimizer wrapper) once ``added`` is set."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gen, self.disc = mlp(LATENT, DATA), mlp(DATA, 1)
        if extra:
            self.extra = nn.Linear(1, 1)
        self.added = False

    def _disc(self, x):
        return self.extra(self.disc(x)) if self.added else self.disc(x)

    def forward(self, z, real, phase: str):
        if phase == "g":
            return F.softplus(-self._disc(self.gen(z))).mean()
        with torch.no_grad():
            fake = self.gen(z)
        return F.softplus(-self._disc(real)).mean() + F.softplus(self._disc(fake)).mean()
