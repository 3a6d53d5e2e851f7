"""Mixed precision in the engine: fp16 with dynamic loss scaling, bf16, skipped steps, DDP fp32 tracking."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import DynamicLossScaler, ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer

STEPS = 8


def _fp32_ddp(rank):
    model = make_model()
    ddp = DDP(model, find_unused_parameters=True)
    opt = make_optimizer(model, "adamw")
    losses = []
    for step in range(STEPS):
        loss = loss_fn(ddp, batch(step, rank, size=8), False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _mixed(rank, stage, dtype, accum=1, reduce_dtype=None):
    model = make_model()
    opt = make_optimizer(model, "adamw")
    scaler = DynamicLossScaler(init_scale=2.0**8, scale_window=3) if dtype == torch.float16 else None
    units = dict(unit_classes=["fc1", "fc2", "frozen"], persist_numel=0) if stage == 3 else {}
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, reduce_dtype=reduce_dtype, **units), compute_dtype=dtype,
                        loss_scaler=scaler, check_finite=True)
    assert all(p.dtype == dtype for p in model.parameters())
    losses, scales = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(accum):
            tokens = batch(step, rank, size=8)
            # split the same 8 samples into micro-batches so the fp32 reference sees identical data
            chunk = tokens[micro * 8 // accum : (micro + 1) * 8 // accum]
            ctx = engine.no_sync() if micro < accum - 1 else torch.enable_grad()
            with ctx:
                loss = loss_fn(model, chunk, False).float() / accum
                engine.scale_loss(loss).backward()
            total += loss.item()
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(total)
        scales.append(engine.loss_scale)
    return losses, scales, [p.dtype for p in engine.sharded.grads()]


def _suite(rank, world_size):
    ref = _fp32_ddp(rank)
    out = {"ref": ref}
    for stage in (1, 2, 3):
        for dtype in (torch.float16, torch.bfloat16):
            out[(stage, str(dtype), 1)] = _mixed(rank, stage, dtype)
    out[(2, "torch.float16", 2)] = _mixed(rank, 2, torch.float16, accum=2)
    out[(1, "torch.bfloat16", "fp32-reduce")] = _mixed(rank, 1, torch.bfloat16, reduce_dtype="fp32")
    return out


@functools.lru_cache(maxsize=None)
def suite():
    return run_distributed(_suite, 2)


@pytest.mark.parametrize(
    "key",
    [(1, "torch.float16", 1), (1, "torch.bfloat16", 1), (2, "torch.float16", 1), (2, "torch.bfloat16", 1),
     (3, "torch.float16", 1), (3, "torch.bfloat16", 1), (2, "torch.float16", 2), (1, "torch.bfloat16", "fp32-reduce")],
    ids=str,
)
def test_mixed_tracks_fp32_ddp(key):
    for res in suite():
        ref = torch.tensor(res["ref"])
        losses, scales, _ = res[key]
        rel = ((torch.tensor(losses) - ref).abs() / ref.abs()).max().item()
        tol = 2e-2  # measured: 0.5-1.1 % for fp16 and bf16
        assert rel < tol, f"{key}: max relative loss gap {rel:.4f} to fp32 DDP"
        if key[1] == "torch.float16":
            assert scales[0] == 2.0**8 and max(scales) > 2.0**8  # grew after clean windows


def _forced_overflow(rank, world_size, stage):
    model = make_model()
    opt = make_optimizer(model, "adamw")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage), compute_dtype=torch.float16,
                        loss_scaler=DynamicLossScaler(init_scale=2.0**10, hysteresis=1))
    engine.scale_loss(loss_fn(model, batch(0, rank), False)).backward()
    assert engine.step()
    sched.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = loss_fn(model, batch(1, rank), False)
    if rank == world_size - 1:
        loss = loss * float("inf")  # overflow on one rank only
    engine.scale_loss(loss).backward()
    stepped = engine.step()
    return stepped, engine.skipped_steps, engine.loss_scale, before, dict(model.state_dict())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_on_one_rank_skips_everywhere(stage):
    res = run_distributed(_forced_overflow, 2, stage)
    for stepped, skipped, scale, before, after in res:
        assert stepped is False and skipped == 1
        assert scale == 2.0**9  # hysteresis 1: halved at once
        for k in before:
            torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    for k in res[0][4]:
        torch.testing.assert_close(res[1][4][k], res[0][4][k], rtol=0, atol=0)


def test_bf16_nonfinite_check_skips_single_rank():
    model = make_model()
    opt = make_optimizer(model, "adamw")
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2), compute_dtype=torch.bfloat16, check_finite=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (loss_fn(model, batch(0, 0), False) * float("nan")).backward()
    assert engine.step() is False and engine.skipped_steps == 1
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    loss_fn(model, batch(1, 0), False).backward()
    assert engine.step() is True


def test_restore_fp32_module_returns_masters():
    model = make_model()
    opt = make_optimizer(model, "adamw")
    engine = ZeroEngine(model, opt, ZeroConfig(stage=1), compute_dtype=torch.bfloat16)
    loss_fn(model, batch(0, 0), False).float().backward()
    engine.step()
    masters = [m.detach().clone() for row in engine.sharded.masters for m in row]
    engine.restore_fp32_module()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for p, m in zip(engine.bucket_params, masters):
        torch.testing.assert_close(p.detach().reshape(-1), m.reshape(-1), rtol=0, atol=0)


def test_unscale_uses_the_scale_the_gradients_were_made_with():
    """When the dynamic scaler grows at this step, the update must still divide by the old scale."""
    def run(window):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = DynamicLossScaler(init_scale=2.0**4, scale_window=window)
        engine = ZeroEngine(model, opt, ZeroConfig(stage=1), compute_dtype=torch.float16, loss_scaler=scaler)
        engine.scale_loss(loss_fn(model, batch(0, 0), False).float()).backward()
        engine.step()
        return engine.loss_scale, {k: v.clone() for k, v in model.state_dict().items()}

    grown, a = run(window=1)  # the scale doubles during this very step
    kept, b = run(window=1000)
    assert grown == 2.0**5 and kept == 2.0**4
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
