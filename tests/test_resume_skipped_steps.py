"""The count of steps skipped for non-finite gradients (fp16 loss scaler, bf16 ``check_finite``): one count
shared by the loss scaler, the engine and the precision plugin, and it survives a resume, from sharded
directories and from single (full) files, as the loss scale itself does."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroConfig, ZeroEngine, ZeroPrecision, ZeroStrategy
from lightning_zero import checkpoint as ck
from tests.helpers.ckpt_models import TiedParityModule, make_tied, train
from tests.helpers.lightning_models import trainer_kwargs
from tests.helpers.models import TiedBlocks, loss_fn, make_optimizer

pytestmark = pytest.mark.timeout(120)
OVERFLOW_STEP = 1


class OverflowOnce(TiedParityModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == OVERFLOW_STEP and self.global_rank == self.trainer.world_size - 1:
            loss = loss * float("inf")  # non-finite gradients on one rank: every rank skips
        return loss

    def on_train_start(self):
        self._skipped = [self.trainer.precision_plugin.skipped_steps]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._skipped.append(float(self.trainer.callback_metrics["skipped_steps"]))

    def on_train_end(self):
        torch.save(self._skipped, os.path.join(self.out, f"{self.tag}skipped_rank{self.global_rank}.pt"))


def _run(out, tag, precision, fmt, max_steps, ckpt_path=None, callbacks=()):
    strategy = ZeroStrategy(stage=2, start_method="fork", checkpoint_format=fmt)
    Trainer(strategy=strategy, plugins=[ZeroPrecision(precision, initial_scale_power=8)], callbacks=list(callbacks),
            **trainer_kwargs(devices=2, max_steps=max_steps, enable_checkpointing=True)).fit(
        OverflowOnce(out, tag=tag), ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out, f"{tag}skipped_rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("precision,fmt", [("bf16-mixed", "sharded"), ("bf16-mixed", "full"), ("16-mixed", "sharded")])
def test_skipped_steps_restored_on_resume(tmp_path, precision, fmt):
    out = str(tmp_path)
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1, every_n_train_steps=3)
    first = _run(out, "a_", precision, fmt, 3, callbacks=[saver])
    assert all(s == [0, 0.0, 1.0, 1.0] for s in first), first  # step 1 was skipped
    path = tmp_path / "ck" / "step=3.ckpt"
    assert path.is_dir() == (fmt == "sharded")
    resumed = _run(out, "b_", precision, fmt, 5, ckpt_path=str(path))
    assert all(s == [1, 1.0, 1.0] for s in resumed), resumed  # continues at 1, not from 0


def test_engine_checkpoint_keeps_skipped_steps(tmp_path):
    model = make_tied()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=1), compute_dtype=torch.bfloat16,
                        check_finite=True)
    train(model, engine, 0, 1, range(1))
    (loss_fn(model, torch.zeros(2, 5, dtype=torch.long), False) * float("inf")).backward()
    assert not engine.step() and engine.skipped_steps == 1
    ck.save_engine_checkpoint(tmp_path / "e.ckpt", model, engine)
    fresh = make_tied(3)
    fresh_engine = ZeroEngine(fresh, make_optimizer(fresh, "adamw"), ZeroConfig(stage=1),
                              compute_dtype=torch.bfloat16, check_finite=True)
    ck.load_checkpoint_dir(tmp_path / "e.ckpt", fresh, fresh_engine)
    assert fresh_engine.skipped_steps == 1


def test_skipped_steps_outlive_the_engine(tmp_path):
    """After fit (engine torn down) the precision state still holds the count, so a checkpoint saved then
    keeps it; the next fit in the same process carries on from it (as the fp16 loss scaler does)."""
    plugin = ZeroPrecision("bf16-mixed")
    trainer = Trainer(strategy=ZeroStrategy(stage=2), plugins=[plugin], **trainer_kwargs(devices=1, max_steps=3))
    trainer.fit(OverflowOnce(str(tmp_path), tag="one_"))
    assert trainer.strategy.engine is None
    assert plugin.skipped_steps == 1 and plugin.state_dict()["skipped_steps"] == 1


def test_one_count_of_skipped_steps_shared_by_scaler_engine_and_precision_plugin():
    from lightning_zero import ZeroPrecision
    from lightning_zero.engine import StepCounters, ZeroConfig, ZeroEngine

    model = TiedBlocks()
    fp16 = ZeroPrecision("16-mixed")
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=1),
                        compute_dtype=torch.float16, loss_scaler=fp16.loss_scaler)
    fp16.attach(engine)
    assert engine.counters is fp16.counters is fp16.loss_scaler.counters
    (model.head(model.emb(torch.tensor([1, 2]))).float().sum() * float("inf")).backward()
    assert engine.step() is False
    assert engine.skipped_steps == fp16.skipped_steps == fp16.loss_scaler.skipped_steps == 1
    fp16.load_state_dict({"loss_scaler": fp16.loss_scaler.state_dict(), "skipped_steps": 7})
    assert engine.skipped_steps == fp16.loss_scaler.state_dict()["skipped_steps"] == 7  # nothing copied
    engine.remove()
    assert fp16.skipped_steps == 7  # the count outlives the engine

    bf16 = ZeroPrecision("bf16-mixed")
    other = TiedBlocks()
    engine = ZeroEngine(other, torch.optim.SGD(other.parameters(), lr=0.1), ZeroConfig(stage=1),
                        compute_dtype=torch.bfloat16, check_finite=True)
    bf16.attach(engine)
    assert engine.counters is bf16.counters and isinstance(bf16.counters, StepCounters)
    bf16.load_state_dict({"skipped_steps": 3})
    assert engine.skipped_steps == 3
    engine.remove()
    with pytest.raises(TypeError, match="loss_scaler must be a DynamicLossScaler or a StaticLossScaler"):
        ZeroEngine(TiedBlocks(), torch.optim.SGD(TiedBlocks().parameters(), lr=0.1), loss_scaler=object())
