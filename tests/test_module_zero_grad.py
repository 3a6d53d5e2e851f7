"""Every way a user clears gradients reaches the engine: the LightningModule's own ``self.zero_grad()``, a
submodule's (``self.disc.zero_grad()``, the DCGAN tutorial's ``netD.zero_grad()``), ``set_to_none=False``,
and one optimizer over two nets with one net's gradients cleared between two backwards.

A GAN under manual optimization without ``toggle_optimizer``: the generator's backward also fills the
discriminator's gradients, which only a ``zero_grad`` that reaches the engine's reduced gradient shards
removes. Reference: the same module under Lightning's DDP, same seed and data; fp32 at rtol 1e-5.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from lightning_zero import ZeroStrategy
from tests.helpers.gan import DATA, LATENT, FabricGan, RealData, mlp
from tests.helpers.lightning_models import _params, load_rank_files, trainer_kwargs

RTOL, ATOL = 1e-5, 1e-6
STAGE3 = dict(stage=3, unit_classes=["Sequential"], persist_numel=0)
PRESETS = {"zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": STAGE3,
           "zero3_offload": dict(STAGE3, offload_optimizer=True, offload_params=True, offload_kernel="user"),
           "zero2_hybrid": dict(stage=2, shard_group_size=1)}  # shards of 1 rank, replicated across 2


class ClearingGan(pl.LightningModule):
    """``how`` clears the gradients before each backward:
    ``"module"``: ``self.zero_grad()``; ``"keep"``: ``self.zero_grad(set_to_none=False)``;
    ``"submodule"``: ``self.gen.zero_grad()`` / ``self.disc.zero_grad()``; ``"optimizer_keep"``:
    ``opt.zero_grad(set_to_none=False)`` through Lightning's optimizer wrapper;
    ``"one_optimizer"``: one AdamW over both nets, two backwards per step, ``self.disc.zero_grad()`` between
    them (the discriminator steps on the second loss only, the generator on both: part of one optimizer's
    gradients is cleared); ``"clip_then_clear"``: the same optimizer clipped by the global norm, then
    ``self.disc.zero_grad()`` before its step."""

    def __init__(self, out: str, tag: str, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gen, self.disc = mlp(LATENT, DATA), mlp(DATA, 1)
        self.out, self.tag, self.how = out, tag, how
        self.automatic_optimization = False
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # forked ranks must not use OpenMP pools (tests/helpers/lightning_models.py)

    def train_dataloader(self):
        return DataLoader(RealData(), batch_size=4, shuffle=False)

    def configure_optimizers(self):
        if self.how in ("one_optimizer", "clip_then_clear"):
            return torch.optim.AdamW(self.parameters(), lr=0.02)
        return [torch.optim.Adam(self.gen.parameters(), lr=0.02, betas=(0.5, 0.9)),
                torch.optim.SGD(self.disc.parameters(), lr=0.05, momentum=0.9)]

    def _clear(self, net: nn.Module, opt) -> None:
        if self.how == "optimizer_keep":
            opt.zero_grad(set_to_none=False)
        elif self.how == "module":
            self.zero_grad()
        elif self.how == "keep":
            self.zero_grad(set_to_none=False)
        else:
            net.zero_grad()

    def training_step(self, real, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.global_step + 100 * self.global_rank)
        z = torch.randn(real.shape[0], LATENT, generator=g)
        if self.how in ("one_optimizer", "clip_then_clear"):
            opt = self.optimizers()
            self.zero_grad()
            g_loss = F.softplus(-self.disc(self.gen(z))).mean()
            self.manual_backward(g_loss)
            if self.how == "one_optimizer":
                self.disc.zero_grad()  # the discriminator keeps only the second loss's gradient
            scores = self.disc(torch.cat([real, self.gen(z)]))  # stage 3: the units in the first forward's order
            d_loss = F.softplus(-scores[: len(real)]).mean() + F.softplus(scores[len(real):]).mean()
            self.manual_backward(d_loss)
            if self.how == "clip_then_clear":  # the gradients already taken for the norm: zeroed there too
                self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
                self.disc.zero_grad()  # grad None: the discriminator does not step (no decay, no moments)
            opt.step()
            self.losses += [g_loss.item(), d_loss.item()]
            return
        g_opt, d_opt = self.optimizers()
        self._clear(self.gen, g_opt)
        fake = self.gen(z)
        g_loss = F.softplus(-self.disc(fake)).mean()
        self.manual_backward(g_loss)
        g_opt.step()
        self._clear(self.disc, d_opt)  # the discriminator gradient of the generator's backward must go
        d_loss = F.softplus(-self.disc(real)).mean() + F.softplus(self.disc(fake.detach())).mean()
        self.manual_backward(d_loss)
        d_opt.step()
        self.losses += [g_loss.item(), d_loss.item()]

    def on_train_end(self):
        torch.save({"losses": self.losses, "params": _params(self), "global_step": self.global_step},
                   os.path.join(self.out, f"{self.tag}train_rank{self.global_rank}.pt"))


def _fit(out: str, tag: str, strategy, how: str) -> list[dict]:
    Trainer(strategy=strategy, **trainer_kwargs(devices=2, max_steps=-1, max_epochs=2)).fit(
        ClearingGan(out, tag, how))
    return load_rank_files(out, tag, "train", 2)


_REF: dict = {}


def _reference(tmp_path_factory, how: str) -> list[dict]:
    if how not in _REF:
        out = str(tmp_path_factory.mktemp(f"ddp_{how}"))
        _REF[how] = _fit(out, "ddp_", DDPStrategy(start_method="fork", find_unused_parameters=True), how)
    return _REF[how]


def _compare(got: list[dict], ref: list[dict]) -> None:
    for rank, (z, d) in enumerate(zip(got, ref)):
        torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(d["losses"]), rtol=RTOL, atol=ATOL)
        assert set(z["params"]) == set(d["params"])
        for name in d["params"]:
            torch.testing.assert_close(z["params"][name], d["params"][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["module", "keep", "submodule", "one_optimizer", "optimizer_keep",
                                 "clip_then_clear"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_gan_clearing_gradients_matches_ddp(tmp_path, tmp_path_factory, preset, how):
    ref = _reference(tmp_path_factory, how)
    assert ref[0]["global_step"] == (4 if how in ("one_optimizer", "clip_then_clear") else 8)
    got = _fit(str(tmp_path), "zero_", ZeroStrategy(start_method="fork", **PRESETS[preset]), how)
    _compare(got, ref)


def _routes_on_plain_engine(rank, world_size):
    import copy
    import pickle

    from lightning_zero import ZeroConfig, ZeroEngine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(mlp(LATENT, DATA), mlp(DATA, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2))
    z = torch.randn(4, LATENT, generator=torch.Generator().manual_seed(rank))
    model(z).sum().backward()
    shards = [s for s in engine.reducer.grad_shards if s is not None]
    assert shards and all(bool(s.abs().sum() > 0) for s in shards)
    model[1].zero_grad(set_to_none=False)  # part of the one optimizer's gradients, zeroed in place
    views = [v for b in engine.buckets for p, v in zip(b.params, b.local_views(engine.reducer.grad_shards[b.index]))
             if any(p is q for q in model[1].parameters())]
    assert views and all(bool((v == 0).all()) for v in views)
    out = {"routed": type(model[1]) is not nn.Sequential and type(model[1]).__name__ == "Sequential",
           "copy": type(copy.deepcopy(model)) is nn.Sequential,
           "pickled": type(pickle.loads(pickle.dumps(model))[1]) is nn.Sequential}
    model.zero_grad()
    out["cleared"] = all(s is None for s in engine.reducer.grad_shards)
    engine.remove()
    out["restored"] = all(type(m) in (nn.Sequential, nn.Linear, nn.Tanh) for m in model.modules())
    return out


@pytest.mark.timeout(120)
def test_routed_modules_copy_as_their_own_class_and_are_restored():
    """The engine's plain API: a submodule's ``zero_grad(set_to_none=False)`` zeroes its slices of the
    reduced shards, the root's drops them; a routed module deep-copies and pickles as its own class (the copy
    is not trained by the engine) and gets its class back when the engine lets go."""
    from tests.helpers.dist_utils import run_distributed

    for res in run_distributed(_routes_on_plain_engine, 2):
        assert res == dict(routed=True, copy=True, pickled=True, cleared=True, restored=True), res


def _fabric_gan(rank, world_size, names):
    import contextlib

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    torch.set_num_threads(1)
    data = [RealData()[i] for i in range(16)]
    out = {}
    for name in names:
        kind, how = name.split(":")
        strategy = FabricDDP(find_unused_parameters=True) if kind == "ddp" else \
            lightning_zero.ZeroFabricStrategy(**PRESETS[kind])
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
        fabric.launch()
        module = FabricGan()
        g_opt = torch.optim.Adam(module.gen.parameters(), lr=0.02, betas=(0.5, 0.9))
        d_opt = torch.optim.SGD(module.disc.parameters(), lr=0.05, momentum=0.9)
        model, g_opt, d_opt = fabric.setup(module, g_opt, d_opt)
        losses = []
        for step in range(4):
            real = torch.stack(data[4 * (step % 2) + 8 * rank: 4 * (step % 2) + 8 * rank + 4])
            z = torch.randn(4, LATENT, generator=torch.Generator().manual_seed(1000 * step + 100 * rank))
            model.zero_grad() if how == "wrapper" else module.gen.zero_grad(set_to_none=False)
            g_loss = model(z, real, "g")
            fabric.backward(g_loss)
            g_opt.step()
            # the discriminator gradient of the generator's backward must go
            model.zero_grad(set_to_none=False) if how == "wrapper" else module.disc.zero_grad()
            d_loss = model(z, real, "d")
            fabric.backward(d_loss)
            d_opt.step()
            losses += [g_loss.item(), d_loss.item()]
        gathered = getattr(fabric.strategy, "gathered_params", None)
        with gathered() if gathered is not None else contextlib.nullcontext():
            params = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out[name] = {"losses": losses, "params": params}
        if kind != "ddp":
            fabric.strategy.teardown()
    return out


@pytest.mark.timeout(300)
def test_fabric_gan_module_and_submodule_zero_grad_match_fabric_ddp():
    """Fabric: ``model.zero_grad()`` on its module wrapper (either ``set_to_none``) and ``zero_grad`` on a
    submodule of the module set up (``module.disc.zero_grad()``) reach the engine at stages 1-3."""
    from tests.helpers.dist_utils import run_distributed

    names = [f"{kind}:{how}" for how in ("wrapper", "submodule") for kind in ("ddp", "zero1", "zero2", "zero3")]
    for res in run_distributed(_fabric_gan, 2, names):
        for name in names:
            ref = res["ddp:" + name.split(":")[1]]
            _compare([res[name]], [ref])
