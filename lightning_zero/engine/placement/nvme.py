"""ZeRO-Infinity's disk side: the offload device knob, the checks of ``nvme_path``, and one rank's scratch file.

Design note
-----------
The states offloaded to NVMe live in one private file per rank and optimizer under ``nvme_path``; the file is
scratch, never a checkpoint (a checkpoint still writes the normal sharded directory from the states brought
back into memory), so it is removed when the engine is torn down -- and, should the engine never be torn down
(an exception, a killed rank), when the object is collected or the interpreter exits (``weakref.finalize``).
I/O is plain ``os.preadv`` / ``os.pwritev`` on the tensors' own memory (no copy through Python bytes, no
compiled op, no libaio): the kernel's page cache and read-ahead do the rest, and the reader / writer threads
of nvme_states.py release the GIL inside the system call, so the CPU step runs meanwhile. Every read is whole
and checked against the CRC32s its writes recorded ([Note: verified scratch reads], nvme_checksums.py).

The file's name says whose it is (``lightning_zero-<tag>-rank<r>-<pid>-<host>-<id>.swap``) and the process
holds an exclusive ``flock`` on it while it is open: a run that was killed leaves its files unlocked, and the
next run on that directory reclaims exactly those ([Note: reclaiming a dead run's scratch files],
nvme_space.py).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import multiprocessing.util
import os
import re
import socket
import tempfile
import uuid
import weakref
from typing import Optional, Sequence, Union

import torch

from .nvme_checksums import BlockChecksums, ScratchDamaged

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
    if not str(path).strip():  # os.path.abspath("") is the current directory: never what was meant
        raise ValueError(f"nvme_path={path!r} is empty. Allowed: an existing, writable directory (on a local NVMe "
                         f"disk) for the per-rank scratch files, or None for ${NVME_PATH_ENV}.")
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


HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
SCRATCH_NAME = re.compile(r"^lightning_zero-(optimizer|params)-rank(\d+)-(\d+)-([A-Za-z0-9._]+)-([0-9a-f]{8})\.swap$")


def scratch_name(tag: str, rank: int) -> str:
    """Whose the file is: read back by :data:`SCRATCH_NAME` (nvme_space.py reclaims a dead run's files)."""
    return f"lightning_zero-{tag}-rank{rank}-{os.getpid()}-{HOST}-{uuid.uuid4().hex[:8]}.swap"


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

    CHECKSUMS = True  # every file made records and checks CRC32s; False only to price them (bench/nvme_offload.py)

    def __init__(self, directory: str, rank: int, tag: str = "optimizer", direct: bool = False,
                 checksums: Optional[bool] = None) -> None:
        self.path = os.path.join(directory, scratch_name(tag, rank))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:  # tmpfs and a few others
                raise ValueError(f"nvme_direct=True: the file system of nvme_path={directory!r} does not support "
                                 f"O_DIRECT. Allowed: nvme_direct=False there (the page cache), or a directory on "
                                 f"a local disk (ext4, xfs).") from None
            # the directory was checked when the config was made; it may have gone or turned read-only since
            raise ValueError(f"nvme_path={directory!r}: could not create the scratch file {os.path.basename(self.path)}"
                             f": {e.strerror or e} (errno {errno.errorcode.get(e.errno, e.errno)}). Allowed: an "
                             f"existing, writable directory (on a local NVMe disk) for the per-rank scratch files, "
                             f"for as long as the run lasts.") from None
        # held while open, released by the kernel when this process dies: in use <=> locked (nvme_space.py);
        # a file system without flock fails the reclaimer's lock the same way, so nothing there is reclaimed
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        self.direct = direct
        self.checksums = BlockChecksums() if (self.CHECKSUMS if checksums is None else checksums) else None
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

    def write(self, buf: torch.Tensor, offset: int, blocks: Optional[Sequence[int]] = None) -> None:
        """All of ``buf`` at ``offset``, its blocks' CRC32s recorded (``blocks``: their byte lengths, for a
        region whose parts are rewritten later, [Note: verified scratch reads])."""
        view = self._view(buf)
        done = 0
        while done < len(view):  # pwritev may write less than asked (signals, some file systems)
            n = os.pwritev(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.ENOSPC, f"short write to {self.path}")
            done += n
        if self.checksums is not None:
            self.checksums.record(view, offset, blocks)

    def read(self, buf: torch.Tensor, offset: int) -> None:
        """All of ``buf`` from ``offset``, as written ([Note: verified scratch reads]); else ScratchDamaged."""
        view = self._view(buf)
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:  # every region read was written first: the file was cut under the run
                raise ScratchDamaged(
                    f"scratch file {self.path} is damaged: reading {len(view):,} bytes at offset {offset:,} stopped "
                    f"after {done:,} at the file's end ({os.fstat(self.fd).st_size:,} bytes): it was truncated "
                    f"outside this run")
            done += n
        if self.checksums is not None:
            self.checksums.verify(view, offset, self.path)

    def truncate(self, nbytes: int) -> None:
        """Give back the file's bytes from ``nbytes`` on."""
        os.ftruncate(self.fd, nbytes)
        if self.checksums is not None:
            self.checksums.forget_from(nbytes)

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
