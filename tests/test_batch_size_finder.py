"""Batch-size search under ZeroStrategy (lightning_zero.ZeroBatchSizeFinder, `lightning-zero tune --module`),
measured activations in `lightning-zero estimate --module`, and Lightning's own finder pointing to ours.

The finder's answer is checked against a brute-force measurement of the same rule (tools/tuning/step_bytes.py)
by the bare-engine harness the tuner uses (tools/tuning/harness.py ``Trial.probe``): an independent path that
steps the engine without Lightning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroBatchSizeFinder
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.config import PRESETS
from lightning_zero.tools.launch import run_ranks
from tests.batch_size_models import SEQ, GPT2Module, MLPModule, gpt2_loss, mlp_loss
from tests.lightning_models import trainer_kwargs
from tests.zoo_models import VOCAB

ROOT = Path(__file__).resolve().parents[1]


def _brute_force(rank, world, kind, preset, sizes):
    """The step bytes at each size: a fresh engine over the module's net, stepped by the harness."""
    import argparse

    from lightning_zero.tools.tuning.harness import Runner, Trial

    def build():
        module = GPT2Module() if kind == "gpt2" else MLPModule()
        net = module.net
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)  # as configure_optimizers
        return Runner("zero", net, net, opt, ZeroEngine(net, opt, ZeroConfig(**PRESETS[preset])))

    def batch(r, step, b, device):
        g = torch.Generator().manual_seed(1000 * step + r)
        if kind == "gpt2":
            return torch.randint(0, VOCAB, (b, SEQ), generator=g)
        return torch.randn(b, 32, generator=g), torch.randint(0, 10, (b,), generator=g)

    args = argparse.Namespace(budget_bytes=2**62, accumulate=1)
    trial = Trial(preset, args, rank, torch.device("cpu"), build, batch,
                  loss_fn=gpt2_loss if kind == "gpt2" else mlp_loss)
    return {b: trial.probe(b, i + 1)[1] for i, b in enumerate(sizes)}


def _find(rank, world, kind, preset, cap, root, mode="binsearch"):
    module = GPT2Module() if kind == "gpt2" else MLPModule()
    finder = ZeroBatchSizeFinder(max_bytes=cap, mode=mode, steps_per_trial=2, init_val=2, max_trials=25)
    trainer = lightning_trainer(preset, world, root, finder, max_steps=1)
    trainer.fit(module)
    size = module.hparams.batch_size if kind == "gpt2" else module.batch_size
    return finder.optimal_batch_size, finder.trials, size, trainer.train_dataloader.batch_size


def lightning_trainer(strategy, devices, root, *callbacks, max_steps=3):
    from lightning.pytorch import Trainer

    return Trainer(strategy=strategy, callbacks=list(callbacks), default_root_dir=root,
                   **trainer_kwargs(devices=devices, max_steps=max_steps))


