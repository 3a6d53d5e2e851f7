"""Stage-3 units on their own, in one process: build_units (the root last, a tied weight once, every parameter in
one unit), the checked moves of a unit's and the order's lifecycle, and the gradient buckets cut per unit in
backward order with their shard views. (End to end: tests/test_stage3.py.)"""

import pytest
import torch

from lightning_zero.engine.stage3.lifecycle import OrderState, UnitState
from lightning_zero.engine.stage3.units import build_units
from tests.helpers.models import Block, TiedBlocks


def test_build_units_root_last_tied_weight_once_every_param_in_one_unit():
    model = TiedBlocks()
    units = build_units(model, world_size=2, rank=0, unit_classes=[Block])
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "<root>"]
    assert [u.index for u in units] == [0, 1, 2] and units[-1].persistent
    owned = [id(p) for u in units for p in u.params]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # tied emb/head weight: one entry
    assert units[0].layout.shard_numel == 8 + 2 and units[2].layout.shard_numel == 20
    assert all(u.state is UnitState.SHARDED and not u.gathered for u in units)


def test_unit_and_order_moves_are_checked():
    u = build_units(TiedBlocks(), 1, 0, unit_classes=[Block])[0]
    with pytest.raises(RuntimeError, match="no move from SHARDED to UNSHARDED"):
        u.move(UnitState.UNSHARDED)  # a wait on a gather never launched
    for to in (UnitState.GATHERING, UnitState.UNSHARDED, UnitState.SHARDED):
        u.move(to)
    assert OrderState.RECORDING.check(OrderState.RECORDED) is OrderState.RECORDED
    with pytest.raises(RuntimeError, match="RECORDING to VERIFIED"):
        OrderState.RECORDING.check(OrderState.VERIFIED)  # verified without a recorded order


def test_unit_gradient_buckets_in_backward_order_with_their_shard_views():
    from lightning_zero.engine.grads.bucket_table import grad_buckets_for_units

    model, world, rank = TiedBlocks(), 2, 1
    units = build_units(model, world, rank, unit_classes=[Block])
    for u in units:  # this rank's flat slice of each unit, as the partitioner cuts it
        u.shard = u.layout.pack_rank_major([p.detach() for p in u.params], torch.float32).view(world, -1)[rank]
    model.blocks[0].fc.bias.requires_grad_(False)
    managed = [p for p in model.parameters() if p.requires_grad]
    buckets, sources, owner = grad_buckets_for_units(units, managed, world, rank)
    assert [u.name for u in owner] == ["blocks.1", "blocks.0", "<root>"]  # reversed blocks, root last
    assert [b.index for b in buckets] == [0, 1, 2]
    assert [len(b.params) for b in buckets] == [2, 1, 1]  # the frozen bias is in no bucket; root: the tied weight
    for b, src in zip(buckets, sources):
        for p, spec, view in zip(b.params, b.specs, src):
            assert torch.equal(view, spec.local_slice(p.detach().reshape(-1)))
