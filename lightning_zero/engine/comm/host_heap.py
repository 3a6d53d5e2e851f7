"""Freed host memory kept mapped by the C allocator, so a CPU rank's next fresh buffer does not page-fault.

[Note: freed host memory kept mapped]
A CPU rank's communication buffers are made fresh in each backward and each step ([Note: kept communication
buffers], buffer_pool.py: none is held between them, so the model states sit at the ZeRO floors). glibc's
malloc serves a block of more than its mmap threshold (dynamic, from 128 KiB) with a fresh ``mmap`` and unmaps
it on free, and trims the heap's top once enough of it is free: every such buffer page-faults afresh each
time, the kernel zeroing every page (measured on HF T5-small at 2 ranks: +24% step time at stages 1-2,
+14% at stage 3, against the pool that kept six blocks for good).

So on the first CPU buffer an engine makes, glibc is told (``mallopt``) to serve blocks up to 32 MiB (its
largest mmap threshold) from its heap and not to trim it: a freed block stays mapped *in the allocator*,
free for any later allocation of the process (the next phase's buffers, activations, gradients), not held by
the engine. This is the CPU's counterpart of torch's CUDA caching allocator. What it changes: the process's
resident size no longer drops when tensors are freed; its peak, which a memory cap meets, does not rise
(measured: 676-756 MiB VmHWM against 715-726 with the allocator's defaults and 740-929 with the old kept
blocks, at a step time below both). Not done where the user tuned glibc (``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` set), where ``LIGHTNING_ZERO_HOST_HEAP=0``, or off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

_log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_THRESHOLD = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc: the most mallopt accepts
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: the largest, i.e. never trim the heap top
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_done = False


def retain_freed_host_memory() -> bool:
    """Tell glibc to keep freed blocks mapped (once per process); True if it was told now or before."""
    global _done
    if _done:
        return True
    _done = True  # one attempt per process, whatever it gives
    if os.environ.get("LIGHTNING_ZERO_HOST_HEAP", "1") == "0" or any(k in os.environ for k in _USER_KNOBS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    _log.debug("glibc keeps freed blocks up to %d MiB mapped ([Note: freed host memory kept mapped])",
               _MMAP_THRESHOLD >> 20)
    return ok
