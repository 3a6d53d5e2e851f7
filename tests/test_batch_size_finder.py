"""Batch-size search under ZeroStrategy (lightning_zero.ZeroBatchSizeFinder, `lightning-zero tune --module`),
measured activations in `lightning-zero estimate --module`, and Lightning's own finder pointing to ours.

The finder's answer is checked against a brute-force measurement of the same rule (engine/memory/step_bytes.py)
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
from tests.helpers.batch_size_models import SEQ, GPT2Module, MLPModule, gpt2_loss, mlp_loss
from tests.helpers.lightning_models import trainer_kwargs
from tests.helpers.zoo_models import VOCAB

ROOT = Path(__file__).resolve().parents[1]
# the presets, and one with activation checkpointing (the finder then also counts the largest recompute)
CONFIGS = dict(PRESETS, zero3_ckpt=dict(stage=3, activation_checkpointing="auto"))


def _strategy(name):
    from lightning_zero import ZeroStrategy

    return name if name in PRESETS else ZeroStrategy(**CONFIGS[name])


def _brute_force(rank, world, kind, preset, sizes):
    """The step bytes at each size: a fresh engine over the module's net, stepped by the harness."""
    import argparse

    from lightning_zero.tools.tuning.harness import Runner, Trial

    def build():
        module = GPT2Module() if kind == "gpt2" else MLPModule()
        net = module.net
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)  # as configure_optimizers
        return Runner("zero", net, net, opt, ZeroEngine(net, opt, ZeroConfig(**CONFIGS[preset])))

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
    trainer = lightning_trainer(_strategy(preset), world, root, finder, max_steps=1)
    trainer.fit(module)
    size = module.hparams.batch_size if kind == "gpt2" else module.batch_size
    return finder.optimal_batch_size, finder.trials, size, trainer.train_dataloader.batch_size


def lightning_trainer(strategy, devices, root, *callbacks, max_steps=3):
    from lightning.pytorch import Trainer

    return Trainer(strategy=strategy, callbacks=list(callbacks), default_root_dir=root,
                   **trainer_kwargs(devices=devices, max_steps=max_steps))


CASES = [("gpt2", "zero2", 1), ("gpt2", "zero3", 2), ("mlp", "zero2", 2), ("mlp", "zero3", 1), ("gpt2", "zero3_ckpt", 2)]


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


def _every_preset(rank, world, root):
    """Each preset on the same 2 ranks: the finder's measured trial peaks, and the harness's at those sizes."""
    out = {}
    for preset in PRESETS:
        module = MLPModule()
        finder = ZeroBatchSizeFinder(max_bytes=1_500_000, steps_per_trial=1, init_val=16, max_val=200)
        lightning_trainer(preset, world, root, finder, max_steps=1).fit(module)
        sizes = [b for b, _, _ in finder.trials]
        out[preset] = (finder.optimal_batch_size, finder.trials, _brute_force(rank, world, "mlp", preset, sizes))
    return out


@pytest.mark.timeout(300)
def test_every_preset_measures_what_the_engine_holds(tmp_path):
    res = run_ranks(_every_preset, 2, (str(tmp_path),), timeout_s=280)[0]
    assert set(res) == set(PRESETS)
    for preset, (found, trials, brute) in res.items():
        for b, fits, peak in trials:
            assert peak == pytest.approx(brute[b], rel=1e-3), (preset, b, peak, brute[b])
            assert fits == (peak <= 1_500_000)
        ok = [b for b, fits, _ in trials if fits]
        assert found == max(ok) and all(not f for b, f, _ in trials if b > found), (preset, trials)
        assert found + 1 in {b for b, _, _ in trials} or found == 200, (preset, trials)


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


def _mixed_fit(rank, world, root, preset, precision, with_finder, batch_size):
    module = GPT2Module(batch_size=batch_size)
    cbs = [ZeroBatchSizeFinder(max_bytes=1_200_000, steps_per_trial=2)] if with_finder else []
    from lightning.pytorch import Trainer

    trainer = Trainer(strategy=preset, precision=precision, callbacks=cbs, default_root_dir=root,
                      **trainer_kwargs(devices=world, max_steps=3))
    trainer.fit(module)
    return trainer.train_dataloader.batch_size, module.losses[-3:], module.final_params()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset,precision", [("zero2", "bf16-mixed"), ("zero3", "16-mixed")])
def test_mixed_precision_fit_after_the_finder_equals_a_fit_without_it(tmp_path, preset, precision):
    """The true bf16/fp16 module, its fp32 masters and the fp16 loss scale come back from the checkpoint:
    the fit after the search is bit for bit the fit started at the found size without it."""
    found, losses, params = run_ranks(_mixed_fit, 2, (str(tmp_path), preset, precision, True, 2), timeout_s=140)[0]
    assert found > 2
    ref_found, ref_losses, ref_params = run_ranks(_mixed_fit, 2, (str(tmp_path), preset, precision, False, found),
                                                  timeout_s=140)[0]
    assert ref_found == found and losses == ref_losses
    for k in ref_params:
        assert torch.equal(params[k], ref_params[k]), k


def _datamodule_find(rank, world, root):
    from tests.helpers.batch_size_models import mlp_with_datamodule

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


