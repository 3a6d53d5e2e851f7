"""Communication buffers reused within a backward or a step (engine/comm/buffer_pool.py): the pool's lending rules,
its bound (one buffer's worth of free blocks, none kept between phases), and a steady ZeRO step that stays bit for
bit the step it was with every buffer made fresh."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm.buffer_pool import BufferPool
from tests.helpers.allocations import AllocationCounter
from tests.helpers.dist_utils import run_distributed


def test_a_given_back_buffer_is_lent_again_smallest_fit_first():
    pool = BufferPool()
    a = pool.take(100, torch.float32, "cpu")
    b = pool.take(10, torch.float64, "cpu")
    assert pool.allocations == 2 and pool.nbytes == 400 + 80
    pool.give(a)
    pool.give(b)  # 480 free bytes > the largest buffer taken (400): the smaller block is dropped
    assert pool.nbytes == 400
    c = pool.take(20, torch.float32, "cpu")  # 80 bytes: a's block, the only one kept
    assert c.data_ptr() == a.data_ptr() and c.dtype == torch.float32 and c.numel() == 20
    d = pool.take(10, torch.bfloat16, "cpu")  # nothing free: a new block
    assert pool.allocations == 3
    pool.give(c)
    pool.give(d)
    pool.give(torch.empty(3))  # never lent: ignored
    assert pool.nbytes == 400 and pool.peak_free <= pool.largest == 400
    e = pool.take(1000, torch.float32, "cpu")  # larger than every kept block: a new one, and a larger bound
    pool.give(e)
    assert pool.nbytes == 4000 and pool.largest == 4000  # 4400 > 4000: the 400-byte block dropped
    pool.drop_free()  # the end of a backward or a step: nothing kept
    assert pool.nbytes == 0


def test_a_pool_that_keeps_nothing_lends_fresh_blocks():
    pool = BufferPool(keep=False)
    a = pool.take(100, torch.float32, "cpu")
    pool.give(a)
    assert pool.nbytes == 0 and pool.take(100, torch.float32, "cpu").data_ptr() is not None
    assert pool.allocations == 2


def test_only_cpu_buffers_are_pooled():
    pool = BufferPool()
    t = pool.take(8, torch.float32, "meta")  # an accelerator's caching allocator knows its streams: plain empty
    pool.give(t)
    assert pool.allocations == 0 and pool.nbytes == 0


def _steady_step(rank, world, stage, grad_reduce, keep=True, reshard=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 8))  # 33: padded
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = dict(unit_classes=["Linear"], reshard_after_forward=reshard) if stage == 3 else {}
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, grad_reduce=grad_reduce, **extra))
    engine.table.pool.keep = keep  # False: every buffer made fresh, as before the pool
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
    pool = engine.table.pool
    # full_master_params: stage 3 holds no parameter storage between steps (a released parameter is empty)
    return (sites, losses, engine.memory_report().comm_buffers, engine.full_master_params(),
            (pool.peak_free, pool.largest))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,grad_reduce,reshard", [
    (1, "all_to_all", True), (2, "all_to_all", True), (2, "reduce_scatter", True), (0, "auto", True),
    (3, "all_to_all", True), (3, "all_to_all", False)])
def test_a_steady_step_keeps_no_buffer_and_reuses_within_a_bound(stage, grad_reduce, reshard):
    """Between steps the engine keeps no communication buffer (its model states sit at the ZeRO floors); within a
    backward or a step the free blocks it reuses never exceed one buffer's worth (the largest it takes); and
    reusing them changes no value: bit for bit the run that makes every buffer fresh."""
    fresh = run_distributed(_steady_step, 2, stage, grad_reduce, False, reshard)
    for (sites, losses, kept, params, (peak, largest)), (f_sites, f_losses, _, f_params, _) in zip(
            run_distributed(_steady_step, 2, stage, grad_reduce, True, reshard), fresh):
        assert kept == 0  # nothing held once the step returned
        assert 0 < peak <= largest  # reused within the phase, bounded by one buffer's worth
        assert len(sites) <= len(f_sites), (sites, f_sites)  # never more allocations than fresh buffers
        assert losses == f_losses  # reusing a buffer changes no value: bit for bit the fresh-buffer run
        assert all(torch.equal(p, q) for p, q in zip(params, f_params))
