"""The error-compensated compressed all-reduce (1-bit Adam's momentum exchange) on torch.distributed.

Design note
-----------
Every tensor of the exchange is flattened, padded with zeros to a multiple of ``8 N`` and cut into ``N``
equal chunks; chunk ``j`` of every tensor is *served* by rank ``j`` (a reduce-scatter owner). Laid side by
side the chunks make an ``[N, C]`` matrix (row ``j``: what rank ``j`` serves; ``C`` = the sum of the chunk
lengths); each (row, tensor) segment has its own fp32 scale. One exchange is:

1. worker: ``x + worker_error`` compressed (signs + a scale per segment), the loss kept in ``worker_error``;
2. one all-to-all of the packed rows (signs and scales in one uint8 row): rank ``j`` receives every
   worker's row ``j``;
3. server: the N decompressed rows averaged (summed in rank order, then divided), plus ``server_error``,
   compressed again, the loss kept in ``server_error``;
4. one all-gather of the servers' packed rows: every rank decompresses the same ``[N, C]`` result.

Wire bytes per element: ``2 (N-1)/N * (1/8 + 4 S/C)`` against an fp32 all-reduce's ``2 (N-1)/N * 4``: about
1/32. Both collectives are plain ``all_to_all_single`` / ``all_gather`` on uint8, which gloo and NCCL run (no
MPI, no cupy). :func:`reference_all_reduce` runs the same arithmetic for N workers in one process (the
same kernels, the same order): the tests hold the collectives to it bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...comm import collectives as C
from .compress import compress, compress_with_feedback, decompress


class ChunkLayout:
    """Where each tensor's padded chunks sit in the ``[N, C]`` matrix (see the design note)."""

    def __init__(self, numels: Sequence[int], world_size: int, device: torch.device) -> None:
        self.world_size = n = world_size
        self.numels = list(numels)
        self.padded = [-(-k // (8 * n)) * 8 * n for k in self.numels]  # ceil to a multiple of 8 N
        self.chunks = [p // n for p in self.padded]
        self.columns = sum(self.chunks)
        self.seg_len = torch.tensor(self.chunks, dtype=torch.float32, device=device)
        self.seg = torch.repeat_interleave(torch.arange(len(self.chunks), device=device),
                                           torch.tensor(self.chunks, device=device))

    @property
    def row_bytes(self) -> int:
        """One packed row: the signs, then the fp32 scales."""
        return self.columns // 8 + 4 * len(self.chunks)

    def padded_flat(self, t: torch.Tensor, k: int) -> torch.Tensor:
        flat = t.detach().reshape(-1).float()
        pad = self.padded[k] - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def to_rows(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Tensors (their own shapes, or already padded flat) -> the ``[N, C]`` matrix."""
        n = self.world_size
        return torch.cat([self.padded_flat(t, k).view(n, -1) for k, t in enumerate(tensors)], dim=1)

    def from_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The ``[N, C]`` matrix -> each tensor's padded flat values (length ``padded[k]``)."""
        return [r.reshape(-1) for r in rows.split(self.chunks, dim=1)]

    def server_split(self, row: torch.Tensor) -> list[torch.Tensor]:
        """One ``[C]`` row (a server's chunks) -> each tensor's chunk."""
        return list(row.split(self.chunks))

    # packed rows: signs and scales travel in one uint8 row per destination
    def pack_rows(self, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.cat([packed, scales.contiguous().view(torch.uint8)], dim=1)

    def unpack_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        signs = self.columns // 8
        return rows[:, :signs].contiguous(), rows[:, signs:].contiguous().view(torch.float32)


def server_average(layout: ChunkLayout, received: torch.Tensor) -> torch.Tensor:
    """The mean of N workers' packed rows for one server chunk: ``[N, row_bytes]`` -> ``[1, C]``, summed in
    rank order (the reference calls the same function, so both round alike)."""
    packed, scales = layout.unpack_rows(received)
    values = decompress(packed, scales, layout.seg)
    total = values[0].clone()
    for i in range(1, values.shape[0]):
        total.add_(values[i])
    return total.div_(layout.world_size).unsqueeze(0)


def worker_compress(layout: ChunkLayout, rows: torch.Tensor, worker_error: torch.Tensor) -> torch.Tensor:
    """Worker side: ``rows + worker_error`` compressed (``worker_error`` updated in place) -> packed rows."""
    packed, scales, _ = compress_with_feedback(rows, worker_error, layout.seg, layout.seg_len)
    return layout.pack_rows(packed, scales)


def server_compress(layout: ChunkLayout, mean: torch.Tensor, server_error: torch.Tensor) -> torch.Tensor:
    """Server side: the workers' mean + ``server_error`` compressed (error updated in place) -> one packed row."""
    packed, scales, _ = compress_with_feedback(mean, server_error, layout.seg, layout.seg_len)
    return layout.pack_rows(packed, scales)


def gathered_result(layout: ChunkLayout, gathered: torch.Tensor) -> torch.Tensor:
    """Every server's packed row ``[N, row_bytes]`` -> the decompressed ``[N, C]`` result."""
    packed, scales = layout.unpack_rows(gathered)
    return decompress(packed, scales, layout.seg)


def compressed_all_reduce(layout: ChunkLayout, rows: torch.Tensor, worker_error: torch.Tensor,
                          server_error: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """The error-compensated 1-bit mean of ``rows`` (``[N, C]``, this rank's values) over ``group``.
    ``worker_error`` (``[N, C]``) and ``server_error`` (``[1, C]``: this rank's chunks) are updated in place.
    Returns the ``[N, C]`` result, identical on every rank. Two collectives: an all-to-all, an all-gather."""
    return gathered_result(layout, compressed_exchange(layout, rows, worker_error, server_error, group))


def compressed_exchange(layout: ChunkLayout, rows: torch.Tensor, worker_error: torch.Tensor,
                        server_error: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """:func:`compressed_all_reduce` up to the decompression: every server's packed row ``[N, row_bytes]``
    (what ZeRO stage 1 keeps of the whole averaged momentum: one bit per element, onebit/sharded.py)."""
    n, r = layout.world_size, C.rank(group)
    send = worker_compress(layout, rows, worker_error)
    received = torch.empty(n, layout.row_bytes, dtype=torch.uint8, device=rows.device)
    others = torch.empty(n - 1, layout.row_bytes, dtype=torch.uint8, device=rows.device)
    C.all_to_all_rows(others, send, group=group)
    received[:r], received[r], received[r + 1:] = others[:r], send[r], others[r:]
    mine = server_compress(layout, server_average(layout, received), server_error)
    gathered = torch.empty(n, layout.row_bytes, dtype=torch.uint8, device=rows.device)
    C.all_gather(gathered, mine.view(-1), group=group)
    return gathered


def reference_all_reduce(layout: ChunkLayout, rows: list[torch.Tensor], worker_errors: list[torch.Tensor],
                         server_errors: list[torch.Tensor]) -> torch.Tensor:
    """:func:`compressed_all_reduce` for all N workers in one process, no collective: ``rows[i]`` and
    ``worker_errors[i]`` are worker ``i``'s, ``server_errors[j]`` server ``j``'s (all updated in place)."""
    n = layout.world_size
    sent = [worker_compress(layout, x, e) for x, e in zip(rows, worker_errors)]
    served = [server_compress(layout, server_average(layout, torch.stack([s[j] for s in sent])), server_errors[j])
              for j in range(n)]
    return gathered_result(layout, torch.cat(served))


def plain_compress(layout: ChunkLayout, rows: torch.Tensor) -> torch.Tensor:
    """Compression without feedback (what one exchange would send had it no error memory; for tests)."""
    return compress(rows, layout.seg, layout.seg_len)[2]
