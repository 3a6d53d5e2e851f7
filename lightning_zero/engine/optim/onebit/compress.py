"""The 1-bit compression kernels: signs packed 8 per byte (uint8, most significant bit first, as numpy's
``packbits``), one fp32 scale per chunk, and the error feedback that makes the compression unbiased over steps.

A chunk ``c`` of ``k`` elements is sent as ``scale * sign(c)`` with ``scale = ||c||_2 / sqrt(k)`` (the
RMS, DeepSpeed's choice: it keeps the chunk's 2-norm) and ``sign(0) = +1`` (one bit cannot say zero).
What the compression lost, ``c - scale * sign(c)``, is added to the next value compressed at the same place
(error feedback): summed over steps, the decompressed values equal the true ones up to the last residual.
"""

from __future__ import annotations

import torch

# bit i of a byte (MSB first) is element 8*j + i
_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor (numel a multiple of 8) as bits, 8 per byte -> uint8 of ``numel / 8``."""
    if flags.numel() % 8:
        raise ValueError(f"pack_bits needs a multiple of 8 elements, got {flags.numel()}")
    bits = flags.reshape(-1, 8).to(torch.uint8)
    return (bits << _SHIFTS.to(flags.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: uint8 of ``m`` -> bool of ``8 m``."""
    return ((packed.reshape(-1, 1) >> _SHIFTS.to(packed.device)) & 1).reshape(-1).bool()


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x >= 0`` as bits, 8 per byte: ``x`` (numel a multiple of 8) -> uint8 of ``numel / 8``."""
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {x.numel()}")
    return pack_bits(x >= 0)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`pack_signs` as +-1 values: uint8 of ``m`` -> ``dtype`` of ``8 m``."""
    bits = (packed.reshape(-1, 1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(-1).to(dtype).mul_(2).sub_(1)


def chunk_scales(x: torch.Tensor, seg: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """RMS of each segment of each row: ``x`` ``[R, C]``, ``seg`` ``[C]`` the segment of each column (ids
    ``0..S-1``), ``seg_len`` ``[S]`` their lengths -> ``[R, S]`` fp32."""
    sq = torch.zeros(x.shape[0], seg_len.numel(), dtype=torch.float32, device=x.device)
    sq.index_add_(1, seg, x.float().pow(2))
    return sq.div_(seg_len.to(sq)).sqrt_()


def compress(x: torch.Tensor, seg: torch.Tensor, seg_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[R, C]`` -> (packed signs ``[R, C/8]`` uint8, scales ``[R, S]`` fp32, the decompressed value
    ``scale * sign(x)`` ``[R, C]``, from which the caller's error is ``x - decompressed``)."""
    scales = chunk_scales(x, seg, seg_len)
    packed = pack_signs(x).view(x.shape[0], -1)
    return packed, scales, decompress(packed, scales, seg)


def decompress(packed: torch.Tensor, scales: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """``scale * sign`` per row: packed ``[R, C/8]``, scales ``[R, S]`` -> ``[R, C]`` fp32."""
    signs = unpack_signs(packed).view(packed.shape[0], -1)
    return signs.mul_(scales[:, seg])


def compress_with_feedback(x: torch.Tensor, error: torch.Tensor, seg: torch.Tensor, seg_len: torch.Tensor):
    """Error-compensated compression: ``x + error`` compressed, ``error`` updated in place to what this
    compression lost. Returns (packed, scales, decompressed) as :func:`compress`."""
    c = x + error
    packed, scales, q = compress(c, seg, seg_len)
    error.copy_(c - q)
    return packed, scales, q
