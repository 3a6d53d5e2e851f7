"""The shardability check admits exact elementwise classes and registered ones, never a subclass by default."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import ZeroConfig, ZeroEngine, register_shardable_optimizer

from tests.helpers.models import make_model


class Lamb(torch.optim.Adam):
    """LAMB written the way users do: Adam's moments, then a per-tensor trust ratio (not elementwise)."""

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                st["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                update = st["m"] / (st["v"].sqrt() + 1e-6)
                trust = p.norm() / update.norm().clamp_min(1e-12)  # whole-tensor norms: wrong on a shard
                p.add_(update * trust, alpha=-g["lr"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_subclass_of_elementwise_class_is_refused(stage):
    model = make_model()
    with pytest.raises(ValueError, match=r"Lamb cannot run on parameter shards.*register_shardable_optimizer\(Lamb\)"):
        ZeroEngine(model, Lamb(model.parameters(), lr=0.01), ZeroConfig(stage=stage))


def test_stage0_and_exact_classes_are_admitted():
    model = make_model()
    ZeroEngine(model, Lamb(model.parameters(), lr=0.01), ZeroConfig(stage=0)).remove()  # whole tensors: any rule
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        ZeroEngine(model, cls(model.parameters(), lr=0.01), ZeroConfig(stage=2)).remove()


def test_registered_subclass_is_admitted():
    class ScaledSGD(torch.optim.SGD):  # elementwise, declared so by its author
        pass

    model = make_model()
    with pytest.raises(ValueError, match="register_shardable_optimizer"):
        ZeroEngine(model, ScaledSGD(model.parameters(), lr=0.1), ZeroConfig(stage=1))
    register_shardable_optimizer(ScaledSGD)
    ZeroEngine(model, ScaledSGD(model.parameters(), lr=0.1), ZeroConfig(stage=1)).remove()
