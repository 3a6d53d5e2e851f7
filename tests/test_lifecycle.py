"""Every Trainer entry point, in any order, many times in one process, for every stage -- against DDP.

Launchers: "external" ranks (tests/dist_utils.run_distributed initializes the process group, then one
process runs many Trainers with the strategy's default launcher, which launches nothing: what
torchrun/SLURM do), Lightning's fork launcher, and spawn for a small subset. Each sequence
(tests/helpers/lifecycle_harness.py) records metrics, predictions, whole weights after each fit and the optimizer
state a resumed fit starts from; ZeRO's record must equal DDP's doing the same sequence (fp32, rtol 1e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_zero import checkpoint as ck
from tests.helpers.dist_utils import free_port, run_distributed
from tests.helpers.lifecycle_harness import SEQUENCES, STAGES, run_external, run_sequence
from tests.helpers.parity import close as _close

_REFS: dict = {}


def _opt_close(got, want, what):
    """A consolidated optimizer state (ZeRO) against torch's own (DDP): same groups, same moments."""
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]], what
    assert set(got["state"]) == set(want["state"]), what
    for i, st in want["state"].items():
        assert set(got["state"][i]) == set(st), (what, i)
        for k, v in st.items():
            _close(torch.as_tensor(got["state"][i][k]).reshape(torch.as_tensor(v).shape), torch.as_tensor(v),
                   f"{what} state {i}.{k}")


def compare_records(zero: dict, ddp: dict, what: str, rank: int = 0) -> None:
    assert len(zero["metrics"]) == len(ddp["metrics"]) and len(zero["weights"]) == len(ddp["weights"]), what
    for i, (a, b) in enumerate(zip(zero["metrics"], ddp["metrics"])):
        assert [set(m) for m in a] == [set(m) for m in b], (what, a, b)
        for ma, mb in zip(a, b):
            for k in mb:
                _close(torch.tensor(ma[k]), torch.tensor(mb[k]), f"{what} metrics[{i}] {k}")
    for i, (a, b) in enumerate(zip(zero["preds"], ddp["preds"])):
        assert (a is None) == (b is None), what
        for j, (pa, pb) in enumerate(zip(a or [], b or [])):
            _close(pa, pb, f"{what} predict[{i}] batch {j}")
    for i, (a, b) in enumerate(zip(zero["weights"] + [zero["final"]], ddp["weights"] + [ddp["final"]])):
        assert set(a) == set(b), what
        for k in b:
            _close(a[k], b[k], f"{what} weights[{i}] {k}")
    for i, (a, b) in enumerate(zip(zero["losses"], ddp["losses"])):
        _close(torch.tensor(a), torch.tensor(b), f"{what} losses[{i}]")
    assert len(zero["start_opt"]) == len(ddp["start_opt"]), what
    for a, b in zip(zero["start_opt"], ddp["start_opt"]):  # resumed from the after-fit checkpoint
        assert (a is None) == (b is None), what  # None: recorded in a launched rank, not here
        if rank == 0 and b is not None:  # the consolidated state exists on rank 0 only
            assert a["state"], f"{what}: the after-fit checkpoint held no optimizer state"
            _opt_close(a, b, f"{what} resumed optimizer state")


def _external(name, seq, world_size, out, repeats=1):
    return run_distributed(run_external, world_size, name, seq, str(out), repeats)


def _ddp_external(seq, world_size, tmp_path_factory):
    key = ("external", seq, world_size)
    if key not in _REFS:
        _REFS[key] = _external("ddp", seq, world_size, tmp_path_factory.mktemp("ddp"))
    return _REFS[key]


def _check_external(zero, ddp, stage, what):
    for rank, (z, d) in enumerate(zip(zero, ddp)):
        for i, rz in enumerate(z["records"]):  # every repetition equals DDP's (deterministic) run
            compare_records(rz, d["records"][0], f"{what} rank {rank} rep {i}", rank)
        # the default group, plus one reduce-scatter group per process under stage 3 however many engines
        assert z["groups"] == 1 + stage.startswith("zero3"), (what, z["groups"])
        assert len(set(z["threads"][1:])) <= 1, f"{what}: OS threads grow with the repetitions: {z['threads']}"


# -- the repetition test: fit -> validate -> test -> save -> fit(ckpt_path) 20 times in one process ---------------
REPEATS = 20


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", list(STAGES))
def test_repeated_lifecycle_in_one_process_matches_ddp(tmp_path, tmp_path_factory, stage):
    zero = _external(stage, "repeated", 2, tmp_path, REPEATS)
    assert len(zero[0]["records"]) == REPEATS
    _check_external(zero, _ddp_external("repeated", 2, tmp_path_factory), stage, f"{stage} x{REPEATS}")
    info = ck.read_info(tmp_path / "rep0" / f"{stage}_after.dir")
    assert info["stage"] == STAGES[stage]["stage"] and info["optimizer_state"], "after-fit save: training state"


