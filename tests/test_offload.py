"""CPU offload: optimizer state and masters in host memory (stages 1-3), parameter shards too (stage 3).

On a CPU-only machine the same code path runs (separate fp32 masters and optimizer state, the copies,
the fused CPU kernel), so parity and placement are checked here; device-memory floors wait for a GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer

STEPS = 5
CONFIGS = {
    "zero1_offload": dict(stage=1, offload_optimizer=True),
    "zero2_offload": dict(stage=2, offload_optimizer=True),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True,
                          unit_classes=["fc1", "fc2", "frozen", "unused"], persist_numel=0),
}


def _run(rank, name, accum, clip):
    model = make_model()
    opt = make_optimizer(model, "adamw")
    if name == "ddp":
        runner, engine = DDP(model, find_unused_parameters=True), None
    else:
        runner, engine = model, ZeroEngine(model, opt, ZeroConfig(**CONFIGS[name]))
    losses = []
    for step in range(STEPS):
        for micro in range(accum):
            boundary = micro == accum - 1
            ctx = torch.enable_grad() if boundary else (engine.no_sync() if engine else runner.no_sync())
            with ctx:
                loss = loss_fn(runner, batch(step, rank, micro), rank == 0 and step % 2 == 0) / accum
                loss.backward()
            losses.append(loss.item())
        if engine is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        else:
            engine.clip_grad_norm_(clip)
            engine.step()
    info = {}
    if engine is not None:
        masters = [m for row in engine.sharded.masters for m in row]
        info = dict(
            fused=engine.sharded.uses_fused,
            master_devices={m.device.type for m in masters},
            masters_alias_params=any(
                m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                for m, p in zip(masters, engine.bucket_params)
            ),
            state_devices={v.device.type for st in opt.state.values() for v in st.values() if torch.is_tensor(v)},
            report=engine.memory_report().as_dict(),
        )
        engine.restore_fp32_module()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, info


def _all(rank, world_size):
    out = {}
    for accum in (1, 2):
        out[("ddp", accum)] = _run(rank, "ddp", accum, 0.5)
        for name in CONFIGS:
            out[(name, accum)] = _run(rank, name, accum, 0.5)
    return out


@functools.lru_cache(maxsize=None)
def results():
    return run_distributed(_all, 2)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_offload_matches_ddp(name, accum):
    for res in results():
        ref_losses, ref_params, _ = res[("ddp", accum)]
        losses, params, info = res[(name, accum)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_offload_placement_and_fused_kernel(name):
    for res in results():
        info = res[(name, 1)][2]
        assert info["fused"], "the offloaded AdamW step must use torch's fused CPU kernel"
        assert info["master_devices"] == {"cpu"} and info["state_devices"] <= {"cpu"}
        if not name.startswith("zero3"):  # stage 3 fp32 masters may alias the (host) parameter shard
            assert not info["masters_alias_params"], "offloaded masters are separate host copies"
        rep = info["report"]
        assert rep["host"] >= rep["master"] + rep["optimizer_state"] > 0


def _host_copies(rank, world_size, name):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(**CONFIGS[name]))
    red = engine.reducer
    seen = []
    for micro in range(2):
        ctx = engine.no_sync() if micro == 0 else torch.enable_grad()
        with ctx:
            loss_fn(model, batch(0, rank, micro), True).backward()
        seen.append([h is not None for h in red.host_shards])
    # before the step, the boundary's reduced shards are already on the host, equal to the device ones
    copies = [(h.clone(), g.clone()) for h, g in zip(red.host_shards, red.grad_shards) if h is not None]
    engine.finalize_grads()
    masters_read_host = all(
        m.grad is None or m.grad.numel() == 0 or m.grad.data_ptr() == h.data_ptr()
        for row, h in zip(engine.sharded.masters, red.host_shards) for m in row[:1])
    engine.step()
    return seen, copies, masters_read_host, [h is None for h in red.host_shards]


@pytest.mark.parametrize("name", ["zero2_offload", "zero3_offload"])
def test_reduced_shards_reach_the_host_as_buckets_complete(name):
    """Issue 5: a shard goes device->host as its bucket completes (on the boundary micro-batch only, not
    under no_sync), the optimizer reads those copies, and the step clears them."""
    for seen, copies, masters_read_host, cleared in run_distributed(functools.partial(_host_copies, name=name), 2):
        assert seen[0] == [False] * len(seen[0]) and seen[1] == [True] * len(seen[1])
        assert copies and all(torch.equal(h, g) for h, g in copies)
        assert masters_read_host and all(cleared)
