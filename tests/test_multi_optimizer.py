"""Several optimizers over disjoint parameters (a GAN, manual optimization) under ZeroStrategy vs Lightning DDP.

The LightningModule uses the whole manual-optimization API: ``self.optimizers()``, ``toggle_optimizer`` /
``untoggle_optimizer``, ``manual_backward``, ``clip_gradients(opt, ...)``, ``opt.step()``, ``opt.zero_grad()``.
Reference: the same module under ``DDPStrategy(find_unused_parameters=True)`` (a toggled-off optimizer's
parameters get no gradient in the other's backward), same seed and data; fp32 at rtol 1e-5.
"""

from __future__ import annotations

import contextlib
import glob
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from lightning_zero import ZeroConfig, ZeroEngine, ZeroStrategy
from tests.helpers.lightning_models import ParityModule, _params, load_rank_files, trainer_kwargs
from tests.helpers.gan import DATA, LATENT, FabricGan, RealData, mlp
from tests.helpers.models import make_model

RTOL, ATOL = 1e-5, 1e-6
class Gan(pl.LightningModule):
    """``single=True``: one optimizer over both nets (manual optimization with ONE optimizer)."""

    def __init__(self, out: str, tag: str, single: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gen, self.disc = mlp(LATENT, DATA), mlp(DATA, 1)
        self.out, self.tag, self.single = out, tag, single
        self.automatic_optimization = False
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # see tests/helpers/lightning_models.py: forked ranks must not use OpenMP pools

    def train_dataloader(self):
        return DataLoader(RealData(), batch_size=4, shuffle=False)

    def configure_optimizers(self):
        if self.single:
            return torch.optim.AdamW(self.parameters(), lr=0.02)
        return [torch.optim.Adam(self.gen.parameters(), lr=0.02, betas=(0.5, 0.9)),
                torch.optim.SGD(self.disc.parameters(), lr=0.05, momentum=0.9)]

    def _noise(self, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.global_step + 100 * self.global_rank)
        return torch.randn(n, LATENT, generator=g)

    def training_step(self, real, batch_idx):
        z = self._noise(real.shape[0])
        if self.single:
            opt = self.optimizers()
            fake = self.gen(z)
            loss = F.softplus(-self.disc(fake)).mean() + F.softplus(-self.disc(real)).mean()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
            opt.step()
            self.losses.append(loss.item())
            return
        g_opt, d_opt = self.optimizers()
        self.toggle_optimizer(g_opt)
        fake = self.gen(z)
        g_loss = F.softplus(-self.disc(fake)).mean()
        self.manual_backward(g_loss)
        self.clip_gradients(g_opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)

        self.toggle_optimizer(d_opt)
        d_loss = F.softplus(-self.disc(real)).mean() + F.softplus(self.disc(fake.detach())).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.losses += [g_loss.item(), d_loss.item()]

    def on_train_end(self):
        torch.save({"losses": self.losses, "params": _params(self), "global_step": self.global_step},
                   os.path.join(self.out, f"{self.tag}train_rank{self.global_rank}.pt"))


def _fit(out, tag, strategy, single=False, max_epochs=2, ckpt_dir=None, ckpt_path=None):
    model = Gan(out, tag, single)
    kw = trainer_kwargs(devices=2, max_steps=-1, max_epochs=max_epochs)
    if ckpt_dir is not None:
        kw.update(enable_checkpointing=True, default_root_dir=ckpt_dir,
                  callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)])
    Trainer(strategy=strategy, **kw).fit(model, ckpt_path=ckpt_path)
    return load_rank_files(out, tag, "train", 2)


def _ddp():
    return DDPStrategy(start_method="fork", find_unused_parameters=True)


