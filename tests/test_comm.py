"""Communication of stages 1-2: the gradient reduction chosen per backend, the publish overlapped with the
next forward, and comm_report(). 2 gloo ranks, fp32, AdamW; every comparison between our own modes is bit
for bit, against torch DDP at rtol 1e-5.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_zero import checkpoint as ck
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm import collectives as C
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer
from tests.helpers.parity import UNITS, check_parity
from tests.helpers.parity import train_parity_net as _parity_train
from tests.helpers.zoo_models import ZOO

STEPS = 3


def _train(make, batch_of, loss_of, cfg: ZeroConfig, rank: int, probe=None):
    torch.manual_seed(0)
    model = make()
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, batch_of(step, rank))
        loss.backward()
        engine.step()
        losses.append(loss.item())
        if probe is not None:
            probe(model, engine)
    model.eval()
    with torch.no_grad():  # an evaluation forward right after a step
        losses.append(loss_of(model, batch_of(STEPS, rank)).item())
    return engine, losses


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parity_net(step, rank):
    return batch(step, rank)


def _parity_loss(model, tokens):
    return loss_fn(model, tokens, True)


# -- the gradient reduction per backend ------------------------------------------------------------------------
def _grad_reduce_job(rank, world_size):
    out = {}
    for stage in (1, 2):
        for mode in ("reduce_scatter", "all_reduce", "all_to_all", "auto"):
            C.stats.reset()
            engine, losses = _train(lambda: make_model(3), _parity_net, _parity_loss,
                                    ZeroConfig(stage=stage, grad_reduce=mode), rank)
            out[(stage, mode)] = dict(losses=losses, state=_state(engine.module), chosen=engine.reducer.mode,
                                      ops=sorted(op for op, _ in engine.comm_report().rows))
    return out


@functools.lru_cache(maxsize=None)
def _grad_reduce_runs():
    return run_distributed(_grad_reduce_job, 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mode", ["all_reduce", "all_to_all"])
def test_gradient_reductions_give_identical_numbers(stage, mode):
    # on 2 ranks every mode adds the same two numbers per element: bit for bit, whatever the collective
    for res in _grad_reduce_runs():
        rs, other = res[(stage, "reduce_scatter")], res[(stage, mode)]
        assert rs["losses"] == other["losses"]
        for k, v in rs["state"].items():
            assert torch.equal(other["state"][k], v), k
        # the forced choices really differ on the wire
        assert "reduce_scatter" in rs["ops"] and mode in other["ops"]
        assert "reduce_scatter" not in other["ops"]


@pytest.mark.timeout(120)
def test_auto_picks_all_to_all_on_gloo():
    for res in _grad_reduce_runs():
        for stage in (1, 2):
            assert res[(stage, "auto")]["chosen"] == "all_to_all"
            assert res[(stage, "auto")]["losses"] == res[(stage, "all_to_all")]["losses"]
            assert "all_reduce" not in res[(stage, "auto")]["ops"]


def test_grad_reduce_refuses_unknown_values():
    with pytest.raises(ValueError, match="grad_reduce must be one of 'auto', 'reduce_scatter', 'all_reduce', "
                                         "'all_to_all'"):
        ZeroConfig(grad_reduce="ring")


# the all-to-all reduce-scatter forced, against torch DDP: accumulation, clipping, rank-dependent unused
# parameters and several buckets (tiny cap); at 4 ranks the sums are ordered differently from DDP's ring
A2A_CASES = {
    (2, 1): dict(stage=1), (2, 2): dict(stage=2),
    (2, 3): dict(stage=3, unit_classes=UNITS, persist_numel=0),
    (4, 2): dict(stage=2),
}


def _a2a_parity_job(rank, world_size, stages):
    ref = _parity_train(rank, "adamw", 2, 0.5, False)
    out = {}
    for stage in stages:
        C.stats.reset()
        cfg = ZeroConfig(grad_reduce="all_to_all", bucket_mb=0.0004, **A2A_CASES[(world_size, stage)])
        out[stage] = (_parity_train(rank, "adamw", 2, 0.5, True, cfg=cfg), dict(C.stats.calls))
    return ref, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,stages", [(2, (1, 2, 3)), (4, (2,))])
def test_all_to_all_reduction_matches_ddp(world_size, stages):
    for ref, out in run_distributed(_a2a_parity_job, world_size, stages):
        for stage, (run, calls) in out.items():
            check_parity(run, ref, f"stage {stage}")
            assert calls["all_to_all"] > 0 and "reduce_scatter" not in calls, (stage, calls)


# -- the publish overlapped with the next forward ----------------------------------------------------------------
def _stale_after_step(model, engine):
    """Right after step(): the gathers are still in flight (step() did not block on them)."""
    return engine.publisher is not None and engine.publisher.pending


def _overlap_job(rank, world_size, tmp):
    out = {}
    for name in ("gpt2", "t5"):
        make, batch_of, loss_of = ZOO[name]
        for stage in (1, 2):
            runs = {}
            for overlap in (False, True):
                pending = []
                engine, losses = _train(make, batch_of, loss_of, ZeroConfig(stage=stage, overlap_publish=overlap),
                                        rank, probe=lambda m, e: pending.append(_stale_after_step(m, e)))
                runs[overlap] = dict(losses=losses, state=_state(engine.module), pending=pending,
                                     waits=engine.publisher.waits_in_forward if engine.publisher else 0)
            out[(name, stage)] = runs
    # a checkpoint and a state dict taken right after a step, while the publish is still in flight
    for overlap in (False, True):
        torch.manual_seed(0)
        model = make_model(5)
        engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=2, overlap_publish=overlap))
        for step in range(2):
            _parity_loss(model, batch(step, rank)).backward()
            engine.step()
        was_pending = engine.publisher is not None and engine.publisher.pending
        sd = _state(model)  # module.state_dict() first: its hook is what waits here
        out[("ckpt", overlap)] = dict(state=sd, was_pending=was_pending, path=f"{tmp}/ckpt_{overlap}")
        for step in range(2, 3):  # ... and a checkpoint right after the next step
            _parity_loss(model, batch(step, rank)).backward()
            engine.step()
        out[("ckpt", overlap)]["pending_at_save"] = engine.publisher is not None and engine.publisher.pending
        ck.save_engine_checkpoint(out[("ckpt", overlap)]["path"], model, engine, {"global_step": 3})
    return out


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    return run_distributed(_overlap_job, 2, str(tmp))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,stage", [("gpt2", 1), ("gpt2", 2), ("t5", 1), ("t5", 2)])
def test_overlapped_publish_equals_the_blocking_one(overlap_runs, name, stage):
    for res in overlap_runs:
        blocking, overlapped = res[(name, stage)][False], res[(name, stage)][True]
        assert overlapped["losses"] == blocking["losses"]
        for k, v in blocking["state"].items():
            assert torch.equal(overlapped["state"][k], v), k
        assert all(overlapped["pending"]), "step() returned with the all-gathers still in flight"
        assert overlapped["waits"] > 0, "the forward pre-hooks waited for the buckets"
        assert not any(blocking["pending"])


@pytest.mark.timeout(300)
def test_checkpoint_and_state_dict_right_after_a_step(overlap_runs):
    from lightning_zero.checkpoint.consolidate import consolidate

    for rank, res in enumerate(overlap_runs):
        blocking, overlapped = res[("ckpt", False)], res[("ckpt", True)]
        assert overlapped["was_pending"] and overlapped["pending_at_save"]
        for k, v in blocking["state"].items():
            assert torch.equal(overlapped["state"][k], v), k
    files = {}
    for overlap in (False, True):
        out = overlap_runs[0][("ckpt", overlap)]["path"] + ".pt"
        consolidate(overlap_runs[0][("ckpt", overlap)]["path"], out)
        files[overlap] = torch.load(out, weights_only=True)
    for k, v in files[False].items():
        assert torch.equal(files[True][k], v), k


# -- comm_report --------------------------------------------------------------------------------------------
def _report_job(rank, world_size):
    out = {}
    for stage, mode in ((0, "auto"), (2, "reduce_scatter"), (2, "all_reduce"), (2, "all_to_all")):
        model = make_model(1)
        engine = ZeroEngine(model, make_optimizer(model, "adamw"),
                            ZeroConfig(stage=stage, grad_reduce=mode, broadcast_buffers=False))
        for step in range(2):
            _parity_loss(model, batch(step, rank)).backward()
            engine.step()
        r = engine.comm_report()
        out[(stage, mode)] = dict(rows=r.rows, buckets=[(b.numel, b.shard_numel, len(b.params)) for b in engine.buckets])
    return out


@pytest.mark.timeout(120)
def test_comm_report_counts_one_step_by_collective_and_group():
    for res in run_distributed(_report_job, 2):
        n = 2
        buckets = res[(0, "auto")]["buckets"]
        calls, payload, wire = res[(0, "auto")]["rows"][("all_reduce", "world")]
        # stage 0 = DDP: every bucket (plus one used-flag per parameter) all-reduced once, fp32; a ring
        # all-reduce sends 2 (N-1) / N of it
        assert calls == len(buckets)
        assert payload == sum(4 * (numel + k) for numel, _, k in buckets)
        assert wire == payload * 2 * (n - 1) // n
        rs = res[(2, "reduce_scatter")]["rows"]
        bks = res[(2, "reduce_scatter")]["buckets"]
        assert rs[("reduce_scatter", "world")][1] == sum(4 * n * (s + k) for _, s, k in bks)
        # the publish: this rank's fp32 chunk of every bucket, sent to the N-1 others
        assert rs[("all_gather", "world")][:2] == [len(bks), sum(4 * s for _, s, _ in bks)]
        assert rs[("all_gather", "world")][2] == (n - 1) * sum(4 * s for _, s, _ in bks)
        # forced to all_reduce: one all-reduce per bucket, no reduce-scatter
        ar = res[(2, "all_reduce")]["rows"]
        assert ("reduce_scatter", "world") not in ar
        assert ar[("all_reduce", "world")][0] == len(bks)
        # forced to all_to_all: one all-to-all per bucket carrying a reduce-scatter's payload and wire bytes
        # (this rank's own row stays home: (N-1)/N of the rows travel)
        a2a = res[(2, "all_to_all")]["rows"]
        assert {op for op, _ in a2a} == {"all_to_all", "all_gather"}, a2a
        assert a2a[("all_to_all", "world")][:2] == [len(bks), sum(4 * n * (s + k) for _, s, k in bks)]
        assert a2a[("all_to_all", "world")][2] == a2a[("all_to_all", "world")][1] * (n - 1) // n


def test_all_to_all_reaches_the_engine_from_hydra_the_strategy_and_fabric():
    from lightning_zero import ZeroStrategy
    from lightning_zero.lightning.fabric_strategy import ZeroFabricStrategy
    from tests.helpers.hydra_recipe import compose_recipe  # puts examples/ on sys.path (not a package)
    from t5_config import build_strategy  # one module object: the recipe's schema is registered once

    hydra = build_strategy(compose_recipe("strategy=zero2", "strategy.grad_reduce=all_to_all"))
    assert hydra.zero_config.grad_reduce == "all_to_all"
    assert ZeroStrategy(stage=1, grad_reduce="all_to_all").zero_config.grad_reduce == "all_to_all"
    assert ZeroFabricStrategy(stage=2, grad_reduce="all_to_all").zero_config.grad_reduce == "all_to_all"
    with pytest.raises(ValueError, match="grad_reduce must be one of"):
        build_strategy(compose_recipe("strategy=zero2", "strategy.grad_reduce=alltoall"))
