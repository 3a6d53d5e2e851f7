"""ZeroEngine (no Lightning) against torch DDP: same seed, same data -> same losses, norms and weights."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm import collectives
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer
from tests.helpers.parity import FP32_TIGHT, check_parity, close, ddp_reference

STEPS = 5
CASES = [(s, o, 1, None) for s in (0, 1, 2) for o in ("adamw", "sgd")]
CASES += [(s, "adamw", a, 0.5) for s in (0, 1, 2) for a in (1, 2, 3)]


def _uses_sometimes(rank: int, step: int) -> bool:
    return rank == 0 and step % 2 == 0


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _run_zero(rank, stage, opt_kind, accum, clip, bucket_mb):
    model = make_model()
    opt = make_optimizer(model, opt_kind)
    sched = _scheduler(opt)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, bucket_mb=bucket_mb))
    losses, norms, comm_non_boundary = [], [], 0
    for step in range(STEPS):
        for micro in range(accum):
            use = _uses_sometimes(rank, step)
            boundary = micro == accum - 1
            before = collectives.stats.total_calls
            ctx = _null() if boundary else engine.no_sync()
            with ctx:
                loss = loss_fn(model, batch(step, rank, micro), use) / accum
                loss.backward()
            if not boundary:
                comm_non_boundary += collectives.stats.total_calls - before
            losses.append(loss.item())
        if clip is not None:
            norms.append(engine.clip_grad_norm_(clip).item())
        engine.step()
        sched.step()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, comm_non_boundary


def _matrix(rank, world_size, cases, bucket_mb):
    out = {}
    ref_cache = {}
    for case in cases:
        stage, opt_kind, accum, clip = case
        key = (opt_kind, accum, clip)
        if key not in ref_cache:
            ref_cache[key] = ddp_reference(rank, opt_kind, accum, clip)
        out[case] = (ref_cache[key], _run_zero(rank, stage, opt_kind, accum, clip, bucket_mb))
    return out


@functools.lru_cache(maxsize=None)
def results(world_size: int, bucket_mb: float = 0.0004):
    # a tiny bucket cap (~400 bytes) forces several buckets, so in-order launching is exercised
    return run_distributed(_matrix, world_size, CASES, bucket_mb)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}-acc{c[2]}-clip{c[3]}")
def test_engine_matches_ddp(world_size, case):
    per_rank = results(world_size)
    for rank, res in enumerate(per_rank):
        ref, (losses, norms, params, comm_nb) = res[case]
        check_parity((losses, norms, params), ref, f"rank {rank}", FP32_TIGHT)
        if case[0] in (0, 1):
            assert comm_nb == 0, f"stage {case[0]} issued {comm_nb} collectives on non-boundary micro-batches"
        elif world_size > 1 and case[2] > 1:
            assert comm_nb > 0, "stage 2 reduces every micro-batch"
    # every rank ends with identical full parameters
    p0 = per_rank[0][case][1][2]
    for res in per_rank[1:]:
        for name in p0:
            torch.testing.assert_close(res[case][1][2][name], p0[name], rtol=0, atol=0)


def test_engine_world_size_4_stage2():
    cases = [(2, "adamw", 2, 0.5), (1, "sgd", 1, None)]
    per_rank = run_distributed(_matrix, 4, cases, 0.0004)
    for res in per_rank:
        for case in cases:
            ref, (losses, norms, params, _) = res[case]
            check_parity((losses, norms, params), ref, str(case), FP32_TIGHT)


def _clip_value_run(rank, world_size, stage):
    out = []
    for zero in (False, True):
        model = make_model()
        opt = make_optimizer(model, "sgd")
        runner = model if zero else DDP(model, find_unused_parameters=True)
        engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, **_units(stage))) if zero else None
        for step in range(4):
            loss_fn(runner, batch(step, rank), _uses_sometimes(rank, step) and stage < 3).backward()
            if zero:
                engine.clip_grad_value_(0.01)
                engine.step()
            else:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
                opt.step()
                opt.zero_grad()
        if zero:
            engine.restore_fp32_module()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _units(stage):
    return dict(unit_classes=["fc1", "fc2", "frozen"], persist_numel=0) if stage == 3 else {}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_by_value_matches_ddp(stage):
    for ref, got in run_distributed(_clip_value_run, 2, stage):
        close(got, ref, f"stage {stage}", FP32_TIGHT)
