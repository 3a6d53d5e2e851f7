"""Quantized collectives (ZeRO++ qwZ / qgZ): int8 blocks of 256 with one fp32 scale each.

Round-trip error bounds; the collectives against exact ones on 2 gloo ranks (one all-to-all per gradient
bucket, int8 payload sizes from comm_report); training with both on stays within a stated tolerance of the
unquantized run; masters stay exact fp32.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm import collectives as C
from lightning_zero.engine.comm import quantize as Q
from tests.helpers.dist_utils import run_distributed
from tests.helpers.zoo_models import ZOO


# -- round trip --------------------------------------------------------------------------------------------
def _reference_pack(x: torch.Tensor, segments) -> torch.Tensor:
    """The format written out pass by pass: pad, abs, amax, divide, round, clamp, nan -> 0, cast, concatenate."""
    parts, lo = [], 0
    for seg in segments:
        rows = x[:, lo : lo + seg].float()
        nb = max(1, -(-seg // Q.BLOCK))
        xp = torch.nn.functional.pad(rows, (0, nb * Q.BLOCK - seg)).view(rows.shape[0], nb, Q.BLOCK)
        scale = xp.abs().amax(dim=2) / 127
        q = (xp / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(2)).round().clamp(-127, 127)
        parts += [q.nan_to_num(0.0).to(torch.int8).view(rows.shape[0], -1).view(torch.uint8),
                  scale.contiguous().view(torch.uint8)]
        lo += seg
    return torch.cat(parts, dim=1)


def _blocks(kind: str, shape) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    if kind == "special":  # inf and nan blocks, an all-zero block
        x[0, min(3, shape[1] - 1)], x[-1, -1] = float("inf"), float("nan")
        x[0, 256:300] = 0
    return x * 1e-43 if kind == "subnormal" else x  # scales in the subnormals: the clamp matters


@pytest.mark.parametrize("kind", ["normal", "special", "subnormal"])
@pytest.mark.parametrize("shape,segments", [((1, 300), [297, 3]), ((2, 5000), [4990, 10]), ((3, 256), [256]),
                                            ((2, 1), [1]), ((2, 513), [512, 1])])
def test_pack_and_unpack_are_the_pass_by_pass_format_bit_for_bit(shape, segments, kind):
    """[Note: quantize in place]: quantizing into the wire buffer gives the same bytes as the format written
    pass by pass, and unpacking is the widening multiply of each block by its scale."""
    x = _blocks(kind, shape)
    buf = Q.pack(x, segments)
    assert torch.equal(buf, _reference_pack(x, segments))
    lo, off, want = 0, 0, []
    for seg in segments:
        nb = max(1, -(-seg // Q.BLOCK))
        q = buf[:, off : off + nb * Q.BLOCK].contiguous().view(torch.int8).float().view(shape[0], nb, Q.BLOCK)
        s = buf[:, off + nb * Q.BLOCK : off + Q.packed_numel(seg)].contiguous().view(torch.float32)
        want.append((q * s.unsqueeze(2)).view(shape[0], -1)[:, :seg])
        lo, off = lo + seg, off + Q.packed_numel(seg)
    got, want = Q.unpack(buf, segments), torch.cat(want, dim=1)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_pack_makes_two_buffers_of_the_data_size_and_unpack_one():
    """The wire buffer and the quotient; no padded copy, no separate cast, no concatenation (the pass-by-pass
    format makes five: padded copy, abs, quotient, int8 cast, concatenation)."""
    from tests.helpers.allocations import AllocationCounter

    x = torch.randn(2, 4096)
    with AllocationCounter() as packing:
        buf = Q.pack(x, [4096])
    with AllocationCounter() as unpacking:
        Q.unpack(buf, [4096])
    # the large ones: at least the int8 payload's size (the scales, the masks and the finite check are small)
    assert sum(1 for n in packing.sizes if n >= x.numel()) == 2, packing.sizes
    assert sum(1 for n in unpacking.sizes if n >= x.numel()) == 1, unpacking.sizes


@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4097])
def test_round_trip_error_is_at_most_half_a_step_of_its_block(numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)  # blocks of very different magnitudes
    q, scale = Q.quantize(x)
    assert q.dtype == torch.int8 and q.numel() == scale.numel() * Q.BLOCK
    back = Q.dequantize(q, scale, numel).view(-1)
    err = (back - x).abs()
    pad = torch.nn.functional.pad(x, (0, scale.numel() * Q.BLOCK - numel)).view(-1, Q.BLOCK)
    bound = (pad.abs().amax(1) / 127 / 2).repeat_interleave(Q.BLOCK)[:numel]
    assert torch.all(err <= bound * (1 + 1e-6) + 1e-30)
    # each block's largest element is exact up to fp32 rounding of the scale
    assert torch.allclose(back.abs().max(), x.abs().max(), rtol=1e-6)


def test_zeros_and_non_finite_values():
    assert torch.equal(Q.dequantize(*Q.quantize(torch.zeros(300)), 300), torch.zeros(1, 300))
    x = torch.ones(512)
    x[3] = float("inf")
    back = Q.dequantize(*Q.quantize(x), 512).view(-1)
    assert not torch.isfinite(back[:256]).any(), "a block holding inf stays non-finite (overflow checks see it)"
    assert torch.equal(back[256:], torch.ones(256))


def test_pack_keeps_segments_apart():
    x = torch.cat([torch.full((1, 300), 1000.0), torch.ones(1, 3)], dim=1)  # gradients, then used-flags
    buf = Q.pack(x, [300, 3])
    assert buf.dtype == torch.uint8 and buf.shape[1] == Q.packed_numel(300) + Q.packed_numel(3)
    assert torch.equal(Q.unpack(buf, [300, 3])[:, 300:], torch.ones(1, 3))


def test_quantize_flags_are_validated():
    with pytest.raises(ValueError, match="quantize_grads with stage 1, 2 or 3"):
        ZeroConfig(stage=0, quantize_grads=True)
    with pytest.raises(ValueError, match="quantize_weights with stage 1, 2 or 3"):
        ZeroStrategy(stage=0, quantize_weights=True)


# -- the collectives on 2 ranks --------------------------------------------------------------------------
def _collectives_job(rank, world_size):
    g = torch.Generator().manual_seed(7 + rank)
    chunk = torch.randn(1000, generator=g)
    exact = torch.empty(2000)
    C.all_gather(exact, chunk)
    quant = torch.empty(2000)
    before = C.stats.snapshot()
    Q.all_gather_int8(quant, chunk)
    ag = {k: [a - b for a, b in zip(v, before.get(k, [0, 0, 0]))] for k, v in C.stats.snapshot().items()}
    grads = torch.randn(2 * 600, generator=g)
    rs_exact = torch.empty(600)
    C.reduce_scatter(rs_exact, grads.clone())
    rs_quant = torch.empty(600)
    Q.reduce_scatter_int8(rs_quant, grads.clone(), segments=[597, 3])
    return dict(exact=exact, quant=quant, ag=ag, rs_exact=rs_exact, rs_quant=rs_quant, grads=grads)


@pytest.mark.timeout(60)
def test_quantized_all_gather_and_reduce_scatter_against_exact_ones():
    res = run_distributed(_collectives_job, 2)
    assert torch.equal(res[0]["quant"], res[1]["quant"]), "every rank holds the same dequantized values"
    for r in res:
        err = (r["quant"] - r["exact"]).abs().view(-1, 1000)
        assert torch.all(err.amax(1) <= r["exact"].view(2, -1).abs().amax(1) / 254 * (1 + 1e-6))
        # one uint8 all-gather: 1000 int8 values padded to 4 blocks, plus 4 fp32 scales
        assert r["ag"][("all_gather", "world")][:2] == [1, Q.packed_numel(1000)] == [1, 1024 + 16]
    for rank, r in enumerate(res):
        # this rank's sum takes row ``rank`` of every rank's buffer: each adds at most half a step of its block
        tol = sum(float(x["grads"].view(2, -1)[rank].abs().max()) for x in res) / 254
        torch.testing.assert_close(r["rs_quant"], r["rs_exact"], rtol=0, atol=tol * 1.01)
        assert not torch.equal(r["rs_quant"], r["rs_exact"])


# -- training with qwZ + qgZ --------------------------------------------------------------------------------
STEPS = 4


def _train(stage, quant, rank, offload=False):
    make, batch_of, loss_of = ZOO["gpt2"]
    torch.manual_seed(0)
    model = make()
    cfg = ZeroConfig(stage=stage, quantize_weights=quant, quantize_grads=quant, offload_optimizer=offload,
                     bucket_mb=0.05)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cfg)
    losses, reports = [], []
    for step in range(STEPS):
        loss = loss_of(model, batch_of(step % 2, rank))  # two batches, revisited: the loss must fall
        loss.backward()
        engine.step()
        losses.append(loss.item())
        reports.append(engine.comm_report())
    masters = [m.detach().clone() for _, m, _, _ in engine.master_items()]
    gathered_exact = None
    if stage == 3:  # gathered_params() (export, generate, hand-back) is exact even with qwZ
        model(batch_of(0, rank))  # leaves the persistent root gathered with rounded values
        with engine.gathered_params():
            held = [p.detach().clone() for p in engine.bucket_params]
        gathered_exact = all(torch.equal(h, f) for h, f in zip(held, engine.full_master_params()))
    return dict(losses=losses, gathered_exact=gathered_exact, rows=reports[-1].rows, wire=reports[-1].wire_bytes, masters=masters,
                n_buckets=len(engine.buckets), shard_numels=[b.shard_numel for b in engine.buckets],
                aliased=[m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                         for (row, b) in engine.master_rows()
                         for m, p in zip(row[:1], b.params[:1])])


def _training_job(rank, world_size):
    return {(stage, quant): _train(stage, quant, rank) for stage in (2, 3) for quant in (False, True)}


@functools.lru_cache(maxsize=None)
def _training_runs():
    return run_distributed(_training_job, 2)


# after 4 AdamW steps of tiny GPT-2 (loss ~4.6) the int8 run stays within 1% of the exact one
LOSS_RTOL = 1e-2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_quantized_training_stays_close_to_exact(stage):
    for r in _training_runs():
        exact, quant = r[(stage, False)], r[(stage, True)]
        torch.testing.assert_close(torch.tensor(quant["losses"]), torch.tensor(exact["losses"]), rtol=LOSS_RTOL,
                                   atol=0)
        assert quant["losses"] != exact["losses"], "the quantized run really rounded something"
        assert quant["losses"][-1] < quant["losses"][0]
        diff = max((a - b).abs().max().item() for a, b in zip(quant["masters"], exact["masters"]))
        # AdamW moves an element by about lr per step: two runs 4 steps apart differ by well under 2 x 4 x lr
        assert 0 < diff < 0.05
        if stage == 3:
            assert quant["gathered_exact"] and exact["gathered_exact"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_one_all_to_all_per_bucket_and_int8_payloads(stage):
    for r in _training_runs():
        exact, quant = r[(stage, False)], r[(stage, True)]
        rows = quant["rows"]
        a2a = [v for (op, _g), v in rows.items() if op == "all_to_all"]
        assert sum(v[0] for v in a2a) == quant["n_buckets"]
        assert not any(op in ("reduce_scatter", "all_reduce") for op, _g in rows), rows
        # qgZ payload per bucket: N rows of (gradients + one used-flag per parameter), each segment in int8
        # blocks plus fp32 scales -- about a quarter of the fp32 reduction
        # the exact run's reduction: gloo's "auto" (an fp32 all-to-all), or whichever collective a backend picks
        fp32_rs = sum(v[1] for (op, _g), v in exact["rows"].items()
                      if op in ("reduce_scatter", "all_reduce", "all_to_all"))
        assert fp32_rs > 0, exact["rows"]
        assert sum(v[1] for v in a2a) < 0.35 * fp32_rs
        assert quant["wire"] < 0.35 * exact["wire"]
        if stage == 2:
            assert not any(quant["aliased"]), "qwZ rounds the gathered parameters: masters are separate"
            assert all(exact["aliased"])


# -- under Lightning -------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_lightning_zero2_with_qwz_and_qgz_stays_close_to_ddp(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy

    from tests.helpers.lightning_parity import fit_parity_module as _fit

    ref = _fit(tmp_path, DDPStrategy(start_method="fork", find_unused_parameters=True))
    quant = _fit(tmp_path, ZeroStrategy(stage=2, quantize_weights=True, quantize_grads=True, start_method="fork"))
    for z, d in zip(quant, ref):
        torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(d["losses"]), rtol=LOSS_RTOL, atol=0)
        assert z["losses"] != d["losses"]
        # weights: per tensor within 10% of DDP's norm (measured: at most 6.6%, fc2.weight). AdamW normalizes
        # each element's step, so a gradient element far below its block's largest one -- rounded to 0 or one
        # quantization step -- still moves by ~lr (0.05 here), in whichever direction the rounding says
        for name, v in d["params"].items():
            rel = float((z["params"][name] - v).norm() / v.norm())
            assert rel < 0.1, (name, rel)
    for name, v in quant[0]["params"].items():  # every rank holds the same (dequantized) parameters
        assert torch.equal(quant[1]["params"][name], v)
