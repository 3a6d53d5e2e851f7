"""ZeroStrategy under a real Lightning Trainer (CPU, gloo, fork launcher) against Lightning's DDP.

Every fit runs the same LightningModule (ParityNet: tied weights, frozen/unused/sometimes-used params,
a 1-element param, a buffer) on the same per-rank data (Lightning's DistributedSampler; for training it always shuffles, seed 0). Each rank
writes its per-micro-batch losses, final full parameters and per-batch collective counts to a file; the
test process compares ZeRO against the DDP reference (cached per optimizer/accumulation/clip/devices).
"""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from lightning_zero import ZeroStrategy
from tests.helpers.lightning_parity import MAX_STEPS, compare_rank_files as _compare, fit_parity_module as _fit

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("strategy_parity")


_REF_CACHE: dict[tuple, list[dict]] = {}


@pytest.fixture(scope="module")
def ddp_reference(workdir):
    def get(opt_kind="adamw", accum=1, clip=None, devices=2):
        key = (opt_kind, accum, clip, devices)
        if key not in _REF_CACHE:
            strategy = DDPStrategy(start_method="fork", find_unused_parameters=True)
            _REF_CACHE[key] = _fit(workdir, strategy, opt_kind, accum, clip, devices)
        return _REF_CACHE[key]

    yield get
    _REF_CACHE.clear()


def _non_boundary_comm(res: dict, accum: int) -> list[int]:
    return [n for idx, n in res["batch_comm"] if idx % accum != accum - 1]


# -- plain runs: stages 0/1/2, AdamW with two param groups + LambdaLR -----------------------------------------
@pytest.mark.parametrize(
    "strategy",
    ["zero0_fork", "zero1_fork", "zero2_fork"],
)
def test_plain_stage_matches_ddp(workdir, ddp_reference, strategy):
    _compare(_fit(workdir, strategy), ddp_reference())


@pytest.mark.parametrize("stage", [1, 2])
def test_sgd_momentum_matches_ddp(workdir, ddp_reference, stage):
    _compare(_fit(workdir, ZeroStrategy(stage=stage, start_method="fork"), opt_kind="sgd"), ddp_reference("sgd"))


# -- accumulation + norm clipping (clip goes through the engine's global norm) ----------------------------------------
ACCUM_CASES = [(s, a) for a in (2, 3) for s in (0, 1, 2)]


@pytest.mark.parametrize("stage,accum", ACCUM_CASES, ids=[f"stage{s}-acc{a}" for s, a in ACCUM_CASES])
def test_accumulation_with_clipping_matches_ddp(workdir, ddp_reference, stage, accum):
    strategy = ZeroStrategy(stage=stage, start_method="fork", broadcast_buffers=False)
    zero = _fit(workdir, strategy, accum=accum, clip=0.5)
    _compare(zero, ddp_reference(accum=accum, clip=0.5))
    for rank, res in enumerate(zero):
        assert len(res["batch_comm"]) == MAX_STEPS * accum
        non_boundary = _non_boundary_comm(res, accum)
        assert len(non_boundary) == MAX_STEPS * (accum - 1)
        if stage in (0, 1):
            assert all(n == 0 for n in non_boundary), (
                f"stage {stage} rank {rank} issued collectives on non-boundary micro-batches: {res['batch_comm']}"
            )
        else:
            assert all(n > 0 for n in non_boundary), "stage 2 reduces every micro-batch into its gradient shard"
        boundary = [n for idx, n in res["batch_comm"] if idx % accum == accum - 1]
        assert all(n > 0 for n in boundary), "the optimizer step must communicate"


def test_broadcast_buffers_costs_one_broadcast_per_training_step(workdir, ddp_reference):
    zero = _fit(workdir, ZeroStrategy(stage=1, start_method="fork"), accum=2, clip=0.5)
    _compare(zero, ddp_reference(accum=2, clip=0.5))
    for res in zero:
        # one flat broadcast of the buffers per training_step; nothing else on non-boundary micro-batches
        assert _non_boundary_comm(res, 2) == [1] * MAX_STEPS


# -- optimizer offload ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["zero1_offload_fork", "zero2_offload_fork"])
def test_offload_matches_ddp(workdir, ddp_reference, strategy):
    _compare(_fit(workdir, strategy, accum=2, clip=0.5), ddp_reference(accum=2, clip=0.5))


# -- one process -----------------------------------------------------------------------------------------------------
def test_world_size_one_stage2_matches_ddp(workdir, ddp_reference):
    zero = _fit(workdir, ZeroStrategy(stage=2, start_method="fork"), accum=2, clip=0.5, devices=1)
    _compare(zero, ddp_reference(accum=2, clip=0.5, devices=1))
    assert all(n == 0 for _, n in zero[0]["batch_comm"]), "a world of one issues no collective"
