"""0/1 Adam between synchronizations ([Note: the ranks' own models], engine/optim/onebit/local_models.py): a resume
from a checkpoint taken at any local step continues bit for bit on both ranks (Trainer and Fabric, after a
SIGKILL too), and the one model such a checkpoint, a finished fit and a validation inside fit stand for is
the ranks' mean. The runs: tests/helpers/zoadam_runs.py (2 gloo ranks, Lightning's defaults)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.lightning_models import load_rank_files
from tests.helpers.zoadam_runs import LOCAL_STEPS, STEPS, trainer_fit

ROOT = Path(__file__).resolve().parents[1]


def _assert_same_run(whole: list[dict], resumed: list[dict], step: int) -> None:
    """The resumed run's losses and final weights are the uninterrupted run's from ``step`` on, on every rank."""
    for r, (w, x) in enumerate(zip(whole, resumed)):
        skip = len(w["losses"]) - len(x["losses"])  # micro-batches before ``step``
        assert skip == step * len(w["losses"]) // STEPS, f"rank {r}: resumed at the wrong micro-batch"
        assert x["losses"] == w["losses"][skip:], f"rank {r}, resumed at step {step}"
        for name, v in w["params"].items():
            assert torch.equal(x["params"][name], v), f"rank {r}, resumed at step {step}: {name}"


def _ranks_differ(runs: list[dict], step: int) -> bool:
    a, b = runs[0]["trace"][step], runs[1]["trace"][step]
    return any(not torch.equal(a[n], b[n]) for n in a)


def _mean(a: dict, b: dict) -> dict:
    return {n: (a[n] + b[n]) / 2 for n in a}  # what the engine's fp32 all-reduce and divide give on 2 ranks


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision,accum", [("32-true", 1), ("bf16-mixed", 1), ("32-true", 2)])
def test_trainer_resume_at_every_step_is_exact(tmp_path, precision, accum):
    """trainer.fit(ckpt_path=<the directory of step k>) for every step k from the 1-bit gradient phase to the
    last local step (bf16-mixed, accumulate_grad_batches=2: every local step): losses and final weights of
    both ranks equal the uninterrupted run's bit for bit (before, a local-step checkpoint held rank 0's
    weights and moments only: the resumed weights were off by 0.1 after four steps, and by ulps after a
    synchronization)."""
    ckpts = tmp_path / "ckpts"
    trainer_fit(str(tmp_path), "whole_", ckpt_dir=str(ckpts), precision=precision, accum=accum)
    whole = load_rank_files(str(tmp_path), "whole_", "train", 2)
    assert all(_ranks_differ(whole, k) for k in LOCAL_STEPS)  # the checkpoints below are between synchronizations
    steps = range(3, STEPS) if (precision, accum) == ("32-true", 1) else LOCAL_STEPS
    for k in steps:
        trainer_fit(str(tmp_path), f"at{k}_", ckpt_path=str(ckpts / f"step={k}.ckpt"), precision=precision,
                    accum=accum)
        _assert_same_run(whole, load_rank_files(str(tmp_path), f"at{k}_", "train", 2), k)


@pytest.mark.timeout(300)
def test_fabric_resume_at_every_local_step_is_exact(tmp_path):
    """fabric.load(<the directory fabric.save wrote after step k>, state) and the loop continued: both ranks'
    losses and final weights equal the uninterrupted run's at every local step."""
    from lightning_zero.tools.launch import run_ranks
    from tests.helpers.zoadam_runs import fabric_loop

    ckpts = tmp_path / "ckpts"
    whole = run_ranks(fabric_loop, 2, (str(ckpts),), timeout_s=240)
    assert all(_ranks_differ(whole, k) for k in LOCAL_STEPS)
    for k in LOCAL_STEPS:
        _assert_same_run(whole, run_ranks(fabric_loop, 2, (None, str(ckpts / f"step={k}")), timeout_s=240), k)


def _script(frontend: str, out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m tests.helpers.zoadam_runs`` in a session of its own (its SIGKILL reaches only its ranks)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "tests.helpers.zoadam_runs", frontend, str(out), *args],
                          cwd=str(out), env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("frontend", ["trainer", "fabric"])
