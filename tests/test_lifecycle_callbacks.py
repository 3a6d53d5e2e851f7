"""Callbacks that read or write parameters outside the training step: equal to DDP, or refused at setup.

External-launcher ranks (tests/dist_utils.run_distributed + the strategy's default launcher), so the
after-fit ``save_checkpoint`` runs in the ranks that trained.
"""

from __future__ import annotations

import contextlib
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelSummary, StochasticWeightAveraging
from lightning.pytorch.utilities.model_summary import summarize

from lightning_zero import ZeroPrecision
from lightning_zero.checkpoint.consolidate import consolidate
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lifecycle_harness import LifecycleModule, make_strategy, trainer, whole_params
from tests.helpers.parity import close as _assert_close_dicts

RTOL = 1e-5
_REFS: dict = {}


class _BeforeAveraging(Callback):
    """Listed before the averaging callback: its on_train_end sees the weights the last step left."""

    def on_train_end(self, trainer, pl_module):
        self.weights = whole_params(pl_module, trainer.strategy)


def _averaged_fit(rank, world_size, name, out, kind, fmt, overlap=False):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    model, before = LifecycleModule(out), _BeforeAveraging()
    avg = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1) if kind == "swa" else EMAWeightAveraging()
    kw = {} if name == "ddp" else dict(checkpoint_format=fmt, **(dict(overlap_publish=True) if overlap else {}))
    t = trainer(make_strategy(name, **kw), world_size, -1, max_epochs=3, limit_train_batches=2, limit_val_batches=1,
                callbacks=[before, avg])
    t.fit(model)
    path = os.path.join(out, f"{name}_{kind}.ckpt")
    t.save_checkpoint(path)  # after fit: must hold the averaged weights, as DDP's does
    return {"final": whole_params(model, t.strategy), "before": before.weights, "path": path}


def _saved_weights(path: str) -> dict:
    """The weights of a checkpoint: a directory consolidated (here, outside the ranks), or Lightning's file."""
    if os.path.isdir(path):
        consolidate(path, path + ".pt")
        return torch.load(path + ".pt")
    return {k: v.float() for k, v in torch.load(path, weights_only=False)["state_dict"].items()}


