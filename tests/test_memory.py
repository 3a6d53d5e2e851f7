"""Bytes each rank holds for model states, against the per-stage floors (docs/ARCHITECTURE.md) (counted exactly)."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine, model_state_floor
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import memory_mlp as _model


def _measure(rank, world_size, stage, dtype_name, offload):
    dtype = getattr(torch, dtype_name)
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, offload_optimizer=offload, bucket_mb=0.05),
                        compute_dtype=dtype)
    x = torch.randn(8, 64, dtype=dtype, generator=torch.Generator().manual_seed(rank))
    model(x).float().pow(2).mean().backward()
    engine.step()  # creates the optimizer state
    # stages 0-1 hold full gradients through accumulation: measure after an un-synced micro-batch
    with engine.no_sync():
        model(x).float().pow(2).mean().backward()
    report = engine.memory_report()
    return numel, report.as_dict()


CASES = [(s, d, o) for s in (0, 1, 2) for d in ("float32", "bfloat16") for o in (False, True) if not (o and s == 0)]


@functools.lru_cache(maxsize=None)
def _run(world_size):
    if world_size == 1:
        return [_all_cases_entry(0, 1)]
    return run_distributed(_all_cases_entry, world_size)


def _all_cases_entry(rank, world_size):
    return {c: _measure(rank, world_size, *c) for c in CASES}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}-offload{c[2]}")
def test_model_states_meet_floor(world_size, case):
    stage, dtype_name, offload = case
    mixed = dtype_name != "float32"
    for per_rank in _run(world_size):
        numel, rep = per_rank[case]
        floor = model_state_floor(stage, numel, world_size, mixed, state_bytes=8, offload_optimizer=offload)
        device_bytes = rep["model_states"] - rep["host"]
        # padding of per-parameter shards is < world_size elements per parameter: well inside 5 %
        assert abs(device_bytes - floor["device"]) <= 0.05 * floor["device"], (rep, floor)
        assert abs(rep["host"] - floor["host"]) <= 0.05 * max(floor["host"], 1), (rep, floor)
        if stage >= 1 and not offload:
            expect_opt = (8 + (4 if mixed else 0)) * numel / world_size
            got = rep["optimizer_state"] + rep["master"]
            assert abs(got - expect_opt) <= 0.05 * expect_opt


@pytest.mark.parametrize("numel", [4096, 1_000_003])  # divisible by 1, 2, 4 / by none of 2, 4
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_estimator_and_floor_are_one_model(world_size, numel):
    """tools/estimate.py and the floors share engine/memory/floors.py's model: with the engine's padding (< 1
    element per rank for one tensor) as the only difference, for every preset, precision and optimizer."""
    from lightning_zero.engine.config import PRESETS
    from lightning_zero.tools.estimate import ModelInfo, model_state_bytes

    info = ModelInfo(numel, numel)
    for name, kw in PRESETS.items():
        stage, offload = kw["stage"], kw.get("offload_optimizer", False)
        assert bool(kw.get("offload_params", False)) == bool(offload and stage == 3), name  # the estimator's "offload"
        for mixed in (False, True):
            for k in (0, 4, 8):
                est = model_state_bytes(info, stage, offload, world_size, mixed, k, accumulating=True)
                floor = model_state_floor(stage, numel, world_size, mixed, k, offload_optimizer=offload,
                                          offload_params=kw.get("offload_params", False))
                pad = (2 if mixed else 4) * (-(-numel // world_size) - numel / world_size)  # bytes, < 1 element
                case = (name, mixed, k, est, floor)
                assert est["params"] - floor["params"] == pytest.approx(pad if stage == 3 else 0, abs=1e-6), case
                assert est["grads"] - floor["grads"] == pytest.approx(pad if stage >= 2 else 0, abs=1e-6), case
                assert est["master"] + est["optimizer_state"] == pytest.approx(floor["optimizer"]), case
                off_device = pad if stage == 3 and kw.get("offload_params", False) else 0  # host or NVMe
                on_host = off_device if kw.get("offload_params", False) is True else 0
                assert est["host"] - floor["host"] == pytest.approx(on_host, abs=1e-6), case
                extra = (pad if stage == 3 else 0) + (pad if stage >= 2 else 0) - off_device
                assert est["device"] - floor["device"] == pytest.approx(extra, abs=1e-6), case
                if numel % world_size == 0:
                    assert est["device"] == pytest.approx(floor["device"]) and est["host"] == floor["host"]


def test_model_states_are_booked_where_the_placement_says():
    """``rank_model_states`` reads the plan and books each kind at its placement's location, for a placement no
    preset has too: stage 3's fp32 parameter shards in host memory (each its own master), the optimizer
    state on NVMe, the gradient shards on the device."""
    from lightning_zero.engine.memory.floors import rank_model_states
    from lightning_zero.engine.placement.placement import Placement
    from lightning_zero.engine.plan import ShardingPlan

    plan = ShardingPlan.for_stage(3, placement=Placement.from_knobs(offload_optimizer="nvme", offload_params=True))
    r = rank_model_states(plan, 4, False, 4000, state_bytes=8)
    assert (r["params"], r["grads"], r["master"], r["optimizer_state"]) == (4000, 4000, 0, 8000)
    assert (r["host"], r["nvme"], r["device"]) == (4000, 8000, 4000)
    mixed = rank_model_states(plan, 4, True, 4000, state_bytes=8)  # bf16 shards: a separate fp32 master, on NVMe
    assert (mixed["master"], mixed["host"], mixed["nvme"], mixed["device"]) == (4000, 2000, 12000, 2000)
