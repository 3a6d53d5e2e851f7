"""bf16 masters between steps under Fabric: the step's publish leaves every master bf16 (the bf16 parameter
itself where the states live with it) -- no fp32 copy of the shard is held until the next step -- and the
engine's memory report then counts every byte the masters and the optimizer state hold."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric

from lightning_zero import ZeroFabricStrategy
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer


def _module_storages(engine, model) -> set[int]:
    """The storages the module's parameters live in: the parameters themselves, or stage 3's unit shards."""
    if engine.partitions_params:
        return {u.shard.untyped_storage().data_ptr() for u in engine.partitioner.units if u.shard is not None}
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _held_bytes(engine, model) -> tuple[int, bool]:
    """(distinct storages of the masters, their compensation terms and the optimizer state that are not the
    module's own parameter storage; whether every master the engine calls aliased is in that storage)."""
    module = _module_storages(engine, model)
    storages: dict[int, int] = {}
    aliased_in_module = True
    for s in engine.shardeds:
        tensors = list(s.low_precision.compensation.values())
        tensors += [v for st in s.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        for m, aliased in zip((m for row in s.masters for m in row), s._aliased):
            in_module = m.untyped_storage().data_ptr() in module
            aliased_in_module &= in_module or not aliased
            if not in_module:
                tensors.append(m)
        for t in tensors:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values()), aliased_in_module


def _job(rank, world_size, stage, offload):
    strategy = ZeroFabricStrategy(stage=stage, offload_optimizer=offload, optimizer_state_dtype="bf16",
                                  master_dtype="bf16")
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size, precision="bf16-mixed")
    fabric.launch()
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model, "adamw"))
    engine = fabric.strategy.engine
    out = []
    for step in range(3):
        fabric.backward(loss_fn(model, batch(step, rank), False))
        opt.step()
        opt.zero_grad()
        masters = [m for s in engine.shardeds for row in s.masters for m in row]
        report = engine.memory_report()
        held, aliased_in_module = _held_bytes(engine, model.module)
        out.append({"dtypes": sorted({str(m.dtype) for m in masters}), "held": held,
                    "reported": report.master + report.optimizer_state, "aliased_in_module": aliased_in_module,
                    "aliased": sum(a for s in engine.shardeds for a in s._aliased)})
    fabric.strategy.teardown()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage,offload", [(1, False), (3, False), (3, True)])
def test_bf16_masters_stay_bf16_between_steps(stage, offload):
    for rank_out in run_distributed(_job, 2, stage, offload):
        for step in rank_out:
            assert step["dtypes"] == ["torch.bfloat16"], step  # no fp32 master kept after the publish
            assert step["held"] == step["reported"], step  # every byte the states hold is in the report
            # on the device the master is the parameter (its slice or unit shard), offloaded a host tensor
            assert step["aliased_in_module"] and (step["aliased"] > 0) == (not offload), step