# -- lightning-zero tune --module ---------------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_cli_tune_module_end_to_end(tmp_path):
    js = tmp_path / "tune.json"
    cap_mb = 0.86
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["lightning-zero", "tune", "--module", "tests.helpers.batch_size_models:mlp_factory", "--memory-mb",
                           str(cap_mb), "--devices", "2", "--stages", "2,3", "--offload", "no", "--steps-per-trial",
                           "1", "--json", str(js)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| setting       | micro-batch |" in proc.stdout and "best: " in proc.stdout
    data = json.loads(js.read_text())
    cap = int(cap_mb * 2**20)
    rows = {r["setting"]: r for r in data["results"]}
    assert set(rows) == {"zero2", "zero3"} and data["world_size"] == 2
    for r in rows.values():
        tried = {b: (ok, peak) for b, ok, peak in r["trials"]}
        assert all(ok == (peak <= cap) for ok, peak in tried.values())  # the rule, with the agreed peaks
        if r["status"] == "fits":
            b = r["batch_size"]
            assert tried[b][0] and r["peak_bytes"] == tried[b][1] <= cap
            assert not tried[b + 1][0]  # the next size up was measured and does not fit
        else:
            assert r["status"] == "nothing fits" and not tried[1][0]
    best = max((r for r in rows.values() if r["status"] == "fits"), key=lambda r: r["batch_size"])
    assert data["best"] == best["setting"]
    assert f"best: {best['setting']} at micro-batch {best['batch_size']}" in proc.stdout


def test_cli_tune_module_refuses_bad_input(capsys):
    from lightning_zero.tools.cli import main

    assert main(["tune", "--module", "tests.helpers.batch_size_models:mlp_factory"]) == 2  # CPU, no cap
    assert "needs a cap: --memory-mb or --memory-gb" in capsys.readouterr().err
    assert main(["tune", "--module", "tests.helpers.batch_size_models", "--memory-mb", "1"]) == 2
    assert "wants 'package.module:factory'" in capsys.readouterr().err
    assert main(["tune", "--module", "tests.helpers.zoo_models:gpt2", "--memory-mb", "1"]) == 2
    assert "allowed: a LightningModule, or a (LightningModule, LightningDataModule) pair" in capsys.readouterr().err


# -- estimate: measured activations -------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [GPT2Module, MLPModule])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_probe_activations_scale_linearly(cls, precision):
    from lightning_zero.tools.estimate_activations import probe_activations

    probe = probe_activations(cls(), probe_batch=2, precision=precision)
    for b in (1, 4, 16):
        measured = probe_activations(cls(), probe_batch=b, precision=precision).probe_bytes
        assert probe.at(b) == pytest.approx(measured, rel=0.01), (b, probe.at(b), measured)


def test_cli_estimate_module_includes_measured_activations(capsys):
    from lightning_zero.tools.cli import main
    from lightning_zero.tools.estimate import GiB, estimate_model_states
    from lightning_zero.tools.estimate_activations import probe_activations

    # states + buffers of zero3 on 2 ranks fit the cap; with 16 samples of activations they do not
    bare = estimate_model_states(GPT2Module(), world_size=2).row("zero3").peak_device
    act = probe_activations(GPT2Module(), probe_batch=2).at(16)
    cap_gb = (bare + act / 2) / GiB
    args = ["estimate", "--module", "tests.helpers.batch_size_models:gpt2_factory", "--ranks", "2", "--settings", "zero3",
            "--device-memory", f"{cap_gb:.9f}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "FITS in" in out and "zero3 (" in out.split("FITS in")[1]
    assert main(args + ["--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "activations: micro-batch 16 per rank" in out and "measured: saved-tensor bytes" in out
    assert "NOTHING FITS" in out and "zero3 (needs" in out
    est = estimate_model_states(GPT2Module(), world_size=2, batch_size=16, settings=["zero3"],
                                activation_probe=probe_activations(GPT2Module(), probe_batch=2))
    assert est.activations == pytest.approx(act) and est.row("zero3").peak_device == pytest.approx(bare + act)


def test_estimate_without_a_probe_names_it():
    from lightning_zero.tools.estimate import estimate_model_states

    with pytest.raises(ValueError, match="needs a T5 model \\(the formula\\) or a measured probe step"):
        estimate_model_states(MLPModule(), batch_size=4)


def test_module_spec_resolves_from_the_working_directory_or_says_why(tmp_path, monkeypatch, capsys):
    """`--module mypkg.models:factory` beside the user resolves as under `python -m` (a console script's path
    starts at its bin/ folder); what does not resolve is one clear error, not a traceback."""
    from lightning_zero.tools.cli import main as cli_main
    from lightning_zero.tools.factory import call_factory

    (tmp_path / "my_models_here.py").write_text("import torch\n\ndef factory():\n    return torch.nn.Linear(3, 2)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert isinstance(call_factory("my_models_here:factory"), torch.nn.Linear)
    for spec, match in (("nope_pkg.x:f", "cannot import 'nope_pkg.x'"), ("my_models_here:missing", "no callable"),
                        ("my_models_here", "package.module:factory")):
        with pytest.raises(ValueError, match=match):
            call_factory(spec)
    assert cli_main(["estimate", "--module", "nope_pkg.x:f", "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot import 'nope_pkg.x'" in err and "Traceback" not in err