CASES = [("zero0", "swa", "sharded"), ("zero1", "swa", "sharded"), ("zero2", "swa", "sharded"),
         ("zero2", "ema", "full")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,kind,fmt", CASES, ids=[f"{s}-{k}-{f}" for s, k, f in CASES])
def test_weight_averaging_at_stages_0_to_2_matches_ddp(tmp_path, stage, kind, fmt):
    if kind not in _REFS:
        _REFS[kind] = run_distributed(_averaged_fit, 2, "ddp", str(tmp_path), kind, fmt)
    zero = run_distributed(_averaged_fit, 2, stage, str(tmp_path), kind, fmt)
    for res in zero + _REFS[kind]:
        res.setdefault("saved", _saved_weights(res["path"]))
    for rank, (z, d) in enumerate(zip(zero, _REFS[kind])):
        _assert_close_dicts(z["final"], d["final"], f"{stage} {kind} rank {rank} final")
        _assert_close_dicts(z["saved"], d["saved"], f"{stage} {kind} rank {rank} after-fit checkpoint")
        _assert_close_dicts(z["saved"], z["final"], f"{stage} {kind} rank {rank} checkpoint vs module")
        # the averaging did something (else this test could not tell it from a silent no-op)
        assert any(not torch.allclose(d["final"][k], d["before"][k]) for k in d["final"])


@pytest.mark.timeout(120)
def test_weight_averaging_with_overlapped_publish_matches_ddp(tmp_path):
    """overlap_publish=True with EMAWeightAveraging (it reads the weights in on_train_batch_end): the strategy
    sees a weight reader and completes each step's all-gather before the hooks, so the average equals DDP's
    (without that, the EMA would average other ranks' slices one step old)."""
    if "ema" not in _REFS:
        _REFS["ema"] = run_distributed(_averaged_fit, 2, "ddp", str(tmp_path), "ema", "full")
    zero = run_distributed(_averaged_fit, 2, "zero2", str(tmp_path), "ema", "full", True)
    for rank, (z, d) in enumerate(zip(zero, _REFS["ema"])):
        _assert_close_dicts(z["final"], d["final"], f"overlap ema rank {rank} final")


class _CountsWaits(LifecycleModule):
    # ParityModule's bookkeeping hooks would count as possible weight readers: the plain ones here
    on_train_batch_start = pl.LightningModule.on_train_batch_start
    on_train_batch_end = pl.LightningModule.on_train_batch_end

    def on_train_end(self):  # not a hook between steps: reading the counter here changes nothing
        engine = getattr(self.trainer.strategy, "engine", None)  # DDP (the reference) has none
        self.waits = engine.publisher.unpacked_in_forward if engine is not None else None


class _ReadsWeights(_CountsWaits):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.weight_sum = float(next(self.parameters()).sum())


def _overlap_kept(rank, world_size, out, module_reads):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    runs = {}
    for name, kw in (("ddp", {}), ("zero2", dict(overlap_publish=True))):
        model = _ReadsWeights(out) if module_reads else _CountsWaits(out)
        t = trainer(make_strategy(name, **kw), world_size, 3, enable_progress_bar=True,
                    enable_checkpointing=True, default_root_dir=out)  # Lightning's own callbacks: no readers
        t.fit(model)
        runs[name] = (getattr(t.strategy.precision_plugin, "ensure_published_after_step", None), model.waits,
                      whole_params(model, t.strategy))
    return runs


@pytest.mark.timeout(120)
def test_overlap_is_kept_unless_something_reads_the_weights(tmp_path):
    """With Lightning's bookkeeping callbacks only, the buckets are still unpacked inside the next forward; a
    module that overrides on_train_batch_end makes each step complete them first. Both equal DDP."""
    for module_reads in (False, True):
        for rank, runs in enumerate(run_distributed(_overlap_kept, 2, str(tmp_path / str(module_reads)), module_reads)):
            ensure, waits, weights = runs["zero2"]
            assert ensure is module_reads
            assert (waits > 0) is (not module_reads), (module_reads, waits)
            # either way the run equals DDP's (the overlapped all-gather lands before anything reads it)
            _assert_close_dicts(weights, runs["ddp"][2], f"overlap reads={module_reads} rank {rank}")


def _refused(rank, world_size, name, kind, kw, precision):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    avg = StochasticWeightAveraging(swa_lrs=0.01) if kind == "swa" else EMAWeightAveraging()
    plugins = [ZeroPrecision(precision)] if precision else []
    t = trainer(make_strategy(name, **kw), world_size, 2, callbacks=[avg], plugins=plugins)
    with pytest.raises(ValueError, match=r"is not supported by ZeroStrategy.*Supported: StochasticWeightAveraging"
                                         r".*gathered_params"):
        t.fit(LifecycleModule("unused"))
    return True


REFUSED = [("zero3", "swa", {}, None), ("zero3_offload", "ema", dict(checkpoint_format="full"), None),
           ("zero2", "swa", {}, "bf16-mixed"), ("zero1", "ema", {}, None)]


@pytest.mark.timeout(60)
def test_weight_averaging_that_cannot_be_exact_is_refused_at_setup():
    for name, kind, kw, precision in REFUSED:  # stage 3 silently averaged nothing before
        assert all(run_distributed(_refused, 2, name, kind, kw, precision)), (name, kind)


# -- ModelSummary and checkpoint hooks under stage 3 ------------------------------------------------------------------
class _Summary(Callback):
    def on_fit_start(self, trainer, pl_module):
        s = summarize(pl_module, max_depth=2)
        self.numbers = (s.total_parameters, s.trainable_parameters, s.param_nums)


class _Hooked(LifecycleModule):
    """Reads a parameter in on_save_checkpoint (inside gathered_params, as stage 3 requires)."""

    def on_save_checkpoint(self, checkpoint):
        gathered = getattr(self.trainer.strategy, "gathered_params", contextlib.nullcontext)
        with gathered():
            checkpoint["fc1_sum"] = self.net.fc1.weight.sum().item()

    def on_load_checkpoint(self, checkpoint):
        self.loaded_sum = checkpoint["fc1_sum"]


def _summary_and_hooks(rank, world_size, name, out):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    summary = _Summary()
    t = trainer(make_strategy(name), world_size, 2, callbacks=[summary, ModelSummary(max_depth=2)],
                enable_model_summary=True)
    t.fit(_Hooked(out))
    path = os.path.join(out, f"{name}.ckpt")
    t.save_checkpoint(path)
    resumed = _Hooked(out, seed=3)
    trainer(make_strategy(name), world_size, 3).fit(resumed, ckpt_path=path)
    return summary.numbers, resumed.loaded_sum


@pytest.mark.timeout(60)
def test_model_summary_and_checkpoint_hooks_under_stage3_match_ddp(tmp_path):
    ddp = run_distributed(_summary_and_hooks, 2, "ddp", str(tmp_path))
    zero = run_distributed(_summary_and_hooks, 2, "zero3", str(tmp_path))
    for (zs, zsum), (ds, dsum) in zip(zero, ddp):
        assert zs == ds and zs[0] > 0
        assert zsum == pytest.approx(dsum, rel=RTOL)
