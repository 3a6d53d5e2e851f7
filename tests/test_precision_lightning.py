"""ZeroPrecision under a Trainer: ``precision=`` or an explicit ZeroPrecision plugin becomes (or stays) the
strategy's plugin, unsupported precisions are one error naming the allowed ones, bf16 evaluation leaves the
model fp32, and fp16 overflow on one rank skips the step everywhere, the LR schedule does not advance, and the
scale / skipped-step count are logged."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins import HalfPrecision

from lightning_zero import ZeroPrecision, ZeroStrategy
from tests.helpers.lightning_models import ParityModule

OVERFLOW_STEP = 2


class OverflowModule(ParityModule):
    def __init__(self, out: str) -> None:
        super().__init__(out)
        self.trace: list[dict] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == OVERFLOW_STEP and self.global_rank == 1:
            loss = loss * float("inf")  # fp16 overflow on one rank only
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        sched = self.trainer.lr_scheduler_configs[0].scheduler
        with self.trainer.strategy.gathered_params():  # stage 3: parameters are whole only in here
            fc1 = self.net.fc1.weight.detach().float().clone()
        self.trace.append({
            "sched_epoch": sched.last_epoch,
            "fc1": fc1,
            "loss_scale": float(self.trainer.callback_metrics["loss_scale"]),
            "skipped": float(self.trainer.callback_metrics["skipped_steps"]),
        })

    def on_train_end(self):
        torch.save(self.trace, os.path.join(self.out, f"trace_rank{self.global_rank}.pt"))


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips_step_and_scheduler(tmp_path, stage):
    model = OverflowModule(str(tmp_path))
    kw = dict(unit_classes=["net.fc1", "net.fc2"], persist_numel=0) if stage == 3 else {}
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage, start_method="fork", **kw),
                      plugins=[ZeroPrecision("16-mixed", initial_scale_power=8, hysteresis=1)], max_steps=5,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    assert isinstance(trainer.precision_plugin, ZeroPrecision) and trainer.precision_plugin.precision == "16-mixed"
    trainer.fit(model)
    traces = [torch.load(p, weights_only=False) for p in sorted(glob.glob(str(tmp_path / "trace_rank*.pt")))]
    assert len(traces) == 2
    for trace in traces:
        epochs = [t["sched_epoch"] for t in trace]
        assert epochs == [1, 2, 2, 3, 4], epochs  # the skipped step did not advance the schedule
        torch.testing.assert_close(trace[OVERFLOW_STEP]["fc1"], trace[OVERFLOW_STEP - 1]["fc1"], rtol=0, atol=0)
        assert not torch.equal(trace[OVERFLOW_STEP + 1]["fc1"], trace[OVERFLOW_STEP]["fc1"])
        assert [t["skipped"] for t in trace] == [0, 0, 1, 1, 1]
        assert trace[OVERFLOW_STEP - 1]["loss_scale"] == 2.0**8 and trace[OVERFLOW_STEP]["loss_scale"] == 2.0**7
    for a, b in zip(*traces):  # every rank holds the same weights after every step
        torch.testing.assert_close(a["fc1"], b["fc1"], rtol=0, atol=0)


def test_trainer_bf16_mixed_becomes_zero_precision():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero1", precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ZeroPrecision)
    assert plugin.precision == "bf16-mixed"
    assert plugin.compute_dtype is torch.bfloat16
    assert plugin.mixed and plugin.check_finite and plugin.loss_scaler is None


def test_explicit_zero_precision_plugin_is_kept():
    mine = ZeroPrecision("16-mixed", loss_scale=128.0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero2_fork", plugins=[mine], logger=False)
    assert trainer.strategy.precision_plugin is mine
    assert mine.compute_dtype is torch.float16 and mine.loss_scale == 128.0


def test_unsupported_precision_plugin_names_allowed_values():
    with pytest.raises(ValueError, match=r"Allowed: precision='32-true', '16-mixed' or 'bf16-mixed'"):
        Trainer(accelerator="cpu", devices=2, strategy="zero2_fork", plugins=[HalfPrecision("bf16-true")], logger=False)
    with pytest.raises(ValueError, match=r"HalfPrecision"):
        Trainer(accelerator="cpu", devices=2, strategy="zero1_fork", precision="bf16-true", logger=False)


def test_zero_precision_rejects_unknown_precision():
    with pytest.raises(ValueError, match=r"Allowed: '32-true', '16-mixed', 'bf16-mixed'"):
        ZeroPrecision("64-true")


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_evaluation_leaves_the_model_fp32(stage):
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), precision="bf16-mixed",
                      logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)
    trainer.validate(model)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32, k
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
