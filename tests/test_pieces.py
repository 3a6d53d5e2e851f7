"""The small pieces on their own, in one process: ShardSpec, Bucket packing, unit building, the reducer's
bucket order, the unit lifecycle's moves. (End to end they are covered by every parity test.)"""

import pytest
import torch
from torch import nn

from lightning_zero.engine.buckets import Bucket, build_buckets
from lightning_zero.engine.plan import ShardingPlan
from lightning_zero.engine.reducer import BackwardPhase, GradReducer
from lightning_zero.engine.sharding import ShardSpec
from lightning_zero.engine.stage3.lifecycle import OrderState, UnitState
from lightning_zero.engine.stage3.units import build_units


@pytest.mark.parametrize("numel,world", [(10, 4), (3, 4), (8, 2), (1, 1), (0, 3)])
def test_shard_spec_slices_tile_the_parameter(numel, world):
    specs = [ShardSpec(numel, world, r) for r in range(world)]
    assert all(s.shard_numel == -(-numel // world) for s in specs)
    flat = torch.arange(numel)
    # rank order concatenates back to the parameter: the torch.chunk layout, empty slices allowed
    assert torch.equal(torch.cat([s.local_slice(flat) for s in specs]), flat)
    assert sum(s.shard_len for s in specs) == numel and all(0 <= s.shard_len <= s.shard_numel for s in specs)
    assert [s.hi for s in specs][-1] == numel


def _bucket(shapes, world, rank):
    params = [torch.randn(*s) for s in shapes]
    return Bucket(0, params, [ShardSpec(p.numel(), world, rank) for p in params])


def test_bucket_rank_major_round_trip_and_local_views():
    world = 3
    b = _bucket([(5,), (2, 3), (1,)], world, rank=1)
    tensors = [p.clone() for p in b.params]
    flat = b.pack_rank_major(tensors, torch.float32)
    assert flat.numel() == world * b.shard_numel == world * (2 + 2 + 1)
    outs = [torch.empty_like(t) for t in tensors]
    b.unpack_rank_major(flat, outs)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    # rank 1's row holds exactly its slice of every parameter, the padding zero
    row = flat.view(world, b.shard_numel)[1]
    for view, t, spec in zip(b.local_views(row), tensors, b.specs):
        assert torch.equal(view, spec.local_slice(t.reshape(-1)))
    assert row[b.offsets[2]:].abs().sum() == 0  # the 1-element parameter lives on rank 0 only
    # None packs as zeros; extra columns are left to the caller
    assert flat.numel() + world == b.pack_rank_major([None, tensors[1], None], torch.float32, extra=1).numel()
    assert b.pack_rank_major([None, None, None], torch.float32).abs().sum() == 0


def _rank_major_reference(tensors, world):
    """The layout by definition: row r = every parameter's r-th padded chunk, in bucket order."""
    rows = [[] for _ in range(world)]
    for t in tensors:
        flat = t.reshape(-1).float()
        s = -(-flat.numel() // world)
        padded = torch.cat([flat, torch.zeros(world * s - flat.numel())])
        for r in range(world):
            rows[r].append(padded[r * s:(r + 1) * s])
    return torch.stack([torch.cat(r) for r in rows])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bucket_one_copy_pack_unpack_matches_the_layout(world):
    """[Note: one copy per bucket]: the batched pack / unpack equal the layout written out element by element,
    with even and padded sizes, a None, a cast, a non-contiguous input and a non-contiguous output."""
    shapes = [(8, 4), (7,), (3, 5), (1,), (4, 4)]
    b = _bucket(shapes, world, rank=world - 1)
    tensors = [p.clone() for p in b.params]
    tensors[4] = torch.randn(4, 4).t()  # non-contiguous input
    ref = _rank_major_reference(tensors, world)
    grid = b.pack_rank_major(tensors, torch.float32).view(world, -1)
    assert torch.equal(grid, ref)
    with_none = b.pack_rank_major([tensors[0], None] + tensors[2:], torch.float32, extra=2).view(world, -1)
    assert torch.equal(with_none[:, : b.shard_numel], _rank_major_reference([tensors[0], torch.zeros(7)] + tensors[2:], world))
    half = b.pack_rank_major([t.bfloat16() for t in tensors], torch.float32).view(world, -1)  # cast on the way in
    assert torch.equal(half, _rank_major_reference([t.bfloat16() for t in tensors], world))
    outs = [torch.full_like(t, float("nan")) for t in tensors[:4]] + [torch.empty(4, 4).t()]  # last: non-contiguous
    b.unpack_rank_major(grid.reshape(-1), outs)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    # the all-gather's send chunk: this rank's slices, each padded with zeros, None as zeros
    local = [spec.local_slice(t.reshape(-1)) for t, spec in zip(tensors, b.specs)]
    local[1] = None
    _, flat = b.all_gather(local, torch.float32)  # no process group: the chunk lands first in the output
    expect = _rank_major_reference([tensors[0], torch.zeros(7)] + tensors[2:], world)[world - 1]
    assert torch.equal(flat[: b.shard_numel], expect)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_unpack_skipping_the_own_row_keeps_what_the_step_wrote(rank):
    """publish: a rank whose masters are its parameters' slices skips its own row of the gathered buffer
    (the step wrote it in place); every other row, and a padded parameter whole, still arrive."""
    from lightning_zero.engine.publish import _own_row_in_place

    world = 3
    b = _bucket([(6, 2), (7,), (3,), (7,)], world, rank)  # two padded parameters with equal ShardSpecs
    tensors = [p.clone() for p in b.params]
    flat = b.pack_rank_major(tensors, torch.float32)
    outs = [torch.zeros_like(t) for t in tensors]
    for o, t, spec in zip(outs, tensors, b.specs):  # this rank's slices: what its step wrote in place
        o.view(-1)[spec.lo:spec.hi] = t.view(-1)[spec.lo:spec.hi]
    mark = flat.view(world, -1)[rank].clone()
    flat.view(world, -1)[rank] = float("nan")  # the skipped row is never read (except for padded params)
    b.unpack_rank_major(flat, outs, skip_rank=rank)
    assert torch.equal(outs[0], tensors[0])  # even-sized: own row untouched, the others copied
    flat.view(world, -1)[rank] = mark
    outs2 = [torch.zeros_like(t) for t in tensors]
    for o, t, spec in zip(outs2, tensors, b.specs):
        o.view(-1)[spec.lo:spec.hi] = t.view(-1)[spec.lo:spec.hi]
    b.unpack_rank_major(flat, outs2, skip_rank=rank)
    assert all(torch.equal(o, t) for o, t in zip(outs2, tensors))
    # the detection: masters that are the parameters' slices skip; separate copies or qwZ do not
    aliased = [p.view(-1)[spec.lo:spec.hi] for p, spec in zip(b.params, b.specs)]
    assert _own_row_in_place(aliased, b, quantized=False) == rank
    assert _own_row_in_place(aliased, b, quantized=True) is None
    assert _own_row_in_place([m.clone() for m in aliased], b, quantized=False) is None


def test_bucket_all_gather_single_rank_rebuilds_full_tensors():
    b = _bucket([(4,), (3, 2)], 1, 0)
    work, flat = b.all_gather([p.reshape(-1) for p in b.params], torch.float64)
    assert work is None and flat.dtype == torch.float64
    assert all(torch.equal(f, p.double()) for f, p in zip(b.full_tensors(flat), b.params))


def test_build_buckets_caps_bytes_and_runs_in_reverse_registration_order():
    params = [torch.zeros(n) for n in (4, 4, 4, 100)]  # 16 B, 16 B, 16 B, 400 B
    buckets = build_buckets(params, world_size=2, rank=0, bucket_bytes=40)
    assert [[p.numel() for p in b.params] for b in buckets] == [[100], [4, 4], [4]]
    assert [b.index for b in buckets] == [0, 1, 2]
    stage0 = build_buckets(params, world_size=2, rank=1, bucket_bytes=40, sharded=False)
    assert all(s.world_size == 1 and s.rank == 0 for b in stage0 for s in b.specs)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_build_units_root_last_tied_weight_once_every_param_in_one_unit():
    model = _Tied()
    units = build_units(model, world_size=2, rank=0, unit_classes=[_Block])
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "<root>"]
    assert [u.index for u in units] == [0, 1, 2] and units[-1].persistent
    owned = [id(p) for u in units for p in u.params]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # tied emb/head weight: one entry
    assert units[0].layout.shard_numel == 8 + 2 and units[2].layout.shard_numel == 20
    assert all(u.state is UnitState.SHARDED and not u.gathered for u in units)


def test_unit_and_order_moves_are_checked():
    u = build_units(_Tied(), 1, 0, unit_classes=[_Block])[0]
    with pytest.raises(RuntimeError, match="no move from SHARDED to UNSHARDED"):
        u.move(UnitState.UNSHARDED)  # a wait on a gather never launched
    for to in (UnitState.GATHERING, UnitState.UNSHARDED, UnitState.SHARDED):
        u.move(to)
    assert OrderState.RECORDING.check(OrderState.RECORDED) is OrderState.RECORDED
    with pytest.raises(RuntimeError, match="RECORDING to VERIFIED"):
        OrderState.RECORDING.check(OrderState.VERIFIED)  # verified without a recorded order


class _Reversed(nn.Module):
    """``first`` is registered first but runs last: its gradients are ready before ``second``'s."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 2), nn.Linear(4, 3)

    def forward(self, x):
        return self.first(self.second(x))


def test_reducer_launches_in_bucket_order_whatever_order_gradients_complete():
    torch.manual_seed(0)
    model, ref = _Reversed(), _Reversed()
    ref.load_state_dict(model.state_dict())
    buckets = build_buckets(list(model.parameters()), world_size=1, rank=0, bucket_bytes=1)  # one param each
    # reverse registration: bucket 0 = second.bias, 1 = second.weight, 2 = first.bias, 3 = first.weight
    events = []

    class Recording(GradReducer):
        def _launch(self, b):
            events.append(("launch", b.index))
            super()._launch(b)

    reducer = Recording(buckets, ShardingPlan.for_stage(1), reduce_dtype=None,
                        on_bucket_complete=lambda i: events.append(("done", i)))
    x = torch.randn(5, 4)
    assert reducer.phase is BackwardPhase.IDLE
    model(x).sum().backward()
    assert reducer.phase is BackwardPhase.IDLE and not reducer.in_backward
    launches = [i for kind, i in events if kind == "launch"]
    done = [i for kind, i in events if kind == "done"]
    assert launches == [0, 1, 2, 3]
    assert set(done[:2]) == {2, 3}  # first's gradients completed first ...
    assert events.index(("launch", 0)) > events.index(("done", 0))  # ... but waited for bucket 0
    ref(x).sum().backward()
    ref_grads = [p.grad.reshape(-1) for p in reversed(list(ref.parameters()))]
    for shard, g in zip(reducer.grad_shards, ref_grads):
        torch.testing.assert_close(shard, g, rtol=1e-5, atol=0)
    reducer.remove_hooks()


def test_hydra_strategy_presets_agree_with_the_preset_table():
    from pathlib import Path

    import yaml

    from lightning_zero.engine.config import PRESETS
    from lightning_zero.tools.estimate import SETTINGS

    conf = Path(__file__).resolve().parents[1] / "conf" / "strategy"
    yamls = {f.stem: yaml.safe_load(f.read_text()) for f in conf.glob("*.yaml")}
    assert sorted(yamls) == sorted(PRESETS) == sorted(SETTINGS.values())
    for name, kw in PRESETS.items():
        y = yamls[name]
        assert y["name"] == name
        for key in ("stage", "offload_optimizer", "offload_params"):
            assert y[key] == kw.get(key, False), (name, key)


def test_bucket_param_major_round_trip():
    b = _bucket([(2, 3), (1,), (4,)], world=1, rank=0)  # stage 0: whole parameters, one after another
    flat = b.pack_full([b.params[0], None, b.params[2]], torch.float64, extra=2)
    assert flat.numel() == b.numel + 2 == 13 and flat.dtype == torch.float64
    views = b.full_views(flat)
    assert torch.equal(views[0], b.params[0].double()) and views[1].abs().sum() == 0
    assert torch.equal(views[2], b.params[2].double())


def test_unit_gradient_buckets_in_backward_order_with_their_shard_views():
    from lightning_zero.engine.stage3.units import grad_buckets_for_units

    model, world, rank = _Tied(), 2, 1
    units = build_units(model, world, rank, unit_classes=[_Block])
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


def test_reducer_no_sync_accumulates_then_finalize_reduces_the_sum():
    from lightning_zero.engine.reducer import GradSync

    torch.manual_seed(0)
    x = torch.randn(5, 4)
    for stage, collectives_under_no_sync in ((1, 0), (2, 4)):
        model, ref = _Reversed(), _Reversed()
        ref.load_state_dict(model.state_dict())
        buckets = build_buckets(list(model.parameters()), world_size=1, rank=0, bucket_bytes=1)
        launched = []

        class Recording(GradReducer):
            def _launch(self, b):
                launched.append(b.index)
                super()._launch(b)

        reducer = Recording(buckets, ShardingPlan.for_stage(stage), reduce_dtype=None)
        assert reducer.sync is GradSync.BOUNDARY
        with reducer.no_sync():
            assert reducer.sync is GradSync.ACCUMULATE and not reducer.sync_enabled
            model(x).sum().backward()
            model(x).sum().backward()
        assert reducer.sync is GradSync.BOUNDARY and reducer.phase is BackwardPhase.IDLE
        assert len(launched) == 2 * collectives_under_no_sync  # stage 1: nothing; stage 2: every bucket
        reducer.finalize()  # stage 1: the accumulated sum is reduced now, once per bucket
        assert len(launched) == (4 if stage == 1 else 8)
        (ref(x).sum() * 2).backward()
        for shard, p in zip(reducer.grad_shards, reversed(list(ref.parameters()))):
            torch.testing.assert_close(shard, p.grad.reshape(-1), rtol=1e-5, atol=0)
        reducer.remove_hooks()


def test_order_check_is_named_and_the_config_keeps_the_users_string():
    from lightning_zero.engine import ZeroConfig
    from lightning_zero.engine.stage3.lifecycle import OrderCheck

    assert ZeroConfig(stage=3).order_check == "strict"
    assert ZeroConfig(stage=3, order_check=OrderCheck.ALWAYS).order_check == "always"
    assert OrderCheck.parse("off") is OrderCheck.OFF
    with pytest.raises(ValueError, match="order_check must be one of 'strict', 'always', 'off'; got 'sometimes'"):
        ZeroConfig(stage=3, order_check="sometimes")


def test_engine_mode_and_partitioning_are_named():
    from lightning_zero.engine import EngineMode, ZeroConfig, ZeroEngine

    model = _Tied()
    train = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2))
    assert train.mode is EngineMode.TRAIN and not train.partitions_params
    train.remove()
    evaluation = ZeroEngine(_Tied(), None, ZeroConfig(stage=3, unit_classes=[_Block]))
    assert evaluation.mode is EngineMode.EVAL_ONLY and evaluation.partitions_params
    assert evaluation.master_items() == [] and len(evaluation.unmanaged_shard_items()) == 5  # tied: once
    evaluation.remove()  # the module is handed back whole
    assert not evaluation.partitions_params


def test_one_count_of_skipped_steps_shared_by_scaler_engine_and_precision_plugin():
    from lightning_zero import ZeroPrecision
    from lightning_zero.engine import StepCounters, ZeroConfig, ZeroEngine

    model = _Tied()
    fp16 = ZeroPrecision("16-mixed")
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=1),
                        compute_dtype=torch.float16, loss_scaler=fp16.loss_scaler)
    fp16.attach(engine)
    assert engine.counters is fp16.counters is fp16.loss_scaler.counters
    (model.head(model.emb(torch.tensor([1, 2]))).float().sum() * float("inf")).backward()
    assert engine.step() is False
    assert engine.skipped_steps == fp16.skipped_steps == fp16.loss_scaler.skipped_steps == 1
    fp16.load_state_dict({"loss_scaler": fp16.loss_scaler.state_dict(), "skipped_steps": 7})
    assert engine.skipped_steps == fp16.loss_scaler.state_dict()["skipped_steps"] == 7  # nothing copied
    engine.remove()
    assert fp16.skipped_steps == 7  # the count outlives the engine

    bf16 = ZeroPrecision("bf16-mixed")
    other = _Tied()
    engine = ZeroEngine(other, torch.optim.SGD(other.parameters(), lr=0.1), ZeroConfig(stage=1),
                        compute_dtype=torch.bfloat16, check_finite=True)
    bf16.attach(engine)
    assert engine.counters is bf16.counters and isinstance(bf16.counters, StepCounters)
    bf16.load_state_dict({"skipped_steps": 3})
    assert engine.skipped_steps == 3
    engine.remove()
    with pytest.raises(TypeError, match="loss_scaler must be a DynamicLossScaler or a StaticLossScaler"):
        ZeroEngine(_Tied(), torch.optim.SGD(_Tied().parameters(), lr=0.1), loss_scaler=object())
