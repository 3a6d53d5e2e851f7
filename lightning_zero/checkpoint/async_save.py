"""Checkpoint saves that write in the background while training goes on. No Lightning.

[Note: asynchronous checkpoint saves]
A synchronous save keeps every rank out of training for DCP's write, the integrity listing (a CRC-32 of every
byte) and the commit. An asynchronous save keeps them out only for the first half of [Note: a save in two
halves] (prepared.py) and a copy: :meth:`AsyncCheckpointer.save` prepares the directory on the training
thread (its collectives run on the training group, in step with the other ranks), copies every tensor of it
into host memory of its own (page-locked on a GPU machine, the copies queued on the current stream behind the
step that made the values, so the stall is the time to queue them), hands bf16 masters back narrowed, and
returns. A background thread then waits for the copies, writes the copy and commits the directory exactly as
a synchronous save would (atomic.py), with every collective on a gloo group of its own
(engine/layout/groups.py ``checkpoint_group``): the training thread's collectives go on meanwhile, and two
threads' collectives on one group would interleave.

What the user can rely on:
- *One save in flight.* The next save (and :meth:`wait`) first waits for the previous one; the wait is
  logged and recorded (:attr:`AsyncCheckpointer.records`), so a save interval shorter than the write shows.
- *Visible only when complete.* The directory appears under its name by the same atomic commit as a
  synchronous save. Whatever the caller wants done once the save is complete -- ModelCheckpoint's removal of
  the checkpoint the new one replaces in its top-k -- is handed to :meth:`after_commit` and runs only after the
  commit; after a failed save it never runs (the older checkpoint stays on disk).
- *Never silent.* A failed write (on any rank: [Note: every rank agrees on a save's failure]) is raised on
  every rank by the next :meth:`raise_if_failed` -- the Lightning layer calls it at each training step, each
  save and at teardown -- as a :class:`~lightning_zero.checkpoint.atomic.CheckpointWriteError`.
- *Killed mid-write:* the previous checkpoint under that name is untouched (only ``X.zero-tmp`` is being
  written); the next save in that directory removes the temporary.
The price is memory: the copy of this rank's share of the checkpoint lives in host memory until written (the
copies of a CUDA run are kept for the next save: page-locking is slow; a CPU run's are freed).
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..engine.comm.collectives import rank as _rank
from .atomic import CheckpointWriteError, atomic_checkpoint_dir
from .prepared import release_saved_state, write_prepared

log = logging.getLogger("lightning_zero.checkpoint")


class SaveState(enum.Enum):
    IDLE = "idle"        # no save in flight; the last one (if any) is complete
    WRITING = "writing"  # a background thread writes the staged copy
    FAILED = "failed"    # the last save failed; :meth:`raise_if_failed` raises it once


@dataclass
class SaveRecord:
    """One save as the training thread met it: ``waited_s`` for the previous save, ``staged_s`` to prepare and
    copy (together: how long training stood still), ``written_s`` in the background (None until done)."""

    path: str
    waited_s: float
    staged_s: float
    written_s: Optional[float] = None
    error: Optional[str] = None
    bytes_staged: int = 0
    _t0: float = field(default=0.0, repr=False)


class AsyncCheckpointer:
    """At most one checkpoint write in flight, in a background thread. Collective: every rank of the world
    calls :meth:`save` with the same path and the same parts, in the same order."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._after: list[Callable[[], None]] = []
        self._open = False  # a save is in flight whose after_commit queue is not yet taken
        self._lock = threading.Lock()
        self.records: list[SaveRecord] = []
        self.slow_wait_s = 1.0  # a save that waits longer for the previous one is warned about (once)
        self._warned = False
        _LIVE.add(self)

    @property
    def state(self) -> SaveState:
        if self._thread is not None and self._thread.is_alive():
            return SaveState.WRITING
        return SaveState.FAILED if self._error is not None else SaveState.IDLE

    def save(self, path, parts: Sequence[tuple], engines: Sequence[Any] = (), finish: Optional[Callable] = None,
             groups: Sequence[Any] = ()) -> SaveRecord:
        """Stage ``parts`` and write them in the background. Each part: a directory relative to ``path`` ("" for
        ``path`` itself), its prepared content and, optionally, the training group it was prepared over (a
        pipeline stage's data-parallel group; default: the world). ``finish(tmp, group_of)`` runs on every
        rank after them, inside the same atomic directory (a manifest); ``group_of(g)`` is the background group
        standing for training group ``g``, for ``g`` among the parts' groups and ``groups``. ``engines``: those
        whose bf16 masters were widened for the save."""
        waited = self.wait()
        if waited > self.slow_wait_s and not self._warned and _rank() == 0:
            self._warned = True  # once per writer: the records and teardown's line keep the count
            warnings.warn(f"lightning_zero: this checkpoint save waited {waited:.1f} s for the previous one to be "
                          f"written ({self.records[-1].written_s or 0:.1f} s in the background): saves are asked "
                          "for faster than they are written, and training stands still for the difference. Save "
                          "less often, or to faster storage.", stacklevel=2)
        start = time.perf_counter()
        mirrors = {_key(g): _group(g) for g in [None, *(p[2] for p in parts if len(p) > 2), *groups]}
        pinned = torch.cuda.is_available()
        staged, events = [], []
        try:
            for part in parts:
                copy, done = part[1].staged(pinned)
                staged.append((part[0], copy, mirrors[_key(part[2] if len(part) > 2 else None)]))
                events.append(done)
        finally:
            for engine in engines:
                release_saved_state(engine)
        record = SaveRecord(str(path), waited, time.perf_counter() - start, bytes_staged=_bytes(staged))
        record._t0 = time.perf_counter()
        self.records.append(record)
        self._open = True  # after_commit queues until the writer takes the queue (under the lock)
        self._thread = threading.Thread(target=self._write, args=(path, staged, events, finish,
                                                                 lambda g: mirrors[_key(g)], record),
                                        name="lightning_zero-checkpoint-save", daemon=True)
        self._thread.start()
        return record

    def _write(self, path, staged, events, finish, group_of, record: SaveRecord) -> None:
        try:
            for done in events:
                if done is not None:
                    done.synchronize()
            with atomic_checkpoint_dir(path, group=group_of(None)) as tmp:
                for sub, prepared, group in staged:
                    write_prepared(tmp / sub if sub else tmp, prepared, group)
                if finish is not None:
                    finish(tmp, group_of)
        except BaseException as err:  # raised on the training thread by raise_if_failed (the note above)
            record.error = str(err)
            with self._lock:
                self._error, self._after, self._open = err, [], False
            return
        finally:
            staged.clear()  # the host copy goes as soon as it is written
        record.written_s = time.perf_counter() - record._t0
        with self._lock:
            after, self._after, self._open = self._after, [], False
        for fn in after:
            try:
                fn()
            except Exception as err:  # a removal that fails must not hide the save that succeeded
                log.warning("lightning_zero: after saving %s: %s: %s", path, type(err).__name__, err)

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the save in flight is complete (now if none is); never if it fails -- nor while the
        last save's failure is unreported (the save ``fn`` follows did not land)."""
        with self._lock:
            if self._open:  # not "is the thread alive": it may have taken the queue already
                self._after.append(fn)
                return
            if self._error is not None:
                return
        fn()

    def wait(self, timeout: Optional[float] = None) -> float:
        """Wait for the save in flight; raise its failure. Returns the seconds waited."""
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join(timeout)
        waited = time.perf_counter() - start
        if waited > 0.01 and _rank() == 0:
            log.info("lightning_zero: waited %.2f s for the previous checkpoint save to finish", waited)
        self.raise_if_failed()
        return waited

    def raise_if_failed(self) -> None:
        """Raise the last save's failure (once) if it has failed; nothing while it still runs."""
        if self.state is not SaveState.FAILED:
            return
        with self._lock:
            err, self._error = self._error, None
        record = self.records[-1] if self.records else None
        where = f" of {record.path!r}" if record is not None else ""
        raise CheckpointWriteError(f"The background checkpoint save{where} failed: {err}") from err

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for the save in flight (at most ``timeout`` seconds) and raise its failure."""
        self.wait(timeout)

    def summary(self) -> Optional[str]:
        """One line on what this writer's saves cost the training thread, and what ran in the background."""
        if not self.records:
            return None
        waited = sum(r.waited_s for r in self.records)
        staged = sum(r.staged_s for r in self.records)
        written = [r.written_s for r in self.records if r.written_s is not None]
        return (f"lightning_zero: {len(self.records)} background checkpoint save(s); training stood still "
                f"{waited + staged:.2f} s for them ({staged:.2f} s staging {_mib(self.records[-1].bytes_staged)} "
                f"per save, {waited:.2f} s waiting for an earlier save); the writes took {sum(written):.2f} s "
                f"in the background.")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _key(group) -> Any:
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def _group(group=None):
    """The background writer's stand-in for training group ``group`` (None: the world); None without one."""
    # a group of one rank is a group too: None would mean the world to DCP (a pipeline stage's lone replica)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from ..engine.layout.groups import checkpoint_group

        return checkpoint_group(group)
    return None


def _bytes(staged) -> int:
    seen: dict[int, int] = {}

    def walk(x: Any) -> None:
        if torch.is_tensor(x):
            local = x.to_local() if hasattr(x, "to_local") else x
            seen[local.data_ptr()] = local.numel() * local.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for part in staged:
        walk(part[1].tensors)
    return sum(seen.values())


_LIVE: "weakref.WeakSet[AsyncCheckpointer]" = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    """A script that ends after a save (no teardown) still gets its checkpoint: the write is waited for."""
    for saver in list(_LIVE):
        if saver._thread is not None and saver._thread.is_alive():
            saver._thread.join()
        if saver._error is not None:
            log.error("lightning_zero: the background checkpoint save failed: %s", saver._error)