CASES = [("gpt2", "zero2", 1), ("gpt2", "zero3", 2), ("mlp", "zero2", 2), ("mlp", "zero3", 1)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,preset,world", CASES, ids=[f"{k}-{p}-{w}r" for k, p, w in CASES])
def test_answer_is_the_largest_size_within_the_cap(tmp_path, kind, preset, world):
    sizes = list(range(1, 17))
    brute = run_ranks(_brute_force, world, (kind, preset, sizes), timeout_s=240)[0]
    assert all(brute[a] < brute[b] for a, b in zip(sizes, sizes[1:])), brute  # grows with the batch
    cap = (brute[9] + brute[10]) // 2  # between two sizes: the rule's answer is 9
    expected = max(b for b in sizes if brute[b] <= cap)
    assert expected == 9
    found, trials, attr, loader = run_ranks(_find, world, (kind, preset, cap, str(tmp_path)), timeout_s=240)[0]
    assert found == expected and attr == expected and loader == expected
    # what the finder measured through the Trainer is what the engine alone holds at those sizes
    for b, fits, peak in trials:
        assert peak == pytest.approx(brute[b], rel=1e-3), (b, peak, brute[b])
        assert fits == (brute[b] <= cap)
    assert [b for b, _, _ in trials][:4] == [2, 4, 8, 16]  # doubling from init_val, then the bisection


def _fit_files(strategy, devices, root, batch_size, finder=None):
    from lightning.pytorch import Trainer

    os.makedirs(root, exist_ok=True)
    module = GPT2Module(batch_size=batch_size)
    module.out = root
    cbs = [finder] if finder is not None else []
    Trainer(strategy=strategy, callbacks=cbs, default_root_dir=root,
            **trainer_kwargs(devices=devices, max_steps=3)).fit(module)
    return [torch.load(os.path.join(root, f"rank{r}.pt")) for r in range(devices)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["zero2", "zero3"])
def test_fit_after_the_finder_equals_ddp_at_the_found_size(tmp_path, preset):
    """Lightning's fork launcher, 2 ranks: the finder's trials leave no trace (weights, AdamW state, loops
    restored), so the fit equals Lightning DDP started at the found batch size."""
    from lightning.pytorch.strategies import DDPStrategy

    cap = 1_500_000
    ours = _fit_files(f"{preset}_fork", 2, str(tmp_path / "zero"), 2,
                      ZeroBatchSizeFinder(max_bytes=cap, steps_per_trial=2, init_val=2))
    found = ours[0]["batch_size"]
    assert 2 < found < 64 and all(r["batch_size"] == found for r in ours)
    ref = _fit_files(DDPStrategy(start_method="fork"), 2, str(tmp_path / "ddp"), found)
    for z, d in zip(ours, ref):
        assert z["global_step"] == d["global_step"] == 3
        torch.testing.assert_close(torch.tensor(z["losses"][-3:]), torch.tensor(d["losses"]), rtol=1e-5, atol=1e-6)
        assert z["params"].keys() == d["params"].keys()
        for k in d["params"]:
            torch.testing.assert_close(z["params"][k], d["params"][k], rtol=1e-5, atol=1e-6, msg=k)


def _datamodule_find(rank, world, root):
    from tests.batch_size_models import mlp_with_datamodule

    module, data = mlp_with_datamodule()
    finder = ZeroBatchSizeFinder(max_bytes=900_000, mode="power", steps_per_trial=1, init_val=4)
    lightning_trainer("zero2", world, root, finder, max_steps=1).fit(module, datamodule=data)
    return finder.optimal_batch_size, finder.trials, data.batch_size


@pytest.mark.timeout(120)
def test_power_mode_sets_the_datamodule_batch_size(tmp_path):
    found, trials, dm_size = run_ranks(_datamodule_find, 2, (str(tmp_path),), timeout_s=100)[0]
    sizes = [b for b, _, _ in trials]
    assert sizes == [4 * 2**i for i in range(len(sizes))] and not trials[-1][1]  # doubling until a failure
    assert all(ok for _, ok, _ in trials[:-1]) and found == sizes[-2] == dm_size


def test_bad_arguments_get_one_clear_error():
    with pytest.raises(ValueError, match="mode='grid': allowed 'power', 'binsearch'"):
        ZeroBatchSizeFinder(max_bytes=1, mode="grid")
    with pytest.raises(ValueError, match="steps_per_trial=0: allowed a positive int"):
        ZeroBatchSizeFinder(max_bytes=1, steps_per_trial=0)
    with pytest.raises(ValueError, match="max_bytes=-5: allowed a positive number"):
        ZeroBatchSizeFinder(max_bytes=-5)


def _no_cap(rank, world, root):
    lightning_trainer("zero2", world, root, ZeroBatchSizeFinder()).fit(MLPModule())


@pytest.mark.timeout(60)
def test_cpu_without_a_cap_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="on CPU needs max_bytes"):
        run_ranks(_no_cap, 1, (str(tmp_path),), timeout_s=50)


# -- Lightning's own finder -------------------------------------------------------------------------------
def test_lightning_batch_size_finder_names_ours(tmp_path):
    from lightning.pytorch.callbacks import BatchSizeFinder

    trainer = lightning_trainer("zero2", 1, str(tmp_path), BatchSizeFinder())
    with pytest.raises(ValueError, match=r"Lightning's BatchSizeFinder refuses distributed strategies.*"
                                         r"lightning_zero\.ZeroBatchSizeFinder\(max_bytes=.*lightning-zero tune "
                                         r"--module"):
        trainer.fit(MLPModule())


def test_lightning_tuner_names_ours(tmp_path):
    from lightning.pytorch.tuner import Tuner

    trainer = lightning_trainer("zero3", 1, str(tmp_path))
    with pytest.raises(ValueError, match=r"Tuner\.scale_batch_size refuses distributed.*ZeroBatchSizeFinder"):
        Tuner(trainer).scale_batch_size(MLPModule(), mode="binsearch")


def test_lightning_tuner_keeps_its_own_check_for_other_strategies(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.tuner import Tuner

    trainer = lightning_trainer(DDPStrategy(), 1, str(tmp_path))
    with pytest.raises(ValueError, match="^Tuning the batch size is currently not supported with distributed"):
        Tuner(trainer).scale_batch_size(MLPModule())
