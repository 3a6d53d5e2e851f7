"""A checkpoint directory made visible only once every rank has written its part of it.

All ranks write into a temporary sibling ``X.zero-tmp``; rank 0 then exchanges it with ``X`` atomically
(files.py ``swap_dirs``), or, where the filesystem cannot, moves the previous ``X`` aside first -- so a
directory named ``X`` is always complete (the design note of files.py). What this module adds is the decision
*whether* to commit: [Note: every rank agrees on a save's failure].

[Note: every rank agrees on a save's failure]
A save fails on one rank alone more often than on all: a full local disk, a rank whose mount went away, an
error in a file only rank 0 writes. If that rank simply raised, its peers would wait in the next collective of
the save forever (a hang, and under an asynchronous save a hang in a background thread nobody watches). So
after its part each rank says whether it failed (``all_gather_object`` over the writing group) and *every*
rank raises one :class:`CheckpointWriteError` naming the failed ranks and their errors; the temporary is
removed and ``X`` -- the previous checkpoint under that name, if any -- is left as it was. The same
agreement covers preparing the temporary and the commit itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch.distributed as dist

from ..engine.comm.collectives import barrier as _barrier, rank as _rank, world_size
from .files import _TMP, _remove, aside_path, swap_dirs, tidy_checkpoint_dir
from .location import is_remote, remote_checkpoint_dir

_PathLike = Union[str, os.PathLike]


class CheckpointWriteError(OSError):
    """A save failed on at least one rank; raised on every rank of the save, nothing of it made visible. An
    ``OSError``: what failed is the checkpoint's write, whatever the rank's own error was."""


def agree_on_failure(error: Optional[BaseException], path: _PathLike, group=None) -> None:
    """Collective over ``group``: raise :class:`CheckpointWriteError` on every rank if ``error`` is set on any,
    naming the ranks where it happened (a failure one rank heard of from another names that one)."""
    mine = {} if error is None else _failures(error, _rank(group))
    every = [mine]
    if world_size(group) > 1:
        every = [None] * world_size(group)
        dist.all_gather_object(every, mine, group=group)
    failed = {r: m for part in every for r, m in part.items()}
    if failed:
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        raise CheckpointWriteError(
            f"Saving checkpoint {str(path)!r} failed on rank{'s' if len(failed) > 1 else ''} "
            f"{', '.join(map(str, sorted(failed)))} ({detail}). Nothing of it was made visible; the previous "
            "checkpoint under that name, if any, is untouched.") from error


def _failures(error: BaseException, me: int) -> dict[int, str]:
    """{rank: one line} of what failed where. DCP's CheckpointException already went round every rank and carries
    each failed rank's exception; a file listing that failed says which rank's (integrity.py ``rank_failures``)."""
    wrapped = getattr(error, "failures", None)
    if isinstance(wrapped, dict) and wrapped:
        return {int(r): _one_line(w[0] if isinstance(w, tuple) else w) for r, w in wrapped.items()}
    known = getattr(error, "rank_failures", None)
    if isinstance(known, dict) and known:
        return dict(known)
    return {me: _one_line(error)}


def _one_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def atomic_checkpoint_dir(path: _PathLike, barrier: Optional[Callable[[], None]] = None,
                          group=None) -> Iterator[Path]:
    """The temporary ``path.zero-tmp`` every rank of ``group`` (default: the world) writes into, renamed to
    ``path`` once all are done. ``barrier``: how those ranks wait for each other (default: a barrier over
    ``group``)."""
    if is_remote(path):  # a URL: a local staging directory, uploaded ([Note: checkpoints at fsspec locations])
        with remote_checkpoint_dir(path, group) as staged:
            yield staged
        return
    path = Path(path)
    tmp, old = path.with_name(path.name + _TMP), aside_path(path)
    wait = barrier if barrier is not None else (lambda: _barrier(group))
    first = _rank(group) == 0
    error: Optional[BaseException] = None
    if first:
        try:
            tidy_checkpoint_dir(path.parent)  # what crashed saves left behind
            tmp.mkdir(parents=True)
        except Exception as err:  # an unwritable location: every rank hears of it (the note above)
            error = err
    agree_on_failure(error, path, group)
    try:
        yield tmp
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        error = err
    try:
        if isinstance(error, CheckpointWriteError):  # agreed inside already: raised on every rank alike
            raise error
        agree_on_failure(error, path, group)
    except CheckpointWriteError:
        # its partial copy must not stay behind; the directory is shared, so whichever rank gets here removes it
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if first:
        try:
            _commit(tmp, path, old)
        except Exception as err:
            error = err
    agree_on_failure(error, path, group)
    wait()


def _commit(tmp: Path, path: Path, old: Path) -> None:
    """``tmp`` under the name ``path``, which is never missing while a complete copy exists (files.py)."""
    if os.path.lexists(path) and swap_dirs(tmp, path):  # one atomic exchange: ``path`` never missing
        _remove(tmp)  # now the previous copy
        return
    if os.path.lexists(path):  # a name that exists is complete, so the old copy (if any) is redundant
        _remove(old)
        os.rename(path, old)
    os.rename(tmp, path)  # until this rename, ``old`` is the complete copy loads (and "last") fall back to
    _remove(old)
