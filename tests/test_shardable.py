"""The shardability check admits exact elementwise classes and registered ones, never a subclass by default;
LBFGS (a closure re-evaluating the loss) is refused at every stage, and a registered custom optimizer trains
as it does unsharded."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import ZeroConfig, ZeroEngine, register_shardable_optimizer

from tests.helpers.models import make_model, steps_beside_reference


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
def test_subclass_of_elementwise_class_steps_whole_tensors(stage, caplog):
    """A subclass may change step() (this one does: a trust ratio): it is never run on shards unless declared;
    it steps whole parameters on their owner ranks, equal to the plain optimizer, and the setup says so."""
    model, ref = make_model(), make_model()
    with caplog.at_level("INFO", logger="lightning_zero.engine"):
        engine = ZeroEngine(model, Lamb(model.parameters(), lr=0.01), ZeroConfig(stage=stage))
    assert "Lamb updates whole tensors" in caplog.text and "register_shardable_optimizer(Lamb)" in caplog.text
    assert engine.shardeds[0].owner is not None
    steps_beside_reference(engine, model, ref, Lamb(ref.parameters(), lr=0.01), 3)
    engine.restore_fp32_module()
    engine.remove(hand_back=False)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_stage0_and_exact_classes_are_admitted():
    model = make_model()
    ZeroEngine(model, Lamb(model.parameters(), lr=0.01), ZeroConfig(stage=0)).remove()  # whole tensors: any rule
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        ZeroEngine(model, cls(model.parameters(), lr=0.01), ZeroConfig(stage=2)).remove()


def test_registered_subclass_is_admitted():
    class ScaledSGD(torch.optim.SGD):  # elementwise, declared so by its author
        pass

    model = make_model()
    engine = ZeroEngine(model, ScaledSGD(model.parameters(), lr=0.1), ZeroConfig(stage=1))
    assert engine.shardeds[0].owner is not None  # undeclared: whole tensors on owner ranks
    engine.remove()
    register_shardable_optimizer(ScaledSGD)
    engine = ZeroEngine(model, ScaledSGD(model.parameters(), lr=0.1), ZeroConfig(stage=1))
    assert engine.shardeds[0].owner is None  # declared elementwise: steps on its shards
    engine.remove()


def _lbfgs(model):
    return torch.optim.LBFGS([p for p in model.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lbfgs_refused_with_clear_error(stage):
    model = make_model()
    with pytest.raises(ValueError, match=r"LBFGS re-evaluates the loss through a closure.*Allowed: .*AdamW"):
        ZeroEngine(model, _lbfgs(model), ZeroConfig(stage=stage))


def test_register_shardable_optimizer_admits_custom_class():
    class SignSGD(torch.optim.Optimizer):  # elementwise: each element's update uses its own gradient only
        def __init__(self, params, lr=0.01):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-g["lr"])

    class MyAdamW(torch.optim.AdamW):  # a subclass may override step(): admitted only once registered
        pass

    model = make_model()
    for cls in (SignSGD, MyAdamW):  # undeclared: stepped whole on owner ranks
        engine = ZeroEngine(model, cls(model.parameters()), ZeroConfig(stage=2))
        assert engine.shardeds[0].owner is not None, cls
        engine.remove()
    register_shardable_optimizer(MyAdamW)
    engine = ZeroEngine(model, MyAdamW(model.parameters()), ZeroConfig(stage=2))
    assert engine.shardeds[0].owner is None
    engine.remove()

    assert register_shardable_optimizer(SignSGD) is SignSGD  # usable as a decorator
    model, ref = make_model(), make_model()
    engine = ZeroEngine(model, SignSGD(model.parameters(), lr=0.1), ZeroConfig(stage=1))
    steps_beside_reference(engine, model, ref, SignSGD(ref.parameters(), lr=0.1), 2)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    engine.remove()