def _compare(got, ref, losses=True):
    for rank, (z, d) in enumerate(zip(got, ref)):
        if losses:
            torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(d["losses"]), rtol=RTOL, atol=ATOL)
        assert set(z["params"]) == set(d["params"])
        for name in d["params"]:
            torch.testing.assert_close(z["params"][name], d["params"][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.fixture(scope="module")
def ddp_gan(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gan_ddp"))
    ref = _fit(out, "ddp_", _ddp())
    assert ref[0]["global_step"] == 8  # 2 epochs x 2 batches x 2 optimizers
    init = Gan(out, "init")
    assert not torch.equal(ref[0]["params"]["gen.0.weight"], init.gen[0].weight.detach())
    assert not torch.equal(ref[0]["params"]["disc.0.weight"], init.disc[0].weight.detach())
    return ref


STAGE3 = dict(stage=3, unit_classes=["Sequential"], persist_numel=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", [dict(stage=0), dict(stage=1), dict(stage=2), STAGE3,
                                dict(stage=2, offload_optimizer=True),
                                dict(STAGE3, offload_optimizer=True, offload_params=True), "zero3_fork"],
                         ids=["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_preset"])
def test_gan_two_optimizers_match_ddp(tmp_path, ddp_gan, kw):
    strategy = kw if isinstance(kw, str) else ZeroStrategy(start_method="fork", **kw)
    got = _fit(str(tmp_path), "zero_", strategy)
    _compare(got, ddp_gan)


@pytest.mark.timeout(300)
def test_manual_optimization_one_optimizer_matches_ddp(tmp_path):
    ref = _fit(str(tmp_path), "ddp_", _ddp(), single=True)
    got = _fit(str(tmp_path), "zero_", ZeroStrategy(stage=2, start_method="fork"), single=True)
    _compare(got, ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", [dict(stage=2), STAGE3, dict(stage=2, checkpoint_format="full")],
                         ids=["zero2", "zero3", "zero2_full"])
def test_gan_checkpoint_holds_both_optimizers_and_resumes(tmp_path, ddp_gan, kw):
    out, ckpts = str(tmp_path), str(tmp_path / "ckpt")
    whole = _fit(out, "a_", ZeroStrategy(start_method="fork", **kw), ckpt_dir=ckpts)
    _compare(whole, ddp_gan)
    first = sorted(glob.glob(os.path.join(ckpts, "epoch=0*")))
    assert len(first) == 1
    meta = torch.load(os.path.join(first[0], "meta.pt") if os.path.isdir(first[0]) else first[0], weights_only=False)
    assert len(meta["optimizer_states"]) == 2  # Adam (generator) and SGD (discriminator)
    assert [len(st["param_groups"][0]["params"]) for st in meta["optimizer_states"]] == [4, 4]
    resumed = _fit(out, "b_", ZeroStrategy(start_method="fork", **kw), ckpt_path=first[0])
    # the resumed run records only the second epoch's losses; its final weights are the whole run's
    _compare(resumed, whole, losses=False)
    for r, w in zip(resumed, whole):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(w["losses"][4:]), rtol=RTOL, atol=ATOL)


def test_parameter_in_two_optimizers_is_refused():
    model = make_model()
    shared = [torch.optim.Adam(model.parameters()), torch.optim.SGD(model.fc1.parameters(), lr=0.1)]
    with pytest.raises(ValueError, match=r"Parameter 'fc1.weight' is in optimizer 0 and optimizer 1.*disjoint"):
        ZeroEngine(model, shared, ZeroConfig(stage=2))


@pytest.mark.timeout(300)  # the rank processes are forked from this one
def test_optimizers_sharing_a_parameter_is_a_clear_error(tmp_path):
    model = ParityModule(str(tmp_path), n_optimizers=2)  # AdamW and SGD over the same parameters
    trainer = Trainer(strategy=ZeroStrategy(stage=1, start_method="fork"), **trainer_kwargs(devices=1, max_steps=1))
    with pytest.raises(Exception) as info:  # raised in the forked rank, re-raised by torch.multiprocessing
        trainer.fit(model)
    text = str(info.value)
    assert "ValueError" in text or isinstance(info.value, ValueError)
    assert "is in optimizer 0 and optimizer 1" in text and "disjoint parameter sets" in text


def test_sharded_optimizer_state_lists_each_optimizers_own_layout():
    """The "layout" a checkpoint keeps per optimizer (positions, frozen ones as None; what lightning_io maps
    back to torch's numbering) is that optimizer's, not the first one's."""
    from lightning_zero.checkpoint.sharded_state import sharded_optimizer_state

    gen, disc = nn.Linear(3, 4), nn.Linear(4, 2)
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    gen.bias.requires_grad_(False)  # frozen at setup: keeps its position, as None
    opts = [torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)]
    engine = ZeroEngine(model, opts, ZeroConfig(stage=0))
    layouts = [sharded_optimizer_state(engine, o)["layout"] for o in opts]
    assert layouts == [[["gen.weight", None]], [["disc.weight", "disc.bias"]]]
    engine.remove()


