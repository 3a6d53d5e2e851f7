"""Two small models set up together under ZeroFabricStrategy (a generator and a critic): one directory holding a
checkpoint per model (checkpoint/models_dir.py) in the background-save and fsspec tests."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeroFabricStrategy


def make_pair():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)), nn.Linear(8, 1)


def setup_pair(strategy):
    """``strategy``: a ZeroFabricStrategy, or the stage (int) of a default one."""
    strategy = ZeroFabricStrategy(stage=strategy) if isinstance(strategy, int) else strategy
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size())
    fabric.launch()
    g, d = make_pair()
    g, opt_g = fabric.setup(g, torch.optim.AdamW(g.parameters(), lr=0.01))
    d, opt_d = fabric.setup(d, torch.optim.AdamW(d.parameters(), lr=0.01))
    return fabric, g, d, opt_g, opt_d


def pair_steps(fabric, g, d, opt_g, opt_d, rank, start, n):
    losses = []
    for it in range(start, start + n):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * it + rank))
        loss = d(g(x)).pow(2).mean() + g(x).pow(2).mean()
        fabric.backward(loss)
        opt_g.step(), opt_d.step(), opt_g.zero_grad(), opt_d.zero_grad()
        losses.append(loss.item())
    return losses


def pair_state(fabric, *models):
    with fabric.strategy.gathered_params():
        return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(models) for k, v in m.state_dict().items()}
