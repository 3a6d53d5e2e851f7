"""ZeroPipelineStrategy(pipeline_parallel_size=2) under the Trainer: validate / test / predict (inside and outside
fit), bf16 and fp16, the interleaved schedule, and the consolidate CLI on a pipeline checkpoint.

References: the uncut GPT-2 in this process (tests/test_pipeline_lightning.py's ``_reference``: the same
batches, micro-batch cut, accumulation, clipping and LR schedule) at rtol 1e-5 in fp32; for bf16 the uncut
model trained by a single-process ZeroEngine in bf16 with the same cut. Every rank writes what it saw
(metrics, predictions) so agreement across ranks is checked, not only rank 0's copy the launcher returns.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroPipelineStrategy, ZeroPrecision, ZeroStrategy
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.pipeline.split import split_gpt2
from lightning_zero.tools.cli import main as cli
from tests.helpers.pipeline_gpt2 import (ACCUM, ATOL, BATCH, CLIP, M, RTOL, global_batch as _batch, lm_loss as _loss,
    gpt2_model as _model, adamw as _optimizer)
from tests.helpers.pipeline_lightning import (BATCHES, VAL, PipeGPT2, SaveAtEpochEnd, check_pipeline_fit as _check,
    lr_lambda as _lr_lambda, trainer_reference as _reference)

PRED_ROWS = 4  # predict batches of 4 rows: two per replica at P2 x DP1


class EvalGPT2(PipeGPT2):
    """PipeGPT2 with test / predict data; each rank dumps its callback_metrics and predictions."""

    def __init__(self, *args, poison: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.preds: list = []
        self.poison, self._poisoned = poison, False
        self.snapshots: dict = {}

    def configure_model(self):
        super().configure_model()
        if self.poison and self.trainer.strategy.pipeline_stage_index == 0:  # an inf in stage 0's gradient only
            next(self.stage.parameters()).register_hook(lambda g: g * float("inf") if self._poisoned else g)

    def test_step(self, batch, batch_idx):
        raise AssertionError("the pipeline strategy runs the forward pipeline instead")

    def predict_step(self, batch, batch_idx):
        raise AssertionError("the pipeline strategy runs the forward pipeline instead")

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        return DataLoader([row for row in _batch(VAL)], batch_size=PRED_ROWS, shuffle=False)

    def _dump(self, what, value):
        torch.save(value, os.path.join(self.out, f"{self.tag}{what}_rank{self.global_rank}.pt"))

    def on_validation_end(self):
        if self.trainer.state.fn == "validate":
            self._dump("validate", {k: float(v) for k, v in self.trainer.callback_metrics.items()})

    def on_test_end(self):
        self._dump("test", {k: float(v) for k, v in self.trainer.callback_metrics.items()})

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.preds.append(outputs)

    def on_predict_end(self):
        self._dump("predict", self.preds)

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self._poisoned = self.poison and batch_idx < ACCUM  # the first optimizer step overflows

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.poison:
            prec = self.trainer.strategy.precision_plugin
            self.snapshots[batch_idx] = ({k: v.float().clone() for k, v in self.stage.state_dict().items()},
                                         prec.skipped_steps, prec.loss_scale)

    def on_train_end(self):
        super().on_train_end()
        if self.poison:
            self._dump("snapshots", self.snapshots)


class InterleavedGPT2(EvalGPT2):
    """Two chunks per rank: stages p and p + 2 of 4, one GPT-2 block each."""

    def configure_model(self):
        if self.stage is None:
            s, whole = self.trainer.strategy, _model()
            self.pipeline_stages = nn.ModuleList([split_gpt2(whole, s.pipeline_virtual_stages, i)
                                                  for i in s.pipeline_stage_indices])
            self.stage = self.pipeline_stages[0]


def _trainer(devices=2, precision=None, schedule="1f1b", stage=1, plugins=(), **kw):
    strategy = ZeroPipelineStrategy(stage=stage, start_method="fork", bucket_mb=0.01, pipeline_parallel_size=2,
                                    pipeline_microbatches=M, pipeline_schedule=schedule)
    extra = dict(precision=precision) if precision is not None else {}
    return Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1, limit_test_batches=1,
                   plugins=list(plugins), **extra, **kw)


def _fit_trainer(epochs=1, **kw):
    return _trainer(max_epochs=epochs, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP,
                    num_sanity_val_steps=1, **kw)


def _load(out, tag, what, devices=2):
    return [torch.load(os.path.join(out, f"{tag}{what}_rank{r}.pt"), weights_only=False) for r in range(devices)]


def _uncut(state_dict=None):
    model = _model().eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    with torch.no_grad():
        logits = model(_batch(VAL)).logits
    return logits, _loss(logits, _batch(VAL)).item()


@pytest.mark.timeout(120)
def test_validate_test_predict_without_fit_equal_the_uncut_model(tmp_path):
    ref_logits, ref_loss = _uncut()
    model, trainer = EvalGPT2(str(tmp_path), "n_"), _trainer()
    trainer.validate(model)
    trainer.test(model)
    trainer.predict(model)  # (the fork launcher returns no predictions to the main process: Lightning's rule)
    for r, (val, test) in enumerate(zip(_load(tmp_path, "n_", "validate"), _load(tmp_path, "n_", "test"))):
        assert val["val_loss"] == pytest.approx(ref_loss, rel=RTOL), r  # every rank: the last stage's value
        assert test["test_loss"] == pytest.approx(ref_loss, rel=RTOL), r
    for r, preds in enumerate(_load(tmp_path, "n_", "predict")):  # both stages: the last stage's outputs
        assert [p.shape for p in preds] == [(PRED_ROWS, *ref_logits.shape[1:])] * (BATCH // PRED_ROWS), r
        assert torch.allclose(torch.cat(preds), ref_logits, rtol=RTOL, atol=ATOL), r


@pytest.mark.timeout(120)
def test_validate_predict_at_p2_dp2_split_the_data_by_replica(tmp_path):
    ref_logits, ref_loss = _uncut()
    model, trainer = EvalGPT2(str(tmp_path), "d_"), _trainer(devices=4)
    trainer.validate(model)
    trainer.predict(model)
    for r, val in enumerate(_load(tmp_path, "d_", "validate", devices=4)):  # the mean over both replicas
        assert val["val_loss"] == pytest.approx(ref_loss, rel=RTOL), r
    for r, preds in enumerate(_load(tmp_path, "d_", "predict", devices=4)):  # rank r: stage r // 2, replica r % 2
        assert len(preds) == 1 and torch.allclose(preds[0], ref_logits[r % 2::2], rtol=RTOL, atol=ATOL), r


@pytest.mark.timeout(150)
def test_validate_from_a_fit_checkpoint_and_consolidate_cli(tmp_path):
    ckpt = tmp_path / "epoch0.ckpt"
    model, trainer = EvalGPT2(str(tmp_path), "f_"), _fit_trainer(callbacks=[SaveAtEpochEnd(str(ckpt))])
    trainer.fit(model)
    seen = torch.load(tmp_path / "f_rank0.pt")["batches"]
    ref_losses, ref_val, ref_sd = _reference(seen)
    # `lightning-zero consolidate` on the pipeline directory: the uncut model's own state dict
    assert cli(["consolidate", str(ckpt), str(tmp_path / "full.pt"), "--quiet"]) == 0
    full = torch.load(tmp_path / "full.pt")
    assert set(full) == set(ref_sd)
    bad = [k for k in ref_sd if not torch.allclose(full[k], ref_sd[k], rtol=RTOL, atol=ATOL)]
    assert not bad, bad
    _model().load_state_dict(full, strict=True)
    assert cli(["consolidate", str(ckpt), str(tmp_path / "full.pt"), "--lightning"]) == 2  # one clear refusal
    # the fork launcher's workers held the trained stages, this process's module none: one clear error ...
    with pytest.raises(Exception, match="trained by trainer.fit in worker processes.*Allowed: pass ckpt_path="):
        trainer.validate(model)
    # ... and validate after fit from its checkpoint: the trained weights' loss on every rank
    trainer.validate(model, ckpt_path=str(ckpt))
    _, trained_loss = _uncut(ref_sd)
    assert trained_loss == pytest.approx(ref_val[-1], rel=RTOL)
    for r, val in enumerate(_load(tmp_path, "f_", "validate")):
        assert val["val_loss"] == pytest.approx(trained_loss, rel=RTOL), r


# bf16 compares with SGD: Adam's first steps move every weight by about lr * sign(gradient), so a weight
# whose true gradient is below bf16's rounding noise moves by +-lr depending on summation order alone
BF16_RTOL, BF16_ATOL = 1e-2, 1e-5


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class SGDGPT2(EvalGPT2):
    def configure_optimizers(self):
        opt = _sgd(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda),
                                                   "interval": "step"}}


def _bf16_reference(batches):
    """The uncut model on a single-process ZeroEngine in bf16 (fp32 masters): the same cut and schedule."""
    from lightning_zero.lightning.precision import _cast_inputs_to_param_dtype

    model = _model()
    opt = _sgd(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2, bucket_mb=0.01), compute_dtype=torch.bfloat16,
                        check_finite=True)
    _cast_inputs_to_param_dtype(model)
    losses = []
    for call, ids in enumerate(batches):
        chunks, total = ids.chunk(M), 0.0
        for k, chunk in enumerate(chunks):
            boundary = call % ACCUM == ACCUM - 1 and k == len(chunks) - 1
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(model(chunk).logits, chunk).float()
            with engine.no_sync() if not boundary else contextlib.nullcontext():
                (loss / (len(chunks) * ACCUM)).backward()
            total += loss.item() / len(chunks)
        losses.append(total)
        if call % ACCUM == ACCUM - 1:
            engine.clip_grad_norm_(CLIP)
            assert engine.step()
            sched.step()
    names = engine.param_names()
    return losses, dict(zip(names, (t.clone() for t in engine.full_master_params())))


@pytest.mark.timeout(120)
def test_bf16_p2_equals_the_single_stage_bf16_reference(tmp_path):
    results = [torch.load(p) for p in _fit_run(tmp_path, "h_", precision="bf16-mixed", stage=2,
                                                module_cls=SGDGPT2)]
    ref_losses, ref_sd = _bf16_reference(results[0]["batches"])
    merged = {}
    for r, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-4), r
        merged.update(res["named"])
    worst = max(((merged[k] - v).abs().max() / v.abs().max()).item() for k, v in ref_sd.items())
    print(f"bf16 P2 vs single-stage bf16: worst weight difference {worst:.2e} of the tensor's largest entry")
    for k, v in ref_sd.items():  # the fp32 masters, within bf16 rounding of the gradients
        assert torch.allclose(merged[k], v, rtol=BF16_RTOL, atol=BF16_ATOL), (k, (merged[k] - v).abs().max().item())
    assert all(res["step"] == BATCHES // ACCUM for res in results)


def _fit_run(out, tag, **kw):
    module_cls = kw.pop("module_cls", EvalGPT2)
    kw_module = kw.pop("module_kw", {})
    _fit_trainer(**kw).fit(module_cls(str(out), tag, **kw_module))
    return [os.path.join(out, f"{tag}rank{r}.pt") for r in range(2)]


@pytest.mark.timeout(120)
def test_fp16_overflow_on_one_stage_skips_the_step_on_both(tmp_path):
    plugin = ZeroPrecision("16-mixed", initial_scale_power=8, hysteresis=1)
    _fit_run(tmp_path, "o_", plugins=[plugin], stage=2, module_kw=dict(poison=True))
    runs = [torch.load(p) for p in (os.path.join(tmp_path, f"o_rank{r}.pt") for r in range(2))]
    for r, snap in enumerate(_load(tmp_path, "o_", "snapshots")):
        start, skipped, scale = snap[0]  # the fp16 module before any optimizer step
        assert skipped == 0 and scale == 2.0**8, (r, skipped, scale)
        after_skip, skipped, scale = snap[ACCUM - 1]
        assert skipped == 1 and scale == 2.0**7, (r, skipped, scale)  # stage 1's gradients were finite
        assert all(torch.equal(after_skip[k], v) for k, v in start.items()), r  # no update on either stage
        moved, skipped, _ = snap[BATCHES - 1]
        assert skipped == 1 and not all(torch.equal(moved[k], v) for k, v in start.items()), r
    assert runs[0]["lr"] == runs[1]["lr"] == pytest.approx(1e-3 * _lr_lambda(1))  # the skip did not advance it


@pytest.mark.timeout(120)
def test_interleaved_under_the_trainer_equals_the_reference(tmp_path):
    ckpt = tmp_path / "interleaved.ckpt"
    results = [torch.load(p) for p in _fit_run(tmp_path, "i_", schedule="interleaved", module_cls=InterleavedGPT2,
                                                callbacks=[SaveAtEpochEnd(str(ckpt))])]
    ref_losses, ref_val, ref_sd = _reference(results[0]["batches"])
    _check(results, ref_losses, ref_val, ref_sd, "interleaved, zero1")  # = 1F1B's (same reference)
    # four stage directories (two chunks on each of two ranks) consolidate into the uncut model's state dict
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("stage")) == [f"stage{i}" for i in range(4)]
    assert cli(["consolidate", str(ckpt), str(tmp_path / "full.safetensors"), "--quiet"]) == 0
    from safetensors.torch import load_file

    full = load_file(str(tmp_path / "full.safetensors"))
    assert set(full) == set(ref_sd)
    assert all(torch.allclose(full[k], ref_sd[k], rtol=RTOL, atol=ATOL) for k in ref_sd)


def test_estimate_reports_per_stage_memory(capsys):
    from lightning_zero.tools.estimate_pipeline import estimate_pipeline

    whole = _model()
    numels = [sum(p.numel() for p in split_gpt2(whole, 2, i).parameters()) for i in range(2)]
    est = estimate_pipeline(whole, 4, 2)  # P2 x DP2, fp32 AdamW (K = 8): ZeRO's per-rank floors, per stage
    assert [r.numel for r in est.rows] == numels and "GPT-2 blocks" in est.split
    for r, n in zip(est.rows, numels):  # fp32: 4 (param) + 4 (grad) + 8 (state) bytes, sharded over D = 2
        assert [r.zero[z]["device"] for z in (0, 1, 2)] == [16 * n, (4 + 4 + 8 / 2) * n, (4 + (4 + 8) / 2) * n]
    mixed = estimate_pipeline(10**6, 8, 2, precision="bf16-mixed", stage_params=[400_000, 600_000])
    assert mixed.worst(2) == (2 + (2 + 12) / 4) * 600_000  # the largest stage decides
    assert cli(["estimate", "--module", "tests.test_pipeline:_model", "--ranks", "4", "--pipeline-parallel-size",
                "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert f"| 0 | {numels[0]:,} |" in out and f"| 1 | {numels[1]:,} |" in out
    assert "(P - 1) / (M + P - 1) = 0.20" in out
    assert cli(["estimate", "--params", "1M", "--ranks", "4", "--pipeline-parallel-size", "2",
                "--stage-params", "1M"]) == 2
    assert "do not give 2 positive parameter counts" in capsys.readouterr().err
