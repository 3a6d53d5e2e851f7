"""Copies a CPU-only or one-rank run does not need: the one-rank gather reads the shard itself, the CPU-offload
step reads the reduced gradient shard where it already is (host memory), and one rank divides by nothing.
Each run stays bit for bit the plain single-process training it replaces."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.allocations import AllocationCounter
from tests.helpers.dist_utils import run_distributed

STEPS = 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 8))  # 33: padded


def _batch(t, rank):
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * t + rank))


def _train(rank, world, cfg):
    """``cfg`` None: plain torch AdamW, no engine (the reference). Returns the losses, the final weights, the
    engine's copy_ bytes by site during the last step and whether the host gradients are the reduced shards."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, opt, ZeroConfig(**cfg)) if cfg is not None else None
    losses, seen, aliased, held = [], AllocationCounter(), None, []
    for t in range(STEPS):
        with seen if t == STEPS - 1 else torch.no_grad():
            with torch.enable_grad():
                loss = model(_batch(t, rank)).pow(2).mean()
                loss.backward()
            if engine is not None:
                red = engine.reducer
                if red.host_grads and t == STEPS - 1:
                    engine.finalize_grads()
                    aliased = [h is g for h, g in zip(red.host_shards, red.grad_shards) if g is not None]
                engine.step()
                engine.zero_grad()
                held.append((engine.table.pool.nbytes, len(engine.table.pool._lent)))
            else:
                opt.step()
                opt.zero_grad()
        losses.append(loss.item())
    if engine is not None:  # between steps nothing is lent, and what is kept does not grow
        assert held[1:] == held[1:2] * (STEPS - 1) and held[-1][1] == 0, held
    if engine is None:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        weights = {names[id(p)]: w for p, w in zip(engine.bucket_params, engine.full_master_params())}
    sites = {k.split("lightning_zero/engine/")[-1]: v for k, v in seen.copies.items()}
    return losses, weights, sites, aliased


CONFIGS = {
    "zero3": dict(stage=3, unit_classes=["Linear"]),
    "zero3_offload": dict(stage=3, unit_classes=["Linear"], offload_optimizer=True, offload_params=True,
                          offload_kernel="user"),
    "zero2_offload": dict(stage=2, offload_optimizer=True, offload_kernel="user"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_rank_copies_only_what_it_must_and_equals_plain_training(name):
    (ref_losses, ref_weights, _, _), = run_distributed(_train, 1, None)
    (losses, weights, sites, aliased), = run_distributed(_train, 1, CONFIGS[name])
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(ref_weights[n], weights[n].reshape(ref_weights[n].shape)) for n in ref_weights)
    # the one-rank all-gather was a copy of the shard into a buffer the unpack then copied again
    assert not [s for s in sites if s.startswith("comm/collectives.py")], sites
    if aliased is not None:
        assert aliased and all(aliased)  # the optimizer reads the reduced shard itself
        assert not [s for s in sites if s.startswith("grads/reducer.py")], sites


def _two_ranks(rank, world):
    return _train(rank, world, CONFIGS["zero2_offload"])


@pytest.mark.timeout(120)
def test_cpu_offload_reads_the_reduced_shard_in_place_on_two_ranks():
    """On a CPU-only machine the reduced shard is already in host memory: no second host copy per bucket
    (a GPU run still copies it device->host as the bucket completes: tests/test_offload.py)."""
    for losses, _, sites, aliased in run_distributed(_two_ranks, 2):
        assert aliased and all(aliased)
        assert not [s for s in sites if "reducer.py" in s and "_add_shard" in s], sites
