"""``optimizer.add_param_group`` after setup (unfreezing layers) at every stage, and Lightning's BaseFinetuning.

Reference: one process on the global batch (both ranks' batches; equal sizes, so the mean loss is the
average of the ranks' means). DDP itself is no reference here: its reducer is built at wrap time from
the parameters that then require a gradient, so parameters unfrozen later are never all-reduced and DDP
ranks drift apart (checked: after one backward their gradients differ between ranks).
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_zero  # noqa: F401
from lightning_zero import ZeroConfig, ZeroEngine, ZeroStrategy
from lightning_zero.checkpoint import load_checkpoint_dir, save_engine_checkpoint
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lightning_models import _params, load_rank_files, trainer_kwargs
from tests.helpers.models import batch, loss_fn, make_model

RTOL, ATOL = 1e-5, 1e-6
BEFORE, AFTER = 2, 3  # steps before and after the add
STAGE3 = dict(stage=3, unit_classes=["Linear"], persist_numel=0)
CONFIGS = {"zero0": dict(stage=0), "zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": STAGE3,
           "zero2_offload": dict(stage=2, offload_optimizer=True),
           "zero3_offload": dict(STAGE3, offload_optimizer=True, offload_params=True)}


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)


def _unfreeze(model, opt):
    model.frozen.requires_grad_(True)
    opt.add_param_group({"params": list(model.frozen.parameters()), "lr": 0.01, "weight_decay": 0.0})


def _reference(world_size: int) -> dict:
    model = make_model()
    opt = _optimizer(model)
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            _unfreeze(model, opt)
        tokens = torch.cat([batch(step, r) for r in range(world_size)])
        loss_fn(model, tokens, False).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine_run(rank, world_size, kw, ckpt=None):
    model = make_model()
    opt = _optimizer(model)
    engine = ZeroEngine(model, opt, ZeroConfig(**kw))
    def at_step(step):
        if step == BEFORE:
            _unfreeze(model, opt)
            if ckpt is not None:  # saved right after the add, before the new group's first step
                save_engine_checkpoint(ckpt, model, engine)

    return _train_and_collect(model, engine, rank, range(BEFORE + AFTER), at_step)


def _train_and_collect(model, engine, rank, steps, at_step=lambda step: None):
    """Engine steps on this rank's batches; the full weights at the end (the engine removed)."""
    for step in steps:
        at_step(step)
        loss_fn(model, batch(step, rank), False).backward()
        engine.step()
    with engine.gathered_params():
        out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.remove()
    return out


def _resume_run(rank, world_size, kw, ckpt):
    model = make_model()
    opt = _optimizer(model)
    engine = ZeroEngine(model, opt, ZeroConfig(**kw))
    _unfreeze(model, opt)  # the same param groups as when saved
    load_checkpoint_dir(ckpt, model, engine)
    return _train_and_collect(model, engine, rank, range(BEFORE, BEFORE + AFTER))


def _assert_close(got, ref, what):
    for name, v in ref.items():
        torch.testing.assert_close(got[name].float(), v.float(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


@pytest.fixture(scope="module")
def reference():
    return _reference(2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_add_param_group_after_setup_matches_reference(name, reference):
    results = run_distributed(_engine_run, 2, CONFIGS[name])
    assert not torch.equal(reference["frozen.weight"], make_model().frozen.weight)  # the added group trained
    for rank, got in enumerate(results):
        _assert_close(got, reference, f"{name} rank {rank}")
    for name_, v in results[0].items():  # ranks identical, no drift
        assert torch.equal(results[1][name_], v), name_


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_checkpoint_saved_after_add_round_trips(name, reference, tmp_path):
    ckpt = str(tmp_path / "after_add")
    whole = run_distributed(_engine_run, 2, CONFIGS[name], ckpt)
    resumed = run_distributed(_resume_run, 2, CONFIGS[name], ckpt)
    for rank, (r, w) in enumerate(zip(resumed, whole)):
        _assert_close(r, w, f"{name} rank {rank} resumed")
        _assert_close(r, reference, f"{name} rank {rank} vs reference")


@pytest.mark.parametrize("stage", [2, 3])
def test_add_param_group_refuses_held_or_foreign_tensors(stage):
    model = make_model()
    opt = _optimizer(model)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage))
    with pytest.raises(ValueError, match=r"'fc1.weight' is already in optimizer 0"):
        opt.add_param_group({"params": [model.fc1.weight]})
    with pytest.raises(ValueError, match="not a parameter of the module"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1
    engine.remove()


# -- Lightning's BaseFinetuning ----------------------------------------------------------------------------
class Rows(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(17 * i + 3)
        x = torch.randn(5, generator=g)
        return x, x.sum(0, keepdim=True).tanh()


class Finetuned(pl.LightningModule):
    def __init__(self, out: str, tag: str, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6))
        self.head = nn.Linear(6, 1)
        self.out, self.tag, self.batch_size = out, tag, batch_size
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def train_dataloader(self):
        if self.trainer.world_size > 1:  # Lightning puts a shuffling DistributedSampler (seed 0) in
            return DataLoader(Rows(), batch_size=self.batch_size)
        # the reference: the same permutation (it depends on seed and epoch only), so each global batch is
        # the union of the two ranks' batches
        return DataLoader(Rows(), batch_size=self.batch_size,
                          sampler=DistributedSampler(Rows(), num_replicas=1, rank=0, shuffle=True, seed=0))

    def training_step(self, b, batch_idx):
        x, y = b
        loss = nn.functional.mse_loss(self.head(torch.tanh(self.backbone(x))), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.05)

    def on_train_end(self):
        torch.save({"losses": self.losses, "params": _params(self)},
                   os.path.join(self.out, f"{self.tag}train_rank{self.global_rank}.pt"))


class UnfreezeBackbone(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.02)


def _finetune_fit(out, tag, strategy, devices, batch_size):
    kw = trainer_kwargs(devices=devices, max_steps=-1, max_epochs=3, callbacks=[UnfreezeBackbone()])
    Trainer(strategy=strategy, **kw).fit(Finetuned(out, tag, batch_size))
    return load_rank_files(out, tag, "train", devices)


@pytest.fixture(scope="module")
def finetune_reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("finetune_ref"))
    ref = _finetune_fit(out, "ref_", "auto", 1, 8)[0]  # one process, the global batch of 2 ranks x 4
    assert not torch.equal(ref["params"]["backbone.0.weight"], Finetuned(out, "", 1).backbone[0].weight.detach())
    return ref


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", [dict(stage=0), dict(stage=1), dict(stage=2), dict(stage=3, persist_numel=0,
                                                                                    unit_classes=["Linear"])],
                         ids=["zero0", "zero1", "zero2", "zero3"])