# -- more sequences, external launcher; a 4-rank subset --------------------------------------------------------------
MATRIX = ([(s, "eval_first_then_ckpt_eval", 2) for s in STAGES] + [("zero2", "fit_eval_save_resume", 2)]
          + [("zero3", "fit_eval_save_resume", 4)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,seq,world_size", MATRIX, ids=[f"{s}-{q}-ws{w}" for s, q, w in MATRIX])
def test_external_launcher_sequence_matches_ddp(tmp_path, tmp_path_factory, stage, seq, world_size):
    zero = _external(stage, seq, world_size, tmp_path)
    _check_external(zero, _ddp_external(seq, world_size, tmp_path_factory), stage, f"{stage} {seq} ws{world_size}")


# -- fork and spawn launchers: every entry point launches its own ranks -----------------------------------------------
# spawn re-imports torch and Lightning in every rank of every entry point (seconds each): one short sequence
LAUNCHED = [("zero3", "fork", "fit_eval_save_resume"), ("zero3", "spawn", "fit")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage,method,seq", LAUNCHED, ids=[f"{s}-{m}-{q}" for s, m, q in LAUNCHED])
def test_launched_sequence_matches_ddp(tmp_path, stage, method, seq, monkeypatch):
    import tests.helpers.lifecycle_harness as h

    make = h.make_strategy
    key = ("launched", seq)  # the reference always forks: the launcher changes no number
    if key not in _REFS:
        os.makedirs(tmp_path / "ddp")
        monkeypatch.setattr(h, "make_strategy", _with_start_method(make, "fork"))
        _REFS[key] = run_sequence("ddp", SEQUENCES[seq], 2, str(tmp_path / "ddp"))
    monkeypatch.setattr(h, "make_strategy", _with_start_method(make, method))
    zero = run_sequence(stage, SEQUENCES[seq], 2, str(tmp_path))
    compare_records(zero, _REFS[key], f"{stage} {method} {seq}")


def _with_start_method(make, method):
    return lambda name, **kw: make(name, start_method=method, **kw)


# -- engine level: one reduce-scatter group per process ------------------------------------------------------------
def _engines_share_one_group(rank, world_size):
    from lightning_zero import ZeroConfig, ZeroEngine
    from tests.helpers.models import batch, loss_fn, make_model, make_optimizer

    cfg = ZeroConfig(stage=3, unit_classes=["fc1", "fc2", "frozen"], persist_numel=0)
    names = dist.distributed_c10d._world.pg_names
    seen = []
    for i in range(4):  # fit, validate, test, fit again: as Lightning builds them
        model = make_model()
        engine = ZeroEngine(model, make_optimizer(model, "adamw") if i % 3 == 0 else None, cfg)
        if engine.reducer is not None:
            loss_fn(model, batch(i, rank), False).backward()
            engine.step()
            seen.append(engine.reducer.group)
        else:
            assert len(names) == 1 + bool(seen), "an evaluation-only engine made a process group"
        engine.remove()
        assert len(names) == 2, "a removed engine destroyed the shared group (the next one would re-create it)"
    return seen[0] is seen[1]


@pytest.mark.timeout(60)
def test_stage3_engines_share_one_reduce_group_and_eval_engines_make_none():
    assert all(run_distributed(_engines_share_one_group, 2))


# -- torchrun elastic restart: a worker killed mid-fit, the job restarts and resumes -----------------------------------
def _uninterrupted(rank, world_size, out):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    from tests.scripts.elastic_train import main

    return main(out, "zero3", 0, world_size)


@pytest.mark.timeout(240)
def test_torchrun_restart_after_a_killed_worker_resumes_zero3(tmp_path):
    script = Path(__file__).parent / "scripts" / "elastic_train.py"
    out = tmp_path / "elastic"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.5",
           str(script), str(out), "zero3", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "exitcode: 17" in proc.stderr, "the first attempt's worker did not die as planned"
    final = torch.load(out / "final.pt", weights_only=False)
    assert final["resumed_from"].endswith("epoch=0.ckpt") and final["global_step"] == 6
    reference = run_distributed(_uninterrupted, 2, str(tmp_path / "ref"))[0]
    for k, v in reference.items():
        _close(final["weights"][k], v, f"restarted vs uninterrupted {k}")
