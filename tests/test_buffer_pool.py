"""Communication buffers kept across steps (engine/comm/buffer_pool.py): the pool's lending rules, and a steady
ZeRO step that makes none of its flat buffers anew while staying bit for bit the step it was."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm.buffer_pool import BufferPool
from tests.helpers.allocations import AllocationCounter
from tests.helpers.dist_utils import run_distributed


def test_a_given_back_buffer_is_lent_again_smallest_fit_first():
    pool = BufferPool(keep=2)
    a = pool.take(100, torch.float32, "cpu")
    b = pool.take(10, torch.float64, "cpu")
    assert pool.allocations == 2 and pool.nbytes == 400 + 80
    pool.give(a)
    pool.give(b)
    c = pool.take(20, torch.float32, "cpu")  # 80 bytes: b's block (80) fits and is the smaller one
    assert c.data_ptr() == b.data_ptr() and c.dtype == torch.float32 and c.numel() == 20
    d = pool.take(50, torch.bfloat16, "cpu")  # 100 bytes: only a's block
    assert d.data_ptr() == a.data_ptr() and pool.allocations == 2
    pool.give(c)
    pool.give(d)
    pool.give(torch.empty(3))  # never lent: ignored
    e = pool.take(1000, torch.float32, "cpu")  # larger than both: a new block
    assert pool.allocations == 3
    pool.give(e)  # three free, keep=2: the smallest (80 B) is dropped
    assert pool.nbytes == 4000 + 400


def test_only_cpu_buffers_are_pooled():
    pool = BufferPool()
    t = pool.take(8, torch.float32, "meta")  # an accelerator's caching allocator knows its streams: plain empty
    pool.give(t)
    assert pool.allocations == 0 and pool.nbytes == 0


def _steady_step(rank, world, stage, grad_reduce, keep=None, reshard=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 8))  # 33: padded
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = dict(unit_classes=["Linear"], reshard_after_forward=reshard) if stage == 3 else {}
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, grad_reduce=grad_reduce, **extra))
    if keep is not None:  # keep=0: every buffer made fresh, as before the pool
        engine.table.pool.keep = keep
    losses = []

    def step(t):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * t + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())

    for t in range(3):
        step(t)
    with AllocationCounter() as seen:
        step(3)
    sites = [k.split("lightning_zero/engine/")[-1] for k, n in seen.engine.items() for _ in range(n)]
    # full_master_params: stage 3 holds no parameter storage between steps (a released parameter is empty)
    return sites, losses, engine.memory_report().comm_buffers, engine.full_master_params()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,grad_reduce,reshard", [
    (1, "all_to_all", True), (2, "all_to_all", True), (2, "reduce_scatter", True), (0, "auto", True),
    (3, "all_to_all", True), (3, "all_to_all", False)])
def test_a_steady_step_makes_no_flat_buffer_anew(stage, grad_reduce, reshard):
    """After warm-up the pack, receive and gather buffers (stage 3: the unit gathers too) are the kept ones:
    what the engine still allocates is the reduced gradient shard of each bucket (it lives until the step)
    and the once-a-step used-parameter mask."""
    fresh = run_distributed(_steady_step, 2, stage, grad_reduce, 0, reshard)
    for (sites, losses, kept, params), (_, f_losses, _, f_params) in zip(
            run_distributed(_steady_step, 2, stage, grad_reduce, None, reshard), fresh):
        flat = [s for s in sites if not s.startswith("reducer.py")]
        assert flat == [], flat
        buckets = 3 if stage == 3 else 1  # stage 3: a bucket per unit (two Linears and the root)
        assert len(sites) <= buckets + 2, sites
        assert kept > 0
        assert losses == f_losses  # reusing a buffer changes no value: bit for bit the fresh-buffer run
        assert all(torch.equal(p, q) for p, q in zip(params, f_params))