def test_base_finetuning_unfreezes_under_trainer(tmp_path, finetune_reference, kw):
    got = _finetune_fit(str(tmp_path), "zero_", ZeroStrategy(start_method="fork", **kw), 2, 4)
    mean = (torch.tensor(got[0]["losses"]) + torch.tensor(got[1]["losses"])) / 2
    torch.testing.assert_close(mean, torch.tensor(finetune_reference["losses"]), rtol=RTOL, atol=ATOL)
    for rank, r in enumerate(got):
        _assert_close(r["params"], finetune_reference["params"], f"rank {rank}")


def _finetune_resume(out, tag, strategy, devices, batch_size, ckpts):
    """Three epochs saving each, then a second fit resumed from the checkpoint written after the add."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def kw(**extra):
        return trainer_kwargs(devices=devices, max_steps=-1, max_epochs=3, default_root_dir=ckpts, **extra)

    Trainer(strategy=strategy(), **kw(enable_checkpointing=True, callbacks=[UnfreezeBackbone(), ModelCheckpoint(
        dirpath=ckpts, save_top_k=-1, every_n_epochs=1)])).fit(Finetuned(out, tag + "a_", batch_size))
    (after_add,) = [os.path.join(ckpts, f) for f in os.listdir(ckpts) if f.startswith("epoch=1")]
    Trainer(strategy=strategy(), **kw(callbacks=[UnfreezeBackbone()])).fit(
        Finetuned(out, tag + "b_", batch_size), ckpt_path=after_add)
    return load_rank_files(out, tag + "b_", "train", devices)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", [dict(stage=2), dict(stage=3, persist_numel=0, unit_classes=["Linear"]),
                                dict(stage=2, checkpoint_format="full")], ids=["zero2", "zero3", "zero2_full"])
def test_base_finetuning_resume_after_unfreeze(tmp_path, kw):
    # Lightning's own resume is the reference: the sharded checkpoint's added group is restored by name
    ref = _finetune_resume(str(tmp_path), "ref_", lambda: "auto", 1, 8, str(tmp_path / "ref"))[0]
    got = _finetune_resume(str(tmp_path), "zero_", lambda: ZeroStrategy(start_method="fork", **kw), 2, 4,
                           str(tmp_path / "zero"))
    mean = (torch.tensor(got[0]["losses"]) + torch.tensor(got[1]["losses"])) / 2
    torch.testing.assert_close(mean, torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
    for rank, r in enumerate(got):
        _assert_close(r["params"], ref["params"], f"rank {rank}")


def test_unfreezing_a_parameter_frozen_at_setup_is_a_clear_error():
    model = make_model()  # ParityNet.frozen: requires_grad=False, but in the optimizer below
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2))
    loss_fn(model, batch(0, 0), False).backward()
    engine.step()  # frozen parameters in the optimizer are fine while they stay frozen
    model.frozen.requires_grad_(True)
    loss_fn(model, batch(1, 0), False).backward()
    with pytest.raises(ValueError, match=r"'frozen.weight' \(and 1 more\) was frozen when ZeRO sharded.*add_param_group"):
        engine.step()
    engine.remove()
