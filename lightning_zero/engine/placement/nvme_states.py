"""The states of one ShardedOptimizer in NVMe files, streamed through a ring of host buffers (ZeRO-Infinity).

Design note
-----------
The NVMe path is the CPU-offload step whose states live on disk between steps, not a second optimizer:
the user's optimizer (fused CPU kernel or the user's own, ``offload_kernel``) steps the same master tensors,
bucket by bucket. A *chunk* is one gradient bucket's fp32 masters (those that are not a stage-3 host shard
already) followed by their per-element optimizer state (``exp_avg``, ``exp_avg_sq``, ...), one region of the
rank's scratch file. Between steps every such tensor keeps its shape but holds no memory (its storage is
resized to 0 bytes, as FSDP frees unsharded parameters); during the step::

    reader thread:  read chunk k+1 into ring slot (k+1) % B       (os.preadv, GIL released)
    main thread:    bind chunk k's tensors to slot k % B (Tensor.set_), step them, publish them, unbind
    writer thread:  write chunk k-1 from its slot                 (os.pwritev)

so a step costs about max(read + write, compute) per chunk and the host memory these states take is the ring
(:attr:`NvmeStates.ring_bytes`): ``nvme_buffer_count`` slots, slot j sized to the largest of the chunks
j, j + B, ... it holds, so the ring follows the states it streams -- never more than they are (fewer chunks than
slots: one slot each), and far less when they are many buckets. A chunk is a whole bucket, and a master a whole
parameter's slice: a model whose states are a few buckets, or one parameter (a large vocabulary's embedding),
has a ring about as large as its states and NVMe saves it no host memory; the first step says so
(docs/nvme_offload.md, "From which size NVMe pays"). The first step's optimizer creates its state tensors in
ordinary memory; they are copied into the slot before the write and freed. Anything else that reads the masters
or the state (checkpoints, whole-model views, the consolidated optimizer state) first calls
:meth:`NvmeStates.make_resident`, which reads every chunk back into memory of its own; the next step streams it
out again. Every read is whole and checked against the CRC32s of what this run wrote
([Note: verified scratch reads], nvme_checksums.py): a damaged file is an I/O failure of the step like a failed
read, raised on every rank by :func:`~.io_agreement.raise_if_any_rank_failed`.

[Note: NVMe states outlive teardown]
A finished fit keeps its engine so that ``trainer.save_checkpoint`` after it writes the optimizer state
([Note: the trained state outlives fit], lightning/strategy.py). With NVMe offload that state *is* the scratch
file, so the strategies' teardown removes the engine with ``keep_states=True`` and the file lives as long as
the strategy can still save it: until the next fit's setup replaces the engine (``ZeroEngine.release_states``),
the strategy is collected (``weakref.finalize``) or the process exits -- atexit, or, for a rank that
``multiprocessing`` ends with ``os._exit`` (Lightning's fork / spawn launchers), its exit finalizers
(``ScratchFile``, engine/placement/nvme.py). A detached engine that saved reads its states back to save them and
writes them out again after (:meth:`NvmeStates.spill`), so a kept engine holds no more host memory than the
ring. Stage 3's parameter file is not kept: once the module is handed back whole its values are the module's.
"""

from __future__ import annotations

import enum
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..memory.floors import optimizer_state_bytes_per_param
from .nvme import DIRECT_ALIGN, ScratchFile, aligned_empty
from .nvme_space import io_failure, prepare_scratch
from .location import Location
from .state_stores import StateStore

