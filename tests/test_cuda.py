"""CUDA paths: the reduce side stream, pinned host masters, offloaded parameter shards, device-memory floors.

Run on a machine with a GPU (bench/gpu_check.sh runs `pytest -m cuda`); skipped where there is none.
One process: collectives short-cut at world size 1, while streams, pinned memory and non-blocking copies
run for real.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from lightning_zero.engine import ZeroConfig, ZeroEngine, model_state_floor

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model(device="cpu"):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)]
    return nn.Sequential(*blocks, nn.Linear(256, 8)).to(device)


def _train(device, cfg, dtype=None, steps=3):
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, opt, cfg, compute_dtype=dtype, device=torch.device(device))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 256, generator=g).to(device, dtype or torch.float32)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(loss.item())
    return model, engine, losses


@pytest.mark.parametrize("cfg", [dict(stage=2), dict(stage=2, offload_optimizer=True),
                                 dict(stage=3, unit_classes=["Sequential"], persist_numel=0),
                                 dict(stage=3, offload_optimizer=True, offload_params=True, unit_classes=["Sequential"],
                                      persist_numel=0)], ids=str)
def test_cuda_matches_cpu(cfg):
    _, e_cpu, ref = _train("cpu", ZeroConfig(**cfg))
    _, e_gpu, got = _train("cuda", ZeroConfig(**cfg))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-5)
    if cfg.get("stage") == 2:
        assert e_gpu.reducer._stream is not None  # reductions ran on the side stream


def test_offloaded_masters_are_pinned_and_fused():
    model, engine, _ = _train("cuda", ZeroConfig(stage=2, offload_optimizer=True), dtype=torch.bfloat16)
    masters = [m for row in engine.sharded.masters for m in row]
    assert all(m.device.type == "cpu" and m.is_pinned() for m in masters)
    assert engine.sharded.uses_fused
    assert all(v.device.type == "cpu" for st in engine.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v))


def _allocated() -> int:
    """Device bytes held by live tensors. cuBLAS keeps a workspace per (handle, stream) in the caching
    allocator (32 MiB on Hopper), created at the first matmul: dropped here (as torch's own leak check
    does), or the first test to run a matmul would count it as model state."""
    gc.collect()
    torch.cuda.synchronize()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("stage,offload_params", [(2, False), (3, True)])
def test_device_memory_for_model_states_meets_floor(stage, offload_params):
    torch.cuda.empty_cache()
    base = _allocated()
    cfg = dict(stage=stage, offload_optimizer=True, offload_params=offload_params)
    if stage == 3:
        cfg.update(unit_classes=["Sequential"], persist_numel=0)
    model, engine, _ = _train("cuda", ZeroConfig(**cfg), dtype=torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    held = _allocated() - base
    floor = model_state_floor(stage, numel, 1, True, offload_optimizer=True)
    if stage == 2:  # bf16 params whole on the device; grads were freed after the step
        assert held <= floor["params"] * 1.05 + 2**20, (held, floor)
    else:  # parameter shards on the host: nothing but allocator slack stays on the device between steps
        assert held <= 2**20, held


@pytest.mark.parametrize("cfg", [dict(stage=0), dict(stage=2),
                                 dict(stage=3, offload_optimizer=True, offload_params=True, unit_classes=["Sequential"],
                                      persist_numel=0)], ids=str)
def test_forward_and_backward_never_block_the_host(cfg):
    """Reductions overlap backward only if the hooks never wait for the GPU: a synchronizing call in
    forward or backward (a host tensor copied into a device buffer, .item(), a stream synchronize) raises
    here. Step 1 records the stage-3 order, step 2 also prefetches."""
    model = _model("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, opt, ZeroConfig(**cfg), compute_dtype=torch.bfloat16, device=torch.device("cuda"))
    for _ in range(2):
        x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).float().pow(2).mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.step()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_offloaded_step_on_a_device_that_is_not_the_current_one():
    """The device->host gradient copies are awaited on the engine's device, not the current one."""
    cfg = ZeroConfig(stage=2, offload_optimizer=True)
    _, _, ref = _train("cpu", cfg)
    with torch.cuda.device(0):
        _, _, got = _train("cuda:1", cfg)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-5)


def test_reduced_shards_go_to_pinned_host_memory_during_backward():
    """Offload: each shard is copied device->host on the reducer's side stream as its bucket completes
    (pinned, so the copy is asynchronous); the optimizer then reads those copies."""
    model = _model("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2, offload_optimizer=True, bucket_mb=0.1),
                        compute_dtype=torch.bfloat16, device=torch.device("cuda"))
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    hosts = [h for h in engine.reducer.host_shards if h is not None]
    assert len(hosts) == len(engine.buckets) > 1
    assert all(h.device.type == "cpu" and h.is_pinned() and h.dtype == torch.bfloat16 for h in hosts)
    engine.step()
    assert all(h is None for h in engine.reducer.host_shards)


def test_int8_blocks_on_the_device_match_the_host():
    """qwZ / qgZ quantize on the GPU where the buckets live: the device kernels give the host's blocks (each
    value within one int8 step, scales to fp32 rounding) and stay within half a step of the input."""
    from lightning_zero.engine.comm import quantize as Q

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, generator=g) * torch.tensor([[1e-3], [1.0], [1e3]])  # blocks of very different scale
    x[1, 5] = float("inf")  # non-finite stays non-finite (fp16 overflow checks see it)
    q_host, s_host = Q.quantize(x)
    q_dev, s_dev = Q.quantize(x.cuda())
    assert q_dev.device.type == "cuda" and q_dev.dtype == torch.int8
    torch.testing.assert_close(s_dev.cpu(), s_host, rtol=1e-6, atol=0)
    assert (q_dev.cpu().int() - q_host.int()).abs().max() <= 1
    y = Q.dequantize(q_dev, s_dev, 1000).cpu()
    finite = torch.isfinite(x).all(dim=1)
    bound = (s_host / 2).repeat_interleave(Q.BLOCK, dim=1)[:, :1000]
    assert ((y - x).abs() <= bound * (1 + 1e-5))[finite].all()
    assert torch.isnan(y[1, :Q.BLOCK]).all()  # the block holding inf


@pytest.mark.parametrize("cfg", [dict(stage=2), dict(stage=3, unit_classes=["Sequential"], persist_numel=0)], ids=str)
def test_background_save_stages_into_pinned_memory_and_equals_the_sync_save(tmp_path, cfg):
    """async_save on a GPU: the copies are queued on the current stream into page-locked host memory, the writer
    waits on their event; the directory is the synchronous one's, tensor for tensor."""
    from lightning_zero import checkpoint as ck
    from lightning_zero.checkpoint.async_save import AsyncCheckpointer
    from lightning_zero.checkpoint.consolidate import full_model_state

    model, engine, _ = _train("cuda", ZeroConfig(**cfg), dtype=torch.bfloat16)
    saver = AsyncCheckpointer()
    ck.save_engine_checkpoint(tmp_path / "sync", model, engine)
    record = ck.save_engine_checkpoint(tmp_path / "async", model, engine, saver=saver) and saver.records[-1]
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)  # the step after the save moves the masters
    model(x).float().pow(2).mean().backward()
    engine.step()
    saver.close()
    assert record.bytes_staged > 0 and record.written_s is not None
    a, b = (full_model_state(p, ck.read_info(p)) for p in (tmp_path / "async", tmp_path / "sync"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
