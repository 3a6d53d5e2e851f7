"""ZeRO-Infinity's disk side: the offload device knob, the checks of ``nvme_path``, and one rank's scratch file.

Design note
-----------
The states offloaded to NVMe live in one private file per rank and optimizer under ``nvme_path``; the file is
scratch, never a checkpoint (a checkpoint still writes the normal sharded directory from the states brought
back into memory), so it is removed when the engine is torn down -- and, should the engine never be torn down
(an exception, a killed rank), when the object is collected or the interpreter exits (``weakref.finalize``).
I/O is plain ``os.preadv`` / ``os.pwritev`` on the tensors' own memory (no copy through Python bytes, no
compiled op, no libaio): the kernel's page cache and read-ahead do the rest, and the reader / writer threads
of nvme_states.py release the GIL inside the system call, so the CPU step runs meanwhile.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import multiprocessing.util
import os
import shutil
import tempfile
import uuid
import weakref
from typing import Union

import torch

NVME_PATH_ENV = "LIGHTNING_ZERO_NVME_PATH"


class OffloadDevice(enum.Enum):
    """Where offloaded states live between uses."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"

    @classmethod
    def parse(cls, value: Union[bool, str], knob: str, names: tuple = ("none", "cpu", "nvme")) -> "OffloadDevice":
        if isinstance(value, bool):
            return cls.CPU if value else cls.NONE
        if isinstance(value, str) and value.lower() in names:
            return cls(value.lower())
        raise ValueError(f"{knob} must be True or False, or one of {', '.join(map(repr, names))} (True = 'cpu'); "
                         f"got {value!r}.")

    @property
    def knob_value(self) -> Union[bool, str]:
        """The normalized knob: False, True (host memory) or "nvme" (truthy: the host-side step runs)."""
        return {OffloadDevice.NONE: False, OffloadDevice.CPU: True, OffloadDevice.NVME: "nvme"}[self]


def check_nvme_dir(path: str) -> str:
    """``path`` as an absolute directory that exists and this process may create files in; else one error."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(full):
        raise ValueError(f"nvme_path={path!r} does not exist or is not a directory. Allowed: an existing, writable "
                         f"directory (on a local NVMe disk) for the per-rank scratch files.")
    try:  # a real probe: os.access says yes to root on a read-only mount or /proc
        with tempfile.TemporaryFile(dir=full):
            pass
    except OSError:
        raise ValueError(f"nvme_path={path!r} is not writable by this process. Allowed: an existing, writable "
                         f"directory (on a local NVMe disk) for the per-rank scratch files.")
    return full


def check_free_space(path: str, needed: int, what: str, knob: str = "offload_optimizer") -> None:
    """Refuse at setup, with the number, a disk that cannot hold ``needed`` more bytes."""
    free = shutil.disk_usage(path).free
    if free < needed:
        raise ValueError(f"nvme_path={path!r} has {free:,} bytes free; {what} need {needed:,} bytes "
                         f"({needed / 2**30:.2f} GiB). Allowed: a directory on a disk with at least that much free "
                         f"space (or {knob}=True to keep them in host memory).")


def _remove(path: str, fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


DIRECT_ALIGN = 4096  # O_DIRECT: buffer addresses, file offsets and lengths in multiples of this


def aligned_empty(nbytes: int, pin: bool = False, align: int = 1) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes`` whose address is a multiple of ``align`` (O_DIRECT needs the page)."""
    if align <= 1:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    off = (-raw.data_ptr()) % align
    return raw[off : off + nbytes]


class ScratchFile:
    """One rank's private file: positional reads and writes straight into / out of tensors' memory.
    ``direct``: opened with O_DIRECT (the device's DMA moves the bytes, no page-cache copy on the CPU);
    the caller then gives page-aligned buffers, offsets and lengths."""

    def __init__(self, directory: str, rank: int, tag: str = "optimizer", direct: bool = False) -> None:
        name = f"lightning_zero-{tag}-rank{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}.swap"
        self.path = os.path.join(directory, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:  # tmpfs and a few others
                raise ValueError(f"nvme_direct=True: the file system of nvme_path={directory!r} does not support "
                                 f"O_DIRECT. Allowed: nvme_direct=False there (the page cache), or a directory on "
                                 f"a local disk (ext4, xfs).") from None
            raise
        self.direct = direct
        self._finalizer = weakref.finalize(self, _remove, self.path, self.fd)
        # a rank that multiprocessing ends (Lightning's fork / spawn launchers) exits through os._exit, past
        # atexit: its exit finalizers remove the file there ([Note: NVMe states outlive teardown])
        multiprocessing.util.Finalize(self, self._finalizer, exitpriority=0)

    @staticmethod
    def _view(t: torch.Tensor) -> memoryview:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("NVMe I/O needs contiguous host tensors")
        # a ctypes view of the bytes: Tensor.numpy() would mark the storage non-resizable for good, and a
        # stage-3 shard's storage is resized to 0 between uses (stage3/nvme_params.py)
        n = t.numel() * t.element_size()
        return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")

    def write(self, buf: torch.Tensor, offset: int) -> None:
        view = self._view(buf)
        done = 0
        while done < len(view):  # pwritev may write less than asked (signals, some file systems)
            n = os.pwritev(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.ENOSPC, f"short write to {self.path}")
            done += n

    def read(self, buf: torch.Tensor, offset: int) -> None:
        view = self._view(buf)
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:  # past the end: a region never written (the first step's state) reads as nothing
                break
            done += n

    def reserve(self, nbytes: int) -> None:
        """Claim the file's size now (where the file system can), so a full disk fails at setup, not mid-run."""
        if nbytes <= 0:
            return
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
                raise ValueError(f"nvme_path: could not reserve {nbytes:,} bytes in {self.path}: {e}. Allowed: a "
                                 f"directory on a disk with at least that much free space.") from e

    @property
    def open(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Close and remove the file (idempotent)."""
        self._finalizer()
