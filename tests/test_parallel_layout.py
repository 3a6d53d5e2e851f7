"""The one parallel layout (engine/layout/dims.py, engine/layout/groups.py): one table refuses, one cache makes.

* Every pair of dims is in one of two tables: the pairs refused (COMPOSE) are refused the same way by ZeroConfig,
  both strategies and the pipeline, the pairs that combine (COMPOSED) are taken by each; so is every stage a dim
  takes, and every other stage refused.
* ``ZeroConfig(tensor_parallel_size=T)`` alone gives the engine the process's (N // T, T) mesh: training equals
  the engine handed that mesh explicitly and torch DDP of the whole model (TP=2 x DP=2, 4 gloo ranks).
* The groups are made once per process in one cache: a second engine of every kind adds nothing to it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.layout.dims import COMPOSE, COMPOSED, DIMS, KNOBS, STAGES_WITH, ParallelDims
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import TP_FP32, close
from tests.helpers.tp_models import dp_batch, full_state, lm_loss, make_gpt, parallelize


def _build(kwargs: dict):
    from lightning_zero import ZeroFabricStrategy, ZeroPipelineStrategy, ZeroStrategy

    if "pipeline_parallel_size" in kwargs:
        return [lambda: ZeroPipelineStrategy(**kwargs)]
    return [lambda: ZeroConfig(**kwargs), lambda: ZeroStrategy(**kwargs), lambda: ZeroFabricStrategy(**kwargs)]


#: the pairs the table lets compose, each with the test file that runs them together against DDP
RUN_BY = {("shard", "tensor"): "test_tensor_hybrid.py", ("shard", "sequence"): "test_sequence_parallel_trainer.py"}


@pytest.mark.parametrize("a, b", list(itertools.combinations(DIMS, 2)))
def test_each_pair_of_dims_is_in_one_table(a, b):
    assert ((a, b) in COMPOSE) != ((a, b) in COMPOSED), f"{a} x {b} must be in exactly one of COMPOSE and COMPOSED"


@pytest.mark.parametrize("a, b", sorted(COMPOSE))
def test_each_refused_pair_is_refused_by_the_table_alone(a, b):
    kwargs = {KNOBS[a]: 2, KNOBS[b]: 2, "stage": 1}
    for make in _build(kwargs):
        with pytest.raises(ValueError, match=rf"{KNOBS[a]}=2 \(.*\) cannot be combined with {KNOBS[b]}=2 .*"
                                             rf"{COMPOSE[(a, b)]}\. Allowed: one of {KNOBS[a]} and {KNOBS[b]}"):
            make()


@pytest.mark.parametrize("a, b", sorted(COMPOSED))
def test_each_composed_pair_is_taken_by_every_entry_point_and_run_by_a_test(a, b):
    assert (Path(__file__).parent / RUN_BY[(a, b)]).is_file()
    for make in _build({KNOBS[a]: 2, KNOBS[b]: 2, "stage": 1}):
        make()


@pytest.mark.parametrize("dim", sorted(STAGES_WITH))
def test_each_dim_refuses_the_stages_the_table_says(dim):
    allowed, why = STAGES_WITH[dim]
    for stage in range(4):
        kwargs = {KNOBS[dim]: 2, "stage": stage}
        for make in _build(kwargs):
            if stage in allowed:
                make()
            else:
                with pytest.raises(ValueError, match=rf"ZeRO stage {stage} cannot be combined with .*{why}"):
                    make()


def test_world_divisibility_names_the_allowed_sizes():
    for dim in DIMS:
        with pytest.raises(ValueError, match=rf"{KNOBS[dim]}=3 does not divide the world of 4 rank\(s\).*"
                                             r"Allowed: 1, 2, 4"):
            ParallelDims(**{dim: 3}).check_world(4)
    ParallelDims(shard=2, tensor=None, pipeline=None).check_world(4)


# -- the engine takes its TP mesh from the config ---------------------------------------------------------------------
def _train(rank, world_size, how):
    from lightning_zero.engine.layout.groups import cached_groups, tensor_parallel_mesh

    torch.set_num_threads(1)
    mesh = tensor_parallel_mesh("cpu", 2)
    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    model = make_gpt()
    if how != "ddp":
        parallelize(model, mesh["tensor_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    if how == "config":
        engine = ZeroEngine(model, opt, ZeroConfig(stage=1, tensor_parallel_size=2))
        assert engine.tensor_parallel.mesh is mesh, "the engine made a mesh of its own"
    elif how == "mesh":
        engine = ZeroEngine(model, opt, ZeroConfig(stage=1), device_mesh=mesh)
    else:
        runner = DDP(model, process_group=mesh.get_group("data_parallel"))
    before = cached_groups()
    losses = []
    for step in range(3):
        loss = lm_loss(model if how != "ddp" else runner, dp_batch(step, 0, dp_rank, dp_size))
        loss.backward()
        if how != "ddp":
            engine.step()
        else:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    if how != "ddp":  # a second engine of the same layout reuses every group
        ZeroEngine(parallelize(make_gpt(), mesh["tensor_parallel"]), None, ZeroConfig(stage=1, tensor_parallel_size=2))
        assert cached_groups() == before, "a second engine made groups"
    return losses, full_state(model)


@pytest.mark.timeout(180)
def test_tensor_parallel_size_in_the_config_alone_equals_an_explicit_mesh_and_ddp():
    results = {how: run_distributed(_train, 4, how) for how in ("config", "mesh", "ddp")}
    for rank in range(4):
        got, explicit, ref = results["config"][rank], results["mesh"][rank], results["ddp"][rank]
        assert got[0] == explicit[0], "config-built and mesh-given engines diverged"
        for k in ref[1]:
            assert torch.equal(got[1][k], explicit[1][k]), k
            close(got[1][k], ref[1][k], f"rank {rank} {k} vs DDP", tol=TP_FP32)
        close(torch.tensor(got[0]), torch.tensor(ref[0]), "losses vs DDP", tol=TP_FP32)