_log = logging.getLogger("lightning_zero.engine")
_ALIGN = 4096  # chunk regions start on a page (and an O_DIRECT block) boundary
_ENTRY_ALIGN = 64  # every tensor in a chunk starts on a cache line (and any dtype's element boundary)


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def predicted_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Per-element optimizer state bytes the chunks reserve room for (the first step creates the state)."""
    name = type(optimizer).__name__.lower()
    groups = optimizer.param_groups
    if name == "sgd":
        return 4 if any(g.get("momentum", 0) for g in groups) else 0
    try:
        k = optimizer_state_bytes_per_param(name)
    except ValueError:
        k = 8  # an elementwise optimizer registered as shardable: Adam's two moments; more stays in memory
    return k + (4 if any(g.get("amsgrad") for g in groups) else 0)


class NvmeState(enum.Enum):
    OPEN = "open"  # the scratch file exists; states are on disk or resident
    CLOSED = "closed"  # torn down: the file is removed, offloaded tensors are gone


def _is_swapped(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


@torch.no_grad()
def _swap_out(t: torch.Tensor) -> None:
    """Keep the tensor (identity, shape, dtype: the optimizer's state keys and ``.grad`` stay valid), free
    its memory: a storage of its size is set, then resized to nothing (malloc'd, never touched)."""
    placeholder = torch.UntypedStorage(t.numel() * t.element_size())
    t.set_(placeholder, 0, t.shape, t.stride())
    placeholder.resize_(0)


@torch.no_grad()
def _bind(t: torch.Tensor, slot: torch.Tensor, byte_offset: int) -> None:
    """Point ``t`` at ``slot``'s bytes from ``byte_offset`` (the slot may be a view of a larger, aligned buffer)."""
    t.set_(slot.untyped_storage(), (slot.storage_offset() + byte_offset) // t.element_size(), t.shape, t.stride())


@dataclass
class _Entry:
    offset: int  # bytes from the chunk region's start
    nbytes: int
    key: Optional[str] = None  # None: the master itself, else its optimizer-state key
    master: int = 0  # index in the chunk's master row


@dataclass
class _Chunk:
    masters: list  # the row of masters (aliased ones included: they are stepped, never swapped)
    swap: list[bool]  # per master: lives in the file
    offset: int  # region start in the file
    capacity: int  # region bytes
    entries: list[_Entry] = field(default_factory=list)
    used: int = 0  # bytes of the region entries take
    on_disk: int = 0  # bytes of the region written so far (a read reads only these)


class NvmeStates(StateStore):
    """One ShardedOptimizer's masters and optimizer state, on disk between steps: the ``"nvme"`` state store
    ([Note: optimizer-state stores], state_stores.py)."""

    location = Location.NVME
    masters_alias_params = False
    streams = True
    checks_io = True

    def __init__(self, directory: str, rank: int, buffer_count: int, direct: bool = False, group=None) -> None:
        super().__init__()
        self.directory = directory
        self.buffer_count = buffer_count
        self.pin, self._direct, self._group = torch.cuda.is_available(), direct, group  # pin: the ring's slots
        self.file: Optional[ScratchFile] = None  # reserve() creates it, once the sizes are known
        self._align = DIRECT_ALIGN if direct else 1  # O_DIRECT: page-aligned buffers and lengths
        self.chunks: list[_Chunk] = []
        self._end = 0  # bump allocator over the file
        self.ring: list[torch.Tensor] = []
        self._io: Optional[tuple[ThreadPoolExecutor, ThreadPoolExecutor]] = None
        self.state = NvmeState.OPEN
        self.rank = rank
        self._warned_overflow = self._warned_ring = False
        self.failure: Optional[str] = None  # the last step's first I/O error on this rank

    def reserve(self, optimizer: torch.optim.Optimizer, planned_numel: list[list[int]],
                planned_swap: list[list[bool]]) -> None:
        """``planned_*``: per bucket, the master sizes and whether each lives in the file: the free space
        is checked for all of them, on every rank of the group sharing the disk, before anything is written
        ([Note: scratch space for the node], nvme_space.py)."""
        self.optimizer = optimizer
        self.state_per_elem = predicted_state_bytes(optimizer)
        needed = sum(self._capacity(n, s) for n, s in zip(planned_numel, planned_swap))
        what = f"fp32 masters and optimizer state ({4 + self.state_per_elem} bytes per element)"
        self.file = prepare_scratch(self.directory, needed, what, self.knob, self.rank, self._group,
                                    lambda: ScratchFile(self.directory, self.rank, direct=self._direct))

    def step(self, optimizer, step_bucket, after_bucket) -> None:
        self.stream(step_bucket, after_bucket)

    def bytes_by_location(self, nbytes: int) -> dict[Location, int]:
        on_disk = self.swapped_bytes()
        return {Location.HOST: nbytes - on_disk, Location.NVME: on_disk}

    def _capacity(self, numels: list[int], swap: list[bool]) -> int:
        elems = sum(numels)
        masters = sum(_up(4 * n, _ENTRY_ALIGN) for n, s in zip(numels, swap) if s)
        per_key = sum(_up(4 * n, _ENTRY_ALIGN) for n in numels)
        return _up(masters + per_key * (self.state_per_elem // 4) if elems else 0, _ALIGN)

    # -- setup ----------------------------------------------------------------------------------------
    def add_chunk(self, masters: list[torch.Tensor], swap: list[bool]) -> None:
        """A bucket's masters join the file now (setup, add_param_group): written and freed one bucket at a
        time, so setup never holds more than one bucket's masters either."""
        cap = self._capacity([m.numel() for m in masters], swap)
        c = _Chunk(list(masters), list(swap), self._end, cap)
        self._end += cap
        for i, (m, s) in enumerate(zip(masters, swap)):
            if s:
                self._add_entry(c, m, None, i)
        self.chunks.append(c)
        self._write_resident(c)

    def _add_entry(self, c: _Chunk, t: torch.Tensor, key: Optional[str], i: int) -> bool:
        nbytes = t.numel() * t.element_size()
        if c.used + nbytes > c.capacity:
            return False
        c.entries.append(_Entry(c.used, nbytes, key, i))
        c.used = _up(c.used + nbytes, _ENTRY_ALIGN)
        return True

    def _tensor(self, c: _Chunk, e: _Entry) -> Optional[torch.Tensor]:
        m = c.masters[e.master]
        return m if e.key is None else self.optimizer.state.get(m, {}).get(e.key)

    def _write_resident(self, c: _Chunk) -> None:
        """Write the chunk's resident tensors through a slot of its own size (setup only) and free them."""
        slot = aligned_empty(c.capacity, align=self._align)
        self._fill_and_bind(c, slot)
        self._write(c, slot)
        c.on_disk = c.used
        self._unbind(c)

    # -- the ring ---------------------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        return max((c.capacity for c in self.chunks), default=0)

    def slot_sizes(self) -> list[int]:
        """Slot j holds chunks j, j + B, ... (B = the slots, at most one per chunk): the largest of them."""
        b = min(self.buffer_count, len(self.chunks))
        sizes = [0] * b
        for k, c in enumerate(self.chunks):
            sizes[k % b] = max(sizes[k % b], c.capacity)
        return sizes

    @property
    def ring_bytes(self) -> int:
        """The bound on the host bytes these states take during a step (the ring's buffers): at most the
        states themselves (:meth:`slot_sizes`)."""
        return sum(self.slot_sizes())

    @property
    def state_bytes(self) -> int:
        """Bytes of the file's regions: the masters + state the ring streams."""
        return sum(c.capacity for c in self.chunks)

    def _ring(self) -> list[torch.Tensor]:
        sizes = self.slot_sizes()
        if [t.numel() for t in self.ring] != sizes:  # first step, or a bucket joined (add_param_group)
            self.ring = [aligned_empty(n, self.pin, self._align) for n in sizes]
            if self.rank == 0 and 2 * self.ring_bytes > self.state_bytes and not self._warned_ring:
                self._warned_ring = True
                _log.warning("offload_optimizer='nvme': the ring is %.1f MiB of host memory for %.1f MiB of masters + "
                             "optimizer state per rank (its largest bucket: %.1f MiB); NVMe offload saves at most "
                             "%.1f MiB of host memory on this model. It pays when the states are many buckets and "
                             "no parameter's slice is a large part of them (docs/nvme_offload.md, 'From which size "
                             "NVMe pays'); offload_optimizer=True keeps them in host memory without the disk I/O.",
                             self.ring_bytes / 2**20, self.state_bytes / 2**20, self.slot_bytes / 2**20,
                             max(0, self.state_bytes - self.ring_bytes) / 2**20)
        return self.ring

    def _executors(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        if self._io is None:
            self._io = (ThreadPoolExecutor(1, thread_name_prefix="zero-nvme-read"),
                        ThreadPoolExecutor(1, thread_name_prefix="zero-nvme-write"))
        return self._io

    def _read(self, c: _Chunk, slot: torch.Tensor) -> None:
        self.file.read(slot[: _up(c.on_disk, self._align)], c.offset)

    def _write(self, c: _Chunk, slot: torch.Tensor) -> None:
        self.file.write(slot[: _up(c.used, self._align)], c.offset)  # capacity is page-aligned: room for it

    @torch.no_grad()
    def _fill_and_bind(self, c: _Chunk, slot: torch.Tensor) -> None:
        """Point every tensor of the chunk into ``slot``; a resident one (new state, just loaded, made
        resident) is copied in first, a swapped one finds its bytes there (read from the file)."""
        for e in c.entries:
            t = self._tensor(c, e)
            if t is None:
                continue  # state the optimizer has not created yet
            if t.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr():
                continue
            if not _is_swapped(t):
                slot[e.offset : e.offset + e.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            _bind(t, slot, e.offset)

    def _capture_new_state(self, c: _Chunk) -> None:
        """After the chunk's first step: its optimizer's per-element state tensors get places in the region."""
        known = {(e.master, e.key) for e in c.entries}
        for i, m in enumerate(c.masters):
            for key, v in self.optimizer.state.get(m, {}).items():
                if ((i, key) in known or not torch.is_tensor(v) or v.device.type != "cpu"
                        or v.shape != m.shape or v.dim() == 0):
                    continue
                if not self._add_entry(c, v, key, i) and not self._warned_overflow:
                    self._warned_overflow = True  # e.g. an optimizer with more state than predicted
                    _log.warning("offload_optimizer='nvme': %s keeps more per-element state than the %d bytes "
                                 "reserved; the excess stays in host memory.", type(self.optimizer).__name__,
                                 self.state_per_elem)

    def _unbind(self, c: _Chunk) -> None:
        for e in c.entries:
            t = self._tensor(c, e)
            if t is not None and not _is_swapped(t):
                _swap_out(t)

    def stream(self, step_chunk: Callable[[int], None], after_chunk: Optional[Callable[[int], None]] = None) -> None:
        """One pass over the chunks: read ahead, ``step_chunk(k)`` then ``after_chunk(k)`` (publish) while
        chunk k is in its slot, write back behind. An I/O error is recorded in :attr:`failure` (the rest of the
        pass still runs ``after_chunk``, a collective at stages 1-2, so every rank reaches the engine's
        agreement, :func:`~.io_agreement.raise_if_any_rank_failed`); a chunk whose read failed is not stepped."""
        self._check_open()
        self.failure = None
        ring, (reader, writer) = self._ring(), self._executors()
        n, b = len(self.chunks), len(ring)
        ahead = max(1, b - 2)
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}

        def issue_read(j: int) -> None:
            if j < n and j not in reads:
                if j - b in writes:  # the slot's previous chunk must be on disk before it is overwritten
                    self._wait(writes[j - b], "write")
                reads[j] = reader.submit(self._read, self.chunks[j], ring[j % b])

        for j in range(min(ahead, n)):
            issue_read(j)
        try:
            for k, c in enumerate(self.chunks):
                issue_read(k + ahead)
                read_ok = self._wait(reads.pop(k), "read")
                slot = ring[k % b]
                self._fill_and_bind(c, slot)
                if read_ok and self.failure is None:  # after a failure: no more updates, the run stops
                    step_chunk(k)
                if after_chunk is not None:
                    after_chunk(k)
                self._capture_new_state(c)
                self._fill_and_bind(c, slot)  # new state into the slot, then every tensor freed again
                self._unbind(c)
                c.on_disk = max(c.on_disk, c.used)
                writes[k] = writer.submit(self._write, c, slot)
        finally:  # never leave a thread writing into a slot the next step reuses
            for f in reads.values():
                self._wait(f, "read")
            for f in writes.values():
                self._wait(f, "write")

    def _wait(self, f: Future, what: str) -> bool:
        """Whether the I/O succeeded; the first failure is kept, worded for the error every rank raises."""
        try:
            f.result()
            return True
        except OSError as e:
            if self.failure is None:
                self.failure = io_failure(what, self.file.path, e)
            return False

    # -- whole views --------------------------------------------------------------------------------------
    @torch.no_grad()
    def make_resident(self) -> None:
        """Every master and state tensor back in memory of its own (checkpoints, whole-model views)."""
        self._check_open()
        for c in self.chunks:
            swapped = [(e, t) for e in c.entries for t in [self._tensor(c, e)] if t is not None and _is_swapped(t)]
            if not swapped:
                continue
            slot = aligned_empty(_up(c.on_disk, self._align), align=self._align)
            self._read(c, slot)
            for e, t in swapped:
                own = torch.empty(t.shape, dtype=t.dtype)
                own.view(-1).view(torch.uint8).copy_(slot[e.offset : e.offset + e.nbytes])
                t.set_(own.untyped_storage(), 0, t.shape, t.stride())

    @torch.no_grad()
    def spill(self) -> None:
        """Chunks read back whole (:meth:`make_resident`) written to their regions again and freed: a kept
        engine holds only the file between saves ([Note: NVMe states outlive teardown]); a training engine's
        next step streams them out itself. A chunk only partly resident is left to that step."""
        self._check_open()
        for c in self.chunks:
            held = [t for e in c.entries for t in [self._tensor(c, e)] if t is not None]
            if held and not any(_is_swapped(t) for t in held):
                self._write_resident(c)

    def resident_bytes(self) -> int:
        """Bytes of this optimizer's offloaded tensors now in host memory outside the ring."""
        return sum(e.nbytes for c in self.chunks for e in c.entries
                   for t in [self._tensor(c, e)] if t is not None and not _is_swapped(t))

    def swapped_bytes(self) -> int:
        """Bytes of this optimizer's masters and state that are only in the file now."""
        return sum(e.nbytes for c in self.chunks for e in c.entries
                   for t in [self._tensor(c, e)] if t is not None and _is_swapped(t))

    @property
    def file_bytes(self) -> int:
        """Bytes of states in the file (written so far)."""
        return sum(c.on_disk for c in self.chunks)

    def _check_open(self) -> None:
        if self.state is NvmeState.CLOSED:
            raise RuntimeError("offload_optimizer='nvme': the engine was torn down (its scratch file removed by "
                               "remove() or release_states()); its masters and optimizer state are gone. Save a "
                               "checkpoint before remove().")

    def close(self) -> None:
        """Remove the scratch file and drop the ring (idempotent)."""
        if self._io is not None:
            for ex in self._io:
                ex.shutdown(wait=True)
            self._io = None
        if self.file is not None:
            self.file.close()
        self.ring = []
        self.state = NvmeState.CLOSED