def test_sigkill_after_a_local_step_checkpoint_resumes_exactly(tmp_path, frontend):
    """The script as a user runs it (Trainer(strategy="zero0", devices=2) / Fabric with ZeroFabricStrategy),
    SIGKILLed (launcher and both ranks) right after the checkpoint of local step 9, then started again from
    that checkpoint: the whole run equals an uninterrupted one bit for bit on both ranks."""
    kill_at = 9
    whole = _script(frontend, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-4000:]
    killed = _script(frontend, tmp_path / "killed", "--ckpt-dir", str(tmp_path / "ckpts"), "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    assert sorted(os.listdir(tmp_path / "ckpts"))[-1] == f"step={kill_at}" + (".ckpt" if frontend == "trainer" else "")
    ckpt = tmp_path / "ckpts" / (f"step={kill_at}" + (".ckpt" if frontend == "trainer" else ""))
    resumed = _script(frontend, tmp_path / "resumed", "--resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    tag = "fabric_" if frontend == "fabric" else "train_"
    w = [torch.load(tmp_path / "whole" / f"{tag}rank{r}.pt", weights_only=False) for r in range(2)]
    x = [torch.load(tmp_path / "resumed" / f"{tag}rank{r}.pt", weights_only=False) for r in range(2)]
    assert _ranks_differ(w, kill_at)
    _assert_same_run(w, x, kill_at)
    if frontend == "trainer":  # the model the fit ends with (STEPS is a local step): one model, the ranks' mean
        mean = _mean(w[0]["params"], w[1]["params"])
        for r in range(2):
            back = torch.load(tmp_path / "resumed" / f"handed_back_rank{r}.pt", weights_only=False)
            assert all(torch.equal(back[n], mean[n]) for n in mean), r


@pytest.mark.timeout(600)
def test_the_model_between_synchronizations_is_the_ranks_mean(tmp_path):
    """What a local-step checkpoint holds as *the* model -- `lightning-zero consolidate` and `export` as a
    user types them -- and what validation inside fit evaluates is the mean of the ranks' weights; the
    validations (and the checkpoints ModelCheckpoint writes at their end, with the mean swapped in) leave
    training exact: same losses and weights as a run without them, and a resume from one is exact too."""
    ckpts = tmp_path / "ckpts"
    plain = trainer_fit(str(tmp_path), "plain_")
    plain_runs = load_rank_files(str(tmp_path), "plain_", "train", 2)
    # the module the Trainer hands back (fork: rank 0's, after the strategy's end of fit) is the mean
    mean_end = _mean(plain_runs[0]["params"], plain_runs[1]["params"])
    assert all(torch.equal(p.detach(), mean_end[n]) for n, p in plain.net.named_parameters())

    trainer_fit(str(tmp_path), "val_", ckpt_dir=str(ckpts), validate=True)
    val_runs = load_rank_files(str(tmp_path), "val_", "train", 2)
    _assert_same_run(plain_runs, val_runs, 0)
    for k in LOCAL_STEPS:
        mean = _mean(val_runs[0]["trace"][k], val_runs[1]["trace"][k])
        for r in range(2):
            assert all(torch.equal(val_runs[r]["val_seen"][k][n], mean[n]) for n in mean), (k, r)

    k = LOCAL_STEPS[0]
    mean = _mean(val_runs[0]["trace"][k], val_runs[1]["trace"][k])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "consolidated.pt"
    done = subprocess.run([sys.executable, "-m", "lightning_zero.tools.cli", "consolidate",
                           str(ckpts / f"step={k}.ckpt"), str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    full = torch.load(out, weights_only=True)
    for n, v in mean.items():
        assert torch.equal(full[f"net.{n}"], v), n

    trainer_fit(str(tmp_path), "resumed_", ckpt_path=str(ckpts / f"step={k}.ckpt"), validate=True)
    _assert_same_run(val_runs, load_rank_files(str(tmp_path), "resumed_", "train", 2), k)


@pytest.mark.timeout(300)
def test_a_full_format_checkpoint_between_synchronizations_holds_the_mean(tmp_path):
    """checkpoint_format="full" (one Lightning file, one value per tensor) at a local step: the model is the
    ranks' mean, as in the sharded directory's model entries."""
    from lightning_zero import ZeroStrategy

    ckpts = tmp_path / "ckpts"
    trainer_fit(str(tmp_path), "full_", strategy=ZeroStrategy(stage=0, start_method="fork", checkpoint_format="full"),
                ckpt_dir=str(ckpts))
    runs = load_rank_files(str(tmp_path), "full_", "train", 2)
    for k in LOCAL_STEPS:
        mean = _mean(runs[0]["trace"][k], runs[1]["trace"][k])
        state = torch.load(ckpts / f"step={k}.ckpt", weights_only=False)["state_dict"]
        for n, v in mean.items():
            assert torch.equal(state[f"net.{n}"], v), (k, n)


@pytest.mark.timeout(300)
def test_a_resume_at_another_world_size_starts_from_the_mean(tmp_path):
    """A local-step checkpoint of 2 ranks resumed on 1: no rank row fits, so the run starts from the ranks'
    mean (weights and moments), with a warning naming why and what gives an exact continuation."""
    ckpts = tmp_path / "ckpts"
    trainer_fit(str(tmp_path), "two_", ckpt_dir=str(ckpts))
    runs = load_rank_files(str(tmp_path), "two_", "train", 2)
    k = LOCAL_STEPS[0]
    with pytest.warns(UserWarning, match="saved between synchronizations on 2 ranks and is loaded on 1"):
        # "zero0" (popen): one device runs in this process, where pytest sees the warning
        trainer_fit(str(tmp_path), "one_", strategy="zero0", ckpt_path=str(ckpts / f"step={k}.ckpt"), devices=1)
    start = load_rank_files(str(tmp_path), "one_", "train", 1)[0]["start"]
    mean = _mean(runs[0]["trace"][k], runs[1]["trace"][k])
    assert all(torch.equal(start[n], mean[n]) for n in mean)
