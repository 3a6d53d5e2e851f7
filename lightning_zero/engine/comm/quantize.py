"""Quantized collectives (ZeRO++ qwZ / qgZ): int8 blocks of 256 with one fp32 scale each, pure torch.

Design note
-----------
A tensor is cut into blocks of :data:`BLOCK` elements (the last one zero-padded); each block travels as
int8 values ``round(x / s)`` with ``s = max|x| / 127`` over the block, and ``s`` itself as fp32. The
error of one element is at most ``s / 2``: half a quantization step of its own block, so large and small
blocks keep their own precision. Values and scales travel in one flat uint8 buffer per rank (values, then
the scales' bytes), so a quantized collective is still one collective.

* :func:`all_gather_int8` (qwZ): every rank's chunk is quantized, gathered, and dequantized on arrival
  into the caller's buffer, *own chunk included*: every rank then holds the same values, as after an exact
  gather. Masters stay fp32 and exact; only the gathered copies are rounded.
* :func:`reduce_scatter_int8` (qgZ): the rank-major gradient buffer is quantized row by row (row ``r`` is
  what rank ``r`` receives), exchanged with one all-to-all, and the ``N`` received rows are dequantized and
  summed in fp32 -- :func:`reduce_scatter_by_all_to_all`, which without quantization is the exact
  reduce-scatter of ``grad_reduce="all_to_all"``. A row may be split into segments quantized on their own
  (the reducer's used-parameter counts travel in the row's tail and must not share a scale with the
  gradients).

Non-finite values stay non-finite (a block holding inf or nan dequantizes to nan), so overflow checks of
fp16 loss scaling still see them. With one rank nothing travels and nothing is rounded.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from . import collectives as C

BLOCK = 256
_QMAX = 127


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (1-D or 2-D) as int8 blocks: ``(q [rows, nblocks * block], scales [rows, nblocks])``."""
    rows = x.reshape(1, -1) if x.dim() == 1 else x
    r, n = rows.shape
    nb = max(1, -(-n // block))
    q = torch.empty(r, nb * block, dtype=torch.int8, device=x.device)
    scale = torch.empty(r, nb, dtype=torch.float32, device=x.device)
    _quantize_into(rows, q, scale, block)
    return q, scale


def _quantize_into(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> None:
    """[Note: quantize in place] ``rows`` ``[r, n]`` into int8 ``q`` ``[r, nb * block]`` and fp32 ``scale``
    ``[r, nb]``, both possibly views into a packed wire buffer. The whole blocks are read where they lie
    (no padded copy), and the quotient goes into the buffer ``abs`` made. The int8 cast writes straight into
    ``q`` (no separate cast or concatenation). ``nan_to_num`` runs only when a scale is not finite, which
    on CPU costs a check instead of a pass. The values are bit for bit those of pad -> abs -> amax -> div ->
    round -> clamp -> nan_to_num -> cast -> cat."""
    r, n = rows.shape
    full = n // block
    spans = []
    if full:
        spans.append((rows[:, : full * block].reshape(r, full, block), q[:, : full * block].view(r, full, block),
                      scale[:, :full]))
    if q.shape[1] > full * block:  # the last block, zero-padded (the only copy of input values)
        tail = torch.zeros(r, 1, block, dtype=torch.float32, device=rows.device)
        tail[:, 0, : n - full * block] = rows[:, full * block :]
        spans.append((tail, q[:, full * block :].view(r, 1, block), scale[:, full:]))
    for x3, q3, s2 in spans:
        x3 = x3.float()
        quot = x3.abs()
        torch.div(quot.amax(dim=2), _QMAX, out=s2)
        # an all-zero block keeps scale 0 (it dequantizes to zeros); divide by 1 there instead of 0
        torch.div(x3, torch.where(s2 > 0, s2, 1.0).unsqueeze(2), out=quot)
        quot.round_().clamp_(-_QMAX, _QMAX)
        if not (quot.device.type == "cpu" and bool(torch.isfinite(s2).all())):
            quot.nan_to_num_(0.0)
        q3.copy_(quot)


def dequantize(q: torch.Tensor, scale: torch.Tensor, numel: int, block: int = BLOCK) -> torch.Tensor:
    """fp32 rows ``[rows, numel]`` from :func:`quantize`'s output."""
    r = scale.shape[0]
    x = torch.mul(q.view(r, -1, block), scale.unsqueeze(2))  # int8 * fp32 is fp32: one pass, exact widening
    return x.view(r, -1)[:, :numel]


def packed_numel(numel: int, block: int = BLOCK) -> int:
    """Bytes one row of ``numel`` elements takes on the wire: the int8 blocks plus one fp32 scale each."""
    nb = max(1, -(-numel // block))
    return nb * block + 4 * nb


def _segment_views(buf: torch.Tensor, off: int, seg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 blocks and the fp32 scales of one segment inside a packed ``[rows, width]`` uint8 buffer
    (every segment's width is a multiple of 4, so the scales' view is aligned)."""
    nb = max(1, -(-seg // BLOCK))
    return (buf[:, off : off + nb * BLOCK].view(torch.int8),
            buf[:, off + nb * BLOCK : off + nb * BLOCK + 4 * nb].view(torch.float32))


def pack(x: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
    """Rows of ``x`` as uint8 ``[rows, sum(packed_numel(s))]``, each segment quantized on its own, written in
    place ([Note: quantize in place])."""
    buf = torch.empty(x.shape[0], sum(packed_numel(s) for s in segments), dtype=torch.uint8, device=x.device)
    lo = off = 0
    for seg in segments:
        _quantize_into(x[:, lo : lo + seg], *_segment_views(buf, off, seg))
        lo += seg
        off += packed_numel(seg)
    return buf


def unpack(buf: torch.Tensor, segments: Sequence[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 rows ``[rows, sum(segments)]`` from :func:`pack`'s output, dequantized straight into ``out``
    (given, or new): one multiply per segment, no copies of the blocks or scales."""
    r = buf.shape[0]
    out = torch.empty(r, sum(segments), dtype=torch.float32, device=buf.device) if out is None else out
    lo = off = 0
    for seg in segments:
        q, scale = _segment_views(buf, off, seg)
        full = seg // BLOCK
        if full:
            torch.mul(q[:, : full * BLOCK].view(r, full, BLOCK), scale[:, :full].unsqueeze(2),
                      out=out[:, lo : lo + full * BLOCK].view(r, full, BLOCK))
        if seg > full * BLOCK:
            torch.mul(q[:, full * BLOCK : seg], scale[:, full:], out=out[:, lo + full * BLOCK : lo + seg])
        lo += seg
        off += packed_numel(seg)
    return out


class _Then:
    """A collective's handle that runs ``finish`` (dequantize into the caller's buffer) once it is done."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> bool:
        if self._finish is not None:
            self._work.wait()
            self._finish()
            self._finish = None
        return True


def all_gather_int8(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False):
    """:func:`collectives.all_gather` with the chunks travelling as int8 blocks (output in its own dtype)."""
    n = C.world_size(group)
    if n == 1:
        return C.all_gather(output, input, group=group, async_op=async_op)
    numel = input.numel()
    send = pack(input.reshape(1, -1), [numel]).view(-1)
    recv = torch.empty(n * send.numel(), dtype=torch.uint8, device=input.device)
    work = C.all_gather(recv, send, group=group, async_op=True)
    rows = output.view(n, -1)

    def finish() -> None:
        if rows.dtype == torch.float32:
            unpack(recv.view(n, -1), [numel], out=rows)
        else:
            rows.copy_(unpack(recv.view(n, -1), [numel]))

    handle = _Then(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None,
                                 async_op: bool = False, quantized: bool = False,
                                 segments: Optional[Sequence[int]] = None, pool: Optional[Any] = None):
    """:func:`collectives.reduce_scatter` as one all-to-all of the rank-major rows, summed in fp32 on arrival.

    Row ``j`` of ``input`` goes to rank ``j`` (this rank's own row stays in place); the ``N`` rows for this
    rank are summed in rank order, so the sum is the same on every run and every rank. The bytes on the
    wire are a reduce-scatter's ((N-1)/N of the input, half of an all-reduce's), through gloo's all-to-all,
    which is fast where its reduce-scatter is not (``grad_reduce="all_to_all"``). Extra memory: the
    ``N - 1`` received rows. ``quantized`` (qgZ): the rows travel as int8 blocks, ``segments`` saying how
    one row (``output.numel()`` elements) splits into separately scaled parts. ``pool``: the received rows
    are borrowed from this :class:`~lightning_zero.engine.comm.buffer_pool.BufferPool` and given back once summed.
    """
    n, r = C.world_size(group), C.rank(group)
    if n == 1:
        return C.reduce_scatter(output, input, group=group, async_op=async_op)
    rows = input.view(n, -1)
    if quantized:  # this rank's own row is rounded too, so every rank's shard sums N dequantized rows
        segments = list(segments) if segments is not None else [output.numel()]
        rows = pack(rows, segments)
    shape = (n - 1, rows.shape[1])
    recv = (pool.take((n - 1) * rows.shape[1], rows.dtype, rows.device).view(shape) if pool is not None
            else torch.empty(shape, dtype=rows.dtype, device=rows.device))
    work = C.all_to_all_rows(recv, rows, group=group, async_op=True)

    def finish() -> None:
        others = unpack(recv, segments) if quantized else recv
        own = unpack(rows[r : r + 1], segments)[0] if quantized else rows[r]
        _sum_rows(output, [others[j - (j > r)] if j != r else own for j in range(n)])  # rank order
        if pool is not None:
            pool.give(recv)

    handle = _Then(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def _sum_rows(output: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """``output`` := ``rows[0] + rows[1] + ...``, in rank order, accumulated in fp32. A chain of adds, not a
    sum over dim 0: on CPU half the time of ``rows.sum(0)`` (which then also needs a copy into ``output``)."""
    acc = output if output.dtype == torch.float32 else torch.empty(output.shape, dtype=torch.float32,
                                                                   device=output.device)
    torch.add(rows[0].to(torch.float32), rows[1], out=acc)
    for row in rows[2:]:
        acc.add_(row)
    if acc is not output:
        output.copy_(acc)


def reduce_scatter_int8(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None,
                        async_op: bool = False, segments: Optional[Sequence[int]] = None):
    """qgZ: :func:`reduce_scatter_by_all_to_all` with the rows as int8 blocks."""
    return reduce_scatter_by_all_to_all(output, input, group=group, async_op=async_op, quantized=True,
                                        segments=segments)
