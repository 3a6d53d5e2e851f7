"""A scratch file's place on disk, agreed by every rank: a dead run's files reclaimed, the space the node
needs checked once, the file created and reserved, and any rank's failure raised on all of them.

[Note: scratch space for the node]
Ranks on one machine usually share one NVMe disk, so a rank's own check ("is there room for *my* file?")
passes on every rank and the last one to reserve dies mid-setup ("No space left") while its peers see only the
backend's "Connection closed by peer". :func:`prepare_scratch` is one collective step of setup instead, taken
by every rank of the engine's group for each scratch file (the NvmeStates of each optimizer, stage 3's
NvmeParams, always in the same order):

1. each rank checks that ``nvme_path`` is still there and writable (it may have been removed or remounted
   read-only since the config was made) and reclaims a dead run's files (below); one gather, so that every
   rank has done so before any free space is measured;
2. each rank measures the free space; a second gather gives every rank every (disk, bytes needed, bytes free),
   a disk being (host, ``st_dev``); each rank then decides the same thing from the same numbers: the ranks of
   a disk need the sum of their files, against the least free space any of them measured;
3. each rank creates and reserves (``posix_fallocate``) its file; a third gather: a failure anywhere (EROFS,
   ENOSPC from another process filling the disk meanwhile) is raised on every rank with that rank's words.

Three small gathers of Python objects, once per file at setup; nothing in a step.

[Note: reclaiming a dead run's scratch files]
A run killed with SIGKILL (a rank under torchrun, the OOM killer) runs no finalizer, and a restarted attempt
would find a disk sized for one job half full. A file is reclaimed only if it is certainly ours and certainly
dead: its name parses as a scratch file's (``nvme.SCRATCH_NAME``: anything else in the directory is never
touched), it was made on this host by a process that no longer exists, and an exclusive ``flock`` on it can be
taken -- a live owner holds its own lock until it exits, whatever its pid. The file is unlinked only if the
name still points at the locked inode (a peer may have reclaimed it meanwhile).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from typing import Any, Callable, Optional

from ..comm import collectives as C
from .nvme import HOST, SCRATCH_NAME, ScratchFile, check_nvme_dir
from .nvme_checksums import ScratchDamaged

_log = logging.getLogger("lightning_zero.engine")


def io_failure(what: str, path: str, e: OSError) -> str:
    """An I/O error as the sentence every rank raises (a damaged file says what is wrong with it itself)."""
    if isinstance(e, ScratchDamaged):
        return str(e)
    return f"the {what} of {path} failed: {e} (a full or read-only disk?)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def reclaim_dead_files(directory: str) -> list[tuple[str, int]]:
    """Remove the scratch files under ``directory`` that a dead process of this host left
    ([Note: reclaiming a dead run's scratch files]); returns (name, bytes) of each."""
    out = []
    for name in sorted(os.listdir(directory)):
        m = SCRATCH_NAME.match(name)
        if m is None or m.group(4) != HOST or _alive(int(m.group(3))):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already (a peer reclaimed it) or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
            if os.stat(path).st_ino != st.st_ino:
                continue
            os.unlink(path)
            out.append((name, st.st_size))
        except OSError:
            continue  # locked: in use; or unlinked by a peer between the two calls
        finally:
            os.close(fd)
    return out


def _disk(directory: str) -> tuple[str, int]:
    return HOST, os.stat(directory).st_dev


def _raise_first(errors: list[Optional[str]], prefix: str = "") -> None:
    bad = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if bad is not None:
        r, e = bad
        raise ValueError(e if len(errors) == 1 else f"{prefix}rank {r}: {e}")


def prepare_scratch(directory: str, needed: int, what: str, knob: str, rank: int, group: Optional[Any],
                    create: Callable[[], ScratchFile]) -> ScratchFile:
    """The scratch file ``create()`` makes, ``needed`` bytes reserved, once every rank of ``group`` agrees
    ([Note: scratch space for the node]); else one ValueError, the same on every rank. ``what``: the states
    the file holds (for the error), ``knob``: the offload knob whose True keeps them in host memory."""
    err = None
    disk = None
    try:
        check_nvme_dir(directory)
        for name, size in reclaim_dead_files(directory):
            _log.warning("nvme_path=%r: removed %s (%s bytes), a scratch file left by a process of this host that "
                         "no longer exists (a killed run).", directory, name, f"{size:,}")
        disk = _disk(directory)
    except ValueError as e:
        err = str(e)
    _raise_first(C.all_gather_object(err, group))
    free = shutil.disk_usage(directory).free
    everyone = C.all_gather_object((disk, needed, free), group)
    mine = [(r, n, f) for r, (d, n, f) in enumerate(everyone) if d == disk]
    total, least = sum(n for _, n, _ in mine), min(f for _, _, f in mine)
    if total > least:
        allowed = (f"Allowed: a directory on a disk with at least that much free space (or {knob}=True to keep "
                   f"them in host memory).")
        if len(mine) == 1:
            raise ValueError(f"nvme_path={directory!r} has {least:,} bytes free; rank {rank}'s {what} need "
                             f"{needed:,} bytes ({needed / 2**30:.2f} GiB). {allowed}")
        ranks = ", ".join(f"rank {r}: {n:,}" for r, n, _ in mine)
        raise ValueError(f"nvme_path={directory!r} has {least:,} bytes free; the {len(mine)} ranks of this node "
                         f"that share its disk need {total:,} bytes together ({total / 2**30:.2f} GiB) for their "
                         f"{what} ({ranks}). {allowed}")
    file, err = None, None
    try:
        file = create()
        file.reserve(needed)
    except ValueError as e:
        err = str(e)
    except OSError as e:
        err = f"nvme_path={directory!r}: {e} (errno {errno.errorcode.get(e.errno, e.errno)})"
    errors = C.all_gather_object(err, group)
    if any(e is not None for e in errors) and file is not None:
        file.close()
    _raise_first(errors)
    return file
