"""Stage-3 evaluation with rank-dependent work ([Note: evaluation join]): ranks with fewer batches serve the
others' gathers, so uneven evaluation completes as under DDP; any other divergence fails fast everywhere."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import RankDivergenceError, ZeroStrategy
from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import batch, make_model, make_optimizer

UNITS = ["fc1", "fc2", "frozen", "unused"]


def _uneven_eval(rank, world_size, trained: bool):
    """Rank r runs r+1 eval forwards (rank 0 none at all when world_size > 2), then joins; the outputs
    must equal the plain model's, and training afterwards must still work on every rank."""
    torch.manual_seed(0)
    model = make_model()
    reference = make_model()
    opt = make_optimizer(model, "adamw") if trained else None
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0))
    if trained:  # one step first: the training order is recorded and verified, then eval differs from it
        model(batch(0, rank)).sum().backward()
        engine.step()
    model.eval()
    n = rank + 1 if world_size == 2 else rank  # at 4 ranks rank 0 has no batch at all
    outs = []
    with torch.no_grad():
        for i in range(n):
            engine.prepare_forward()
            outs.append(model(batch(10 + i, rank)))
    served = engine.join()
    if not trained:
        for i, out in enumerate(outs):
            torch.testing.assert_close(out, reference(batch(10 + i, rank)), rtol=1e-6, atol=1e-6)
    held = engine.partitioner.gathered_bytes()
    model.train()
    loss = model(batch(1, rank)).sum()  # the next training step: every rank gathers again in step
    if trained:
        loss.backward()
        engine.step()
    return {"served": served, "held_after_join": held, "n": n}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,trained", [(2, False), (2, True), (4, False)])
def test_uneven_evaluation_completes_and_is_exact(world_size, trained):
    res = run_distributed(_uneven_eval, world_size, trained)
    most = max(r["n"] for r in res)
    for r in res:
        assert r["held_after_join"] == 0  # every rank leaves with only its shards
        # a rank that finished early served every gather of the forwards it did not run
        assert (r["served"] > 0) == (r["n"] < most)


def _skip_a_unit(rank, world_size):
    torch.manual_seed(0)
    model = make_model()
    engine = ZeroEngine(model, None, ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0))
    model.eval()
    try:
        with torch.no_grad():
            engine.prepare_forward()
            h = model.emb(batch(0, rank))
            if rank == 0:  # a data-dependent skipped block: rank 0 runs 'frozen', rank 1 goes on to 'fc1'
                h = model.frozen(h)
            model.fc1(h)
    except RankDivergenceError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_divergent_evaluation_raises_on_every_rank_fast():
    msgs = run_distributed(_skip_a_unit, 2)
    for m in msgs:
        assert m is not None and "diverged" in m and "frozen" in m and "fc1" in m


def _join_is_one_tiny_collective_when_even(rank, world_size):
    from lightning_zero.engine.comm import collectives

    model = make_model()
    engine = ZeroEngine(model, None, ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0))
    model.eval()
    with torch.no_grad():
        engine.prepare_forward()
        model(batch(0, rank))
    before = collectives.stats.total_calls
    served = engine.join()
    return served, collectives.stats.total_calls - before


@pytest.mark.timeout(60)
def test_even_evaluation_joins_in_one_round():
    for served, calls in run_distributed(_join_is_one_tiny_collective_when_even, 2):
        assert served == 0 and calls == 1


# -- under a Trainer ------------------------------------------------------------------------------------------
class _Net(LightningModule):
    """Validation data of a different length on each rank (no distributed sampler), predict over 5 samples
    (Lightning's predict sampler does not pad: 3 batches on rank 0, 2 on rank 1)."""

    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.out, self.tag, self.preds = out, tag, []
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), on_epoch=True, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        self.preds.append(self(batch[0]))

    def on_predict_end(self) -> None:  # fork launchers return no predictions to the parent
        torch.save(torch.cat(self.preds), os.path.join(self.out, f"{self.tag}_rank{self.global_rank}.pt"))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def _data(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 4, generator=g)
        return TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self._data(16, 0), batch_size=4)

    def val_dataloader(self):
        rank = self.trainer.global_rank
        return DataLoader(self._data(2 + 3 * rank, 1 + rank), batch_size=1)  # rank 0: 2 batches, rank 1: 5

    def predict_dataloader(self):
        return DataLoader(self._data(5, 9), batch_size=1)


@pytest.mark.timeout(180)
def test_trainer_uneven_validation_and_predict_equal_ddp(tmp_path):
    results = {}
    kw = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False)
    def zero3():
        return ZeroStrategy(stage=3, unit_classes=["Linear"], persist_numel=0, start_method="fork")

    for name, make in (("ddp", lambda: "ddp_fork"), ("zero3", zero3)):
        model = _Net(str(tmp_path), name)
        trainer = Trainer(strategy=make(), max_steps=2, use_distributed_sampler=False, num_sanity_val_steps=0, **kw)
        trainer.fit(model)
        val = trainer.validate(model, verbose=False)[0]["val_loss"]
        Trainer(strategy=make(), **kw).predict(model)  # the default (unpadded) predict sampler
        results[name] = (val, [torch.load(tmp_path / f"{name}_rank{r}.pt") for r in range(2)])
    torch.testing.assert_close(torch.tensor(results["zero3"][0]), torch.tensor(results["ddp"][0]), rtol=1e-5, atol=1e-6)
    for r, rows in enumerate((3, 2)):  # 5 samples: 3 on rank 0, 2 on rank 1
        assert results["zero3"][1][r].shape == results["ddp"][1][r].shape == (rows, 1)
        torch.testing.assert_close(results["zero3"][1][r], results["ddp"][1][r], rtol=1e-5, atol=1e-6)