@pytest.mark.timeout(300)
def test_consolidated_lightning_file_holds_both_optimizers_and_resumes_under_ddp(tmp_path, ddp_gan):
    """``lightning-zero consolidate DIR OUT --lightning --optimizer`` on a two-optimizer run: each optimizer's
    own state, numbered from 0 as torch numbers it, so plain DDP resumes and ends where the whole run ends."""
    from lightning_zero.tools.cli import main as cli_main

    out, ckpts = str(tmp_path), str(tmp_path / "ckpt")
    whole = _fit(out, "a_", ZeroStrategy(stage=2, start_method="fork"), ckpt_dir=ckpts)
    first = sorted(glob.glob(os.path.join(ckpts, "epoch=0*")))
    single = str(tmp_path / "consolidated.ckpt")
    assert cli_main(["consolidate", first[0], single, "--lightning", "--optimizer", "--quiet"]) == 0
    ckpt = torch.load(single, weights_only=False)
    adam, sgd = ckpt["optimizer_states"]
    assert sorted(adam["state"]) == [0, 1, 2, 3] and set(adam["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sorted(sgd["state"]) == [0, 1, 2, 3] and set(sgd["state"][0]) == {"momentum_buffer"}
    assert sgd["state"][0]["momentum_buffer"].shape == (8, DATA)  # disc.0.weight, not the generator's
    resumed = _fit(out, "b_", _ddp(), ckpt_path=single)
    _compare(resumed, whole, losses=False)


class GanNoToggle(Gan):
    """The GAN of Lightning's docs: ``opt.zero_grad()`` before each backward, no ``toggle_optimizer``, so the
    generator's backward also writes discriminator gradients, which ``opt_d.zero_grad()`` must clear.

    ``mode="add_group"``: ``self.extra`` (requires grad, in no optimizer, unused) joins the discriminator's
    optimizer through ``self.optimizers()`` at the second epoch and is used from then on.
    ``mode="toggle"``: the same step with ``toggle_optimizer`` / ``untoggle_optimizer`` around each half."""

    def __init__(self, out: str, tag: str, mode: str) -> None:
        super().__init__(out, tag)
        self.mode = mode
        self.extra = nn.Linear(1, 1)
        self.added = False

    def _disc(self, x):
        y = self.disc(x)
        return self.extra(y) if self.added else y

    def training_step(self, real, batch_idx):
        g_opt, d_opt = self.optimizers()
        if self.mode == "add_group" and self.current_epoch == 1 and not self.added:
            d_opt.add_param_group({"params": list(self.extra.parameters()), "lr": 0.03})
            self.added = True
        toggle = self.mode == "toggle"
        z = self._noise(real.shape[0])
        if toggle:
            self.toggle_optimizer(g_opt)
        g_opt.zero_grad()
        fake = self.gen(z)
        g_loss = F.softplus(-self._disc(fake)).mean()
        self.manual_backward(g_loss)
        g_opt.step()
        if toggle:
            self.untoggle_optimizer(g_opt)
            self.toggle_optimizer(d_opt)
        d_opt.zero_grad()
        d_loss = F.softplus(-self._disc(real)).mean() + F.softplus(self._disc(fake.detach())).mean()
        self.manual_backward(d_loss)
        d_opt.step()
        if toggle:
            self.untoggle_optimizer(d_opt)
        self.losses += [g_loss.item(), d_loss.item()]


def _fit_no_toggle(out, tag, strategy, mode, devices=2):
    model = GanNoToggle(out, tag, mode)
    Trainer(strategy=strategy, **trainer_kwargs(devices=devices, max_steps=-1, max_epochs=2)).fit(model)
    return load_rank_files(out, tag, "train", devices)


_NO_TOGGLE_REF: dict = {}


def _no_toggle_reference(tmp_path_factory, mode):
    if mode not in _NO_TOGGLE_REF:
        out = str(tmp_path_factory.mktemp(f"gan_ddp_{mode}"))
        _NO_TOGGLE_REF[mode] = _fit_no_toggle(out, "ddp_", _ddp(), mode)
    return _NO_TOGGLE_REF[mode]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["plain", "add_group", "toggle"])
@pytest.mark.parametrize("kw", [dict(stage=0), dict(stage=1), dict(stage=2), STAGE3,
                                dict(STAGE3, offload_optimizer=True, offload_params=True, offload_kernel="user")],
                         ids=["zero0", "zero1", "zero2", "zero3", "zero3_offload"])
def test_gan_zero_grad_through_self_optimizers_matches_ddp(tmp_path, tmp_path_factory, kw, mode):
    """``opt_d.zero_grad()`` / ``add_param_group`` on what ``self.optimizers()`` returns reach the engine,
    although Lightning rebuilt those wrappers after the strategy's setup (``setup_precision_plugin``)."""
    ref = _no_toggle_reference(tmp_path_factory, mode)
    assert ref[0]["global_step"] == 8
    if mode == "add_group":  # the added layer trained in the second epoch
        assert not torch.equal(ref[0]["params"]["extra.weight"], GanNoToggle("", "", mode).extra.weight.detach())
    got = _fit_no_toggle(str(tmp_path), "zero_", ZeroStrategy(start_method="fork", **kw), mode)
    _compare(got, ref)


@pytest.mark.timeout(300)
def test_gan_zero_grad_at_one_device_matches_ddp(tmp_path):
    ref = _fit_no_toggle(str(tmp_path), "ddp_", _ddp(), "plain", devices=1)
    got = _fit_no_toggle(str(tmp_path), "zero_", ZeroStrategy(stage=2, start_method="fork"), "plain", devices=1)
    _compare(got, ref)


def _fabric_gan(rank, world_size, strategies):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    torch.set_num_threads(1)
    data = [RealData()[i] for i in range(16)]
    out = {}
    for name in strategies:
        strategy = FabricDDP(find_unused_parameters=True) if name == "ddp" else lightning_zero.ZeroFabricStrategy(
            **dict(STAGE3 if name == "zero3" else dict(stage=int(name[-1]))))
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
        fabric.launch()
        module = FabricGan(extra=True)
        g_opt = torch.optim.Adam(module.gen.parameters(), lr=0.02, betas=(0.5, 0.9))
        d_opt = torch.optim.SGD(module.disc.parameters(), lr=0.05, momentum=0.9)
        model, g_opt, d_opt = fabric.setup(module, g_opt, d_opt)
        losses = []
        for step in range(6):
            if step == 3:
                d_opt.add_param_group({"params": list(module.extra.parameters()), "lr": 0.03})
                module.added = True
            real = torch.stack(data[4 * (step % 2) + 8 * rank: 4 * (step % 2) + 8 * rank + 4])
            z = torch.randn(4, LATENT, generator=torch.Generator().manual_seed(1000 * step + 100 * rank))
            g_opt.zero_grad()
            g_loss = model(z, real, "g")
            fabric.backward(g_loss)
            g_opt.step()
            d_opt.zero_grad()  # the discriminator gradient of the generator's backward must go
            d_loss = model(z, real, "d")
            fabric.backward(d_loss)
            d_opt.step()
            losses += [g_loss.item(), d_loss.item()]
        gathered = getattr(fabric.strategy, "gathered_params", None)
        with gathered() if gathered is not None else contextlib.nullcontext():
            params = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out[name] = {"losses": losses, "params": params}
        fabric.strategy.teardown() if name != "ddp" else None
    return out


@pytest.mark.timeout(300)
def test_fabric_gan_zero_grad_and_add_param_group_match_fabric_ddp():
    """Fabric's optimizer wrapper: ``zero_grad`` / ``add_param_group`` reach the engine at every stage."""
    from tests.helpers.dist_utils import run_distributed

    names = ["ddp", "zero0", "zero1", "zero2", "zero3"]
    for rank, res in enumerate(run_distributed(_fabric_gan, 2, names)):
        ref = res["ddp"]
        assert not torch.equal(ref["params"]["extra.weight"], FabricGan(extra=True).extra.weight.detach())
        for name in names[1:]:
            _compare([res[name]], [ref])
