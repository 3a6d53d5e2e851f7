"""1-bit compression kernels and the error-compensated compressed all-reduce (engine/optim/onebit/).

The distributed exchange is held bit for bit to a single-process reference of the same algorithm
(same signs, scales and error buffers) at 2 and 4 gloo ranks."""

import numpy as np
import pytest
import torch

from lightning_zero.engine.comm import collectives as C
from lightning_zero.engine.optim.onebit import compress as K
from lightning_zero.engine.optim.onebit import exchange as X
from tests.helpers.dist_utils import run_distributed


def test_pack_unpack_round_trip_matches_numpy_packbits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * 37, generator=g)
    x[::5] = 0.0  # sign(0) is +1
    packed = K.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 37
    assert np.array_equal(packed.numpy(), np.packbits((x >= 0).numpy()))
    signs = K.unpack_signs(packed)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(K.pack_signs(K.unpack_signs(every_byte)), every_byte)
    with pytest.raises(ValueError, match="multiple of 8"):
        K.pack_signs(torch.ones(9))


def test_chunk_scales_are_segment_rms_and_keep_the_norm():
    layout = X.ChunkLayout([5, 40, 1], world_size=2, device=torch.device("cpu"))
    assert layout.padded == [16, 48, 16] and layout.chunks == [8, 24, 8] and layout.columns == 40
    rows = torch.randn(2, layout.columns)
    packed, scales, q = K.compress(rows, layout.seg, layout.seg_len)
    for j in range(2):
        for k, seg in enumerate(rows[j].split(layout.chunks)):
            assert torch.allclose(scales[j, k], seg.norm() / seg.numel() ** 0.5)
            assert torch.allclose(q[j].split(layout.chunks)[k].norm(), seg.norm())
    assert torch.equal(K.decompress(packed, scales, layout.seg), q)


def test_error_feedback_sums_to_the_true_value():
    """Sum over steps of what was sent == sum of the true values - the last residual (exactly, up to fp32
    rounding); without feedback the sums drift apart."""
    layout = X.ChunkLayout([300], world_size=1, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    err = torch.zeros(1, layout.columns)
    sent, true, plain = torch.zeros_like(err), torch.zeros_like(err), torch.zeros_like(err)
    for _ in range(200):
        x = layout.to_rows([torch.randn(300, generator=g) * 0.1 + 0.05])
        _, _, q = K.compress_with_feedback(x, err, layout.seg, layout.seg_len)
        sent += q
        true += x
        plain += X.plain_compress(layout, x)
    assert torch.allclose(sent + err, true, atol=1e-4)
    assert (sent - true).abs().max() <= err.abs().max() + 1e-4  # bounded by one residual, not growing
    assert (plain - true).abs().max() > 10 * (sent - true).abs().max()


def test_layout_round_trip():
    layout = X.ChunkLayout([7, 3 * 5, 64], world_size=4, device=torch.device("cpu"))
    ts = [torch.randn(7), torch.randn(3, 5), torch.randn(8, 8)]
    back = layout.from_rows(layout.to_rows(ts))
    for t, b in zip(ts, back):
        assert torch.equal(b[: t.numel()], t.reshape(-1)) and not b[t.numel():].any()


SHAPES = [(13,), (4, 9), (64,), (1,)]


def _inputs(world, steps):
    g = torch.Generator().manual_seed(7)
    return [[[torch.randn(s, generator=g) for s in SHAPES] for _ in range(world)] for _ in range(steps)]


def _dist_exchange(rank, world, steps):
    layout = X.ChunkLayout([int(np.prod(s)) for s in SHAPES], world, torch.device("cpu"))
    werr = torch.zeros(world, layout.columns)
    serr = torch.zeros(1, layout.columns)
    outs = []
    before = C.stats.snapshot()
    for step in _inputs(world, steps):
        outs.append(X.compressed_all_reduce(layout, layout.to_rows(step[rank]), werr, serr))
    after = C.stats.snapshot()
    sent = {k: [a - b for a, b in zip(v, before.get(k, [0, 0, 0]))] for k, v in after.items()}
    return outs, werr, serr, sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_all_reduce_equals_single_process_reference(world):
    steps = 4
    results = run_distributed(_dist_exchange, world, steps)
    layout = X.ChunkLayout([int(np.prod(s)) for s in SHAPES], world, torch.device("cpu"))
    werrs = [torch.zeros(world, layout.columns) for _ in range(world)]
    serrs = [torch.zeros(1, layout.columns) for _ in range(world)]
    for t, step in enumerate(_inputs(world, steps)):
        ref = X.reference_all_reduce(layout, [layout.to_rows(x) for x in step], werrs, serrs)
        for r in range(world):
            assert torch.equal(results[r][0][t], ref), f"rank {r} step {t}"
        # the result approximates the true mean (1-bit: the right direction, not the value)
        mean = torch.stack([layout.to_rows(x) for x in step]).mean(0)
        assert torch.nn.functional.cosine_similarity(ref.view(-1), mean.view(-1), dim=0) > 0.3
    for r in range(world):
        assert torch.equal(results[r][1], werrs[r]) and torch.equal(results[r][2], serrs[r][0:1])
    # two collectives per exchange, uint8 rows of signs + scales
    sent = results[0][3]
    assert sent[("all_to_all", "world")][0] == steps and sent[("all_gather", "world")][0] == steps
    assert sent[("all_to_all", "world")][1] == steps * world * layout.row_bytes
