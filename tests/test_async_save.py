"""Asynchronous checkpoint saves through the Trainer ([Note: asynchronous checkpoint saves]): the run is the
synchronous run (losses, weights), every checkpoint it leaves is the synchronous one bit for bit, a resume from
one equals the uninterrupted run, ModelCheckpoint's top-k and ``last`` see only complete directories."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy
from lightning_zero import checkpoint as ck
from tests.helpers.ckpt_files import assert_same_checkpoint
from tests.helpers.ckpt_models import TiedParityModule
from tests.helpers.lightning_models import load_rank_files, trainer_kwargs

pytestmark = pytest.mark.timeout(300)
FIT = dict(max_steps=6, limit_train_batches=3, enable_checkpointing=True)  # 2 epochs of 3 steps


def _strategy(stage, async_save: bool) -> ZeroStrategy:
    offload = dict(offload_optimizer=True, offload_params=True) if stage == "3_offload" else {}
    return ZeroStrategy(stage=3 if stage == "3_offload" else stage, start_method="fork", async_save=async_save,
                        **offload)


def _fit(out, tag, strategy, ckpt_path=None, callbacks=()):
    Trainer(strategy=strategy, callbacks=list(callbacks), **trainer_kwargs(devices=2, **FIT)).fit(
        TiedParityModule(out, tag=tag), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return load_rank_files(out, tag, "train", 2)


def _same_run(got, want, what, resumed_at: int = 0):
    for r, (a, b) in enumerate(zip(got, want)):
        assert a["global_step"] == b["global_step"], what
        torch.testing.assert_close(a["losses"], b["losses"][resumed_at:], rtol=0, atol=0,
                                   msg=lambda m: f"{what} rank {r}: {m}")
        for k in b["params"]:
            torch.testing.assert_close(a["params"][k], b["params"][k], rtol=0, atol=0,
                                       msg=lambda m: f"{what} rank {r} {k}: {m}")


@pytest.mark.parametrize("stage", [1, 2, 3, "3_offload"])
def test_async_saves_equal_sync_saves_and_resume_exactly(tmp_path, stage):
    out = str(tmp_path)

    def callbacks(kind):
        return [ModelCheckpoint(dirpath=tmp_path / kind, filename="{step}", save_top_k=-1, every_n_train_steps=1)]

    sync = _fit(out, "sync_", _strategy(stage, False), callbacks=callbacks("sync"))
    run = _fit(out, "async_", _strategy(stage, True), callbacks=callbacks("async"))
    _same_run(run, sync, "the run with background saves vs the synchronous run")
    names = sorted(os.listdir(tmp_path / "sync"))
    assert names == [f"step={s}.ckpt" for s in range(1, 7)]
    assert sorted(os.listdir(tmp_path / "async")) == names, "every save complete, nothing else left"
    for n in names:  # saved while the next steps already ran: the state of the step it was taken at
        assert_same_checkpoint(tmp_path / "async" / n, tmp_path / "sync" / n)
    # step 3 is epoch 0's last batch: Lightning resumes exactly from there (inside an epoch it restarts the
    # epoch's data, under any strategy)
    resumed = _fit(out, "resumed_", _strategy(stage, True), ckpt_path=tmp_path / "async" / "step=3.ckpt")
    _same_run(resumed, sync, "resumed from a background save at step 3", resumed_at=3)


class _Records(Callback):
    """Each rank's writer records (the ranks are forked: the test reads them from files)."""

    def on_train_end(self, trainer, pl_module):
        records = trainer.strategy.checkpoints.saver.records
        torch.save([(os.path.basename(r.path), r.staged_s) for r in records],
                   os.path.join(pl_module.out, f"records_rank{trainer.global_rank}.pt"))


def test_topk_and_last_see_only_complete_checkpoints(tmp_path):
    """save_top_k=1 removes the older checkpoint only after the newer one is complete; ``last`` (a copy and a
    link) names a complete directory at the end; the saves' records show what training waited for."""
    out = str(tmp_path)
    strategy = _strategy(2, True)
    top = ModelCheckpoint(dirpath=tmp_path / "top", filename="{step}", monitor="step", mode="max", save_top_k=1,
                          save_last=True, every_n_train_steps=1)
    link = ModelCheckpoint(dirpath=tmp_path / "link", filename="{step}", monitor="step", mode="max", save_top_k=1,
                           save_last="link", every_n_train_steps=2)
    _fit(out, "top_", strategy, callbacks=[top, link, _Records()])
    assert sorted(os.listdir(tmp_path / "top")) == ["last.ckpt", "step=6.ckpt"]
    assert sorted(os.listdir(tmp_path / "link")) == ["last.ckpt", "step=6.ckpt"]
    assert os.readlink(tmp_path / "link" / "last.ckpt") == "step=6.ckpt"
    for d in ("top/last.ckpt", "top/step=6.ckpt", "link/step=6.ckpt"):
        assert ck.read_meta(tmp_path / d, trust_checkpoint=True)["global_step"] == 6
    # teardown's one line on rank 0: ModelCheckpoint "top" saved 6 + 6 (last), "link" 3 times
    # each rank's saves as its writer recorded them: "top" saved 6 + 6 (last), "link" 3 times, every one staged
    for r in range(2):
        records = torch.load(tmp_path / f"records_rank{r}.pt")
        assert len(records) == 15 and all(staged > 0 for _, staged in records)
        assert sum(name == "last.ckpt" for name, _ in records) == 6


def test_async_save_knob_is_checked():
    with pytest.raises(ValueError, match="async_save must be True or False; got 1"):
        ZeroStrategy(stage=2, async_save=1)
    with pytest.raises(ValueError, match="checkpoint_format='full'.*AsyncCheckpointIO"):
        ZeroStrategy(stage=2, async_save=True, checkpoint_format="full")
