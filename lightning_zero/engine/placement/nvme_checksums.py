"""What a scratch file holds, block by block: a CRC32 recorded on every write and checked on every read.

[Note: verified scratch reads]
A scratch file is only ever read back by the run that wrote it, so the run keeps, in memory, the CRC32 of every
block it wrote (``zlib.crc32``: about 4 GB/s on one core, computed on the reader / writer threads with the GIL
released, beside the disk's own bandwidth). A read must give back every byte asked for (a short read means the
file was truncated under the run) and every block it covers must match its CRC (a file overwritten by someone
else, a bad sector the disk did not report); either is a :class:`ScratchDamaged`, an ``OSError``, so the
engine's one agreement (``io_agreement.raise_if_any_rank_failed``) stops every rank with it instead of the step
training on whatever the ring slot held before. A checkpoint's save reads every shard back first through the
same agreement (``io_agreement.make_resident_on_every_rank``), so a damaged file stops the save on every rank
too. Blocks are the writes' own pieces: by default :data:`BLOCK` bytes from the write's start; a caller that
later rewrites parts of a region (stage 3's publish writes one parameter's slice of a unit shard) writes the
whole region in those same pieces, so a slice write replaces exactly its block and the others keep theirs. A
write that would cut a recorded block is a bug and raises. The map costs 24 bytes of Python objects per block
(1 MiB): about 0.3 MB per 10 GB of scratch.
"""

from __future__ import annotations

import bisect
import errno
import threading
import zlib
from typing import Optional, Sequence

BLOCK = 1 << 20  # a write's default block: small enough to name where a file is damaged, large for zlib


class ScratchDamaged(OSError):
    """A scratch read that does not give back what this run wrote: short (truncated) or failing its CRC."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)

    def __str__(self) -> str:
        return self.strerror


class BlockChecksums:
    """The CRC32 of every block written to one file, by start offset (thread-safe: the reader and writer
    threads of one file record and check concurrently, always on different regions)."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted block starts
        self._blocks: dict[int, tuple[int, int]] = {}  # start -> (nbytes, crc32)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._starts)

    def record(self, data: memoryview, offset: int, blocks: Optional[Sequence[int]] = None) -> None:
        """``data`` was just written at ``offset``: its blocks (``blocks``: their lengths, summing to
        ``len(data)``; default :data:`BLOCK` each) replace every block recorded inside that range."""
        n = len(data)
        if blocks is None:
            blocks = [min(BLOCK, n - i) for i in range(0, n, BLOCK)]
        elif sum(blocks) != n:
            raise RuntimeError(f"scratch write of {n} bytes at {offset} given blocks summing to {sum(blocks)}")
        new, pos = [], 0
        for size in blocks:
            if size:
                new.append((offset + pos, size, zlib.crc32(data[pos : pos + size])))
            pos += size
        with self._lock:
            i, j = self._inside(offset, offset + n)
            for s in self._starts[i:j]:
                del self._blocks[s]
            self._starts[i:j] = [s for s, _, _ in new]
            self._blocks.update((s, (size, crc)) for s, size, crc in new)

    def _inside(self, lo: int, hi: int) -> tuple[int, int]:
        """Indices [i, j) of the blocks inside [lo, hi); one that straddles an end is refused."""
        i = bisect.bisect_left(self._starts, lo)
        if i > 0 and self._starts[i - 1] + self._blocks[self._starts[i - 1]][0] > lo:
            raise RuntimeError(f"scratch write at {lo} cuts the block written at {self._starts[i - 1]}")
        j = bisect.bisect_left(self._starts, hi, lo=i)
        if j > i and self._starts[j - 1] + self._blocks[self._starts[j - 1]][0] > hi:
            raise RuntimeError(f"scratch write ending at {hi} cuts the block written at {self._starts[j - 1]}")
        return i, j

    def verify(self, data: memoryview, offset: int, path: str) -> None:
        """``data``, just read from ``offset``, is what was written there: the blocks recorded in that range
        cover it without a gap and each matches its CRC; else :class:`ScratchDamaged` naming the block."""
        hi = offset + len(data)
        with self._lock:
            i = bisect.bisect_left(self._starts, offset)
            j = bisect.bisect_left(self._starts, hi, lo=i)
            found = [(s, *self._blocks[s]) for s in self._starts[i:j]]
        pos = offset
        for s, size, _ in found:  # the blocks tile the read: else a bug reads what it never wrote
            if s != pos or s + size > hi:
                break
            pos = s + size
        if pos != hi:
            raise RuntimeError(f"scratch read of [{offset}, {hi}) in {path} reaches bytes this run never wrote "
                               f"as whole blocks (from {pos})")
        for s, size, crc in found:
            if zlib.crc32(data[s - offset : s - offset + size]) != crc:
                raise ScratchDamaged(f"scratch file {path} is damaged: the {size:,} bytes at offset {s:,} do not "
                                     f"match the CRC32 written with them (the file was changed outside this run, or "
                                     f"the disk returned bad data)")

    def forget_from(self, end: int) -> None:
        """The file was cut to ``end`` bytes (its staging regions given back)."""
        with self._lock:
            i = bisect.bisect_left(self._starts, end)
            if i > 0 and self._starts[i - 1] + self._blocks[self._starts[i - 1]][0] > end:
                raise RuntimeError(f"scratch file cut at {end} inside the block written at {self._starts[i - 1]}")
            for s in self._starts[i:]:
                del self._blocks[s]
            del self._starts[i:]
