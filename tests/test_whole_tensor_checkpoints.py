"""Checkpoints of whole-tensor optimizers under the owner-rank step: each parameter's state lives whole on its owner.

- save -> resume in new processes continues bit for bit (same world size and stage);
- the consolidated optimizer state equals what DDP's own optimizers hold after the same steps;
- a checkpoint resumes at another world size (the owners change) and another stage (0 included), and training
  continues as DDP does from the same model and optimizer state;
- the checkpoint lists each parameter's state once, written by its owner, in the layout stage 0 writes.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero import checkpoint as ck
from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import Tolerance, close
from tests.helpers.whole_tensor_runs import fp32_newton_schulz, make_optimizers
from tests.helpers.zoo_models import ZOO

NAME, WHICH = "gpt2", "muon_adamw"
FP32 = Tolerance(1e-5, 1e-6)


def _setup(cfg, which=WHICH):
    torch.manual_seed(0)
    model = ZOO[NAME][0]()
    opts = make_optimizers(model, which)
    engine = ZeroEngine(model, opts, cfg) if cfg is not None else None
    return model, opts, engine


def _steps(rank, model, opts, engine, steps):
    _, make_batch, loss_fn = ZOO[NAME]
    runner = model if engine is not None else DDP(model, find_unused_parameters=True)
    for step in steps:
        if engine is not None:
            engine.prepare_forward()
        loss_fn(runner, make_batch(step, rank)).backward()
        if engine is not None:
            engine.clip_grad_norm_(0.5)
            engine.step()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            for o in opts:
                o.step()
                o.zero_grad()


def _weights(model, engine):
    if engine is not None:
        engine.restore_fp32_module()
        engine.remove(hand_back=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- same world size and stage: bit for bit -----------------------------------------------------------------
def _save_then_continue(rank, world, cfg, path):
    model, opts, engine = _setup(cfg)
    _steps(rank, model, opts, engine, range(2))
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 2})
    _steps(rank, model, opts, engine, range(2, 4))
    return _weights(model, engine)


def _resume(rank, world, cfg, path):
    model, opts, engine = _setup(cfg)
    ck.load_checkpoint_dir(path, model, engine)
    _steps(rank, model, opts, engine, range(2, 4))
    return _weights(model, engine)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", [dict(stage=2), dict(stage=3, offload_optimizer=True, offload_params=True)])
def test_resume_in_new_processes_continues_bit_for_bit(tmp_path, preset):
    path = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_then_continue, 2, ZeroConfig(**preset), path)
    resumed = run_distributed(_resume, 2, ZeroConfig(**preset), path)  # new processes: nothing but the directory
    for a, b in zip(uninterrupted, resumed):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    info = json.loads((tmp_path / "ckpt" / "zero_checkpoint.json").read_text())
    muon_params = {n for n, p in ZOO[NAME][0]().named_parameters() if p.ndim == 2 and ".h." in n}
    assert set(info["optimizer_state"]) == muon_params  # every Muon matrix's state, listed once (by its owner)


# -- consolidated state: what DDP's own optimizers hold -------------------------------------------------------
def _consolidated(rank, world, cfg):
    fp32_newton_schulz()
    model, opts, engine = _setup(cfg)
    _steps(rank, model, opts, engine, range(2))
    full = [engine.optimizer_state_dict(o) for o in opts]  # collective; the full state on rank 0
    ref_model, ref_opts, _ = _setup(None)
    _steps(rank, ref_model, ref_opts, None, range(2))
    if rank == 0:
        for got, ref in zip(full, [o.state_dict() for o in ref_opts]):
            close(got["state"], ref["state"], "state", FP32)
            assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    engine.remove()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,stage", [(2, 3), (4, 1)])
def test_consolidated_state_equals_ddp_optimizers_state(world, stage):
    run_distributed(_consolidated, world, ZeroConfig(stage=stage))


# -- another world size and stage: the owners change -----------------------------------------------------------
def _save_for_reshard(rank, world, cfg, path, full_path):
    fp32_newton_schulz()
    model, opts, engine = _setup(cfg)
    _steps(rank, model, opts, engine, range(2))
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 2})
    full = [engine.optimizer_state_dict(o) for o in opts]
    weights = _weights(model, engine)
    if rank == 0:
        torch.save({"model": weights, "optimizers": full}, full_path)


def _continue_elsewhere(rank, world, cfg, path, full_path):
    """This world size / stage resumes the directory; DDP resumes the same model and optimizer states from the
    consolidated copy with torch's own load_state_dict; both train two more steps on this world's batches."""
    fp32_newton_schulz()
    model, opts, engine = _setup(cfg)
    ck.load_checkpoint_dir(path, model, engine)
    _steps(rank, model, opts, engine, range(2, 4))
    got = _weights(model, engine)
    saved = torch.load(full_path, weights_only=True)
    ref_model, ref_opts, _ = _setup(None)
    ref_model.load_state_dict(saved["model"])
    for o, st in zip(ref_opts, saved["optimizers"]):
        o.load_state_dict(st)
    _steps(rank, ref_model, ref_opts, None, range(2, 4))
    close(got, _weights(ref_model, None), f"world {world} {cfg.stage}", FP32)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved,resumed", [((2, dict(stage=3)), (4, dict(stage=1))),
                                           ((4, dict(stage=2)), (2, dict(stage=3, offload_optimizer=True))),
                                           ((2, dict(stage=1)), (2, dict(stage=0))),
                                           ((4, dict(stage=3, shard_group_size=2)), (2, dict(stage=2)))])
def test_resume_at_another_world_size_and_stage(tmp_path, saved, resumed):
    path, full_path = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    run_distributed(_save_for_reshard, saved[0], ZeroConfig(**saved[1]), path, full_path)
    run_distributed(_continue_elsewhere, resumed[0], ZeroConfig(**resumed[1]), path, full_path)


def _stage0_to_owners(rank, world, path):
    """A stage-0 checkpoint (whole state on every rank) resumes under owners: each takes its parameters' state."""
    fp32_newton_schulz()
    model, opts, engine = _setup(ZeroConfig(stage=0), "adafactor")
    _steps(rank, model, opts, engine, range(2))
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 2})
    full = engine.optimizer_state_dict(opts[0])
    engine.remove()
    model, opts, engine = _setup(ZeroConfig(stage=3), "adafactor")
    ck.load_checkpoint_dir(path, model, engine)
    again = engine.optimizer_state_dict(opts[0])
    if rank == 0:
        close(again["state"], full["state"], "adafactor state", Tolerance(0, 0))
    engine.remove()


@pytest.mark.timeout(300)
def test_stage0_checkpoint_resumes_under_owner_ranks(tmp_path):
    run_distributed(_stage0_to_owners, 2, str(tmp_path / "ckpt"))


def _full_state_round_trip(rank, world):
    """engine.load_optimizer_state_dict(full) under new owners reproduces the same full state."""
    model, opts, engine = _setup(ZeroConfig(stage=2), "adafactor")
    _steps(rank, model, opts, engine, range(2))
    full = engine.optimizer_state_dict(opts[0])
    engine.remove()
    full = [full]
    torch.distributed.broadcast_object_list(full, src=0)
    model, opts, engine = _setup(ZeroConfig(stage=3), "adafactor")
    engine.load_optimizer_state_dict(full[0], opts[0])
    again = engine.optimizer_state_dict(opts[0])
    if rank == 0:
        close(again["state"], full[0]["state"], "round trip", Tolerance(0, 0))
    engine.remove()


@pytest.mark.timeout(300)
def test_full_optimizer_state_round_trip_under_owners():
    run_distributed(_full_state_round_trip, 2)
