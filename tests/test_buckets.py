"""Shard specs and buckets on their own, in one process: ShardSpec's torch.chunk slices, a Bucket's rank-major
and parameter-major layouts (pack / unpack, local views, the single-rank all-gather, the publish's own-row skip)
and build_buckets' byte cap and order. (End to end they are covered by every parity test.)"""

import pytest
import torch

from lightning_zero.engine.grads.buckets import Bucket, build_buckets
from lightning_zero.engine.layout.sharding import ShardSpec


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
    from lightning_zero.engine.optim.publish import _own_row_in_place

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


def test_bucket_param_major_round_trip():
    b = _bucket([(2, 3), (1,), (4,)], world=1, rank=0)  # stage 0: whole parameters, one after another
    flat = b.pack_full([b.params[0], None, b.params[2]], torch.float64, extra=2)
    assert flat.numel() == b.numel + 2 == 13 and flat.dtype == torch.float64
    views = b.full_views(flat)
    assert torch.equal(views[0], b.params[0].double()) and views[1].abs().sum() == 0
    assert torch.equal(views[2], b.params[2].double())


def test_build_buckets_caps_bytes_and_runs_in_reverse_registration_order():
    params = [torch.zeros(n) for n in (4, 4, 4, 100)]  # 16 B, 16 B, 16 B, 400 B
    buckets = build_buckets(params, world_size=2, rank=0, bucket_bytes=40)
    assert [[p.numel() for p in b.params] for b in buckets] == [[100], [4, 4], [4]]
    assert [b.index for b in buckets] == [0, 1, 2]
    stage0 = build_buckets(params, world_size=2, rank=1, bucket_bytes=40, sharded=False)
    assert all(s.world_size == 1 and s.rank == 0 for b in stage0 for s in b.specs)
