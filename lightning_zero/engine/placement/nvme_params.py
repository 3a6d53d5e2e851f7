"""Stage-3 parameter shards in an NVMe scratch file, read ahead of their gathers through a ring (ZeRO-Infinity).

Design note
-----------
With ``offload_params="nvme"`` each unit's flat ``shard`` (this rank's slices, compute dtype) has a region of
the rank's parameter scratch file. The ``Unit.shard`` tensor keeps its identity, shape and dtype -- and so do
its views, the bucket table's sources -- but between uses its storage holds 0 bytes (``ShardHome.ON_DISK``),
as a released parameter does. What needs the values:

* a gather (partition.py): :meth:`NvmeParams.send_of` hands it a ring slot holding the unit's bytes, read by
  the reader thread ahead of use. The reads are issued by the partitioner's own prefetch: the units after the
  ``prefetch`` ones it gathers ahead in the recorded order (forward and backward) get :meth:`read_ahead`, as
  many as there are free slots. A slot stays taken until the gather no longer reads it (CPU: the all-gather
  has completed; CUDA: the pinned slot's host->device copy, guarded by an event);
* the step's publish (publish.py): :meth:`write_slices` writes each updated master, cast to the shard's
  dtype, straight into its place in the region (``os.pwritev``; no read-modify-write: a source is a
  contiguous slice of its unit's shard), so the step ends with the file holding the new shards;
* whole views (checkpoints, a full state dict loaded): :meth:`make_resident` gives each shard its own memory
  again (``ShardHome.RESIDENT``; views stay valid: the storage is resized in place); the next step's end
  (:meth:`spill`) writes them back and frees them;
* masters taken from the shards (setup, ``add_param_group``): :meth:`unit_resident` reads one unit's shard
  back for the block that copies them (the optimizer's ``source_scope``).

So the host bytes held for parameter shards are the ring, :attr:`NvmeParams.ring_bytes` = ``slots`` x the
largest unit shard, whatever the model size (plus, on the CPU, the gathered units themselves: the working
set). Setup is bounded too, unit by unit: each unit's fp32 shard goes into the file as soon as it is cut
(:meth:`stage`; deferred init cuts them as the module is built), the masters are taken from one unit read
back at a time (:meth:`unit_resident`), and a training engine's cast to the compute dtype reads one fp32
shard, writes it in the compute dtype into its region and frees it (:meth:`cast`). A compute dtype other than
fp32 stages the fp32 shards in regions after the final ones, which the file gives back (``ftruncate``) once
every shard is cast; the free-space check counts both. I/O
errors are recorded in :attr:`failure` (a gather still runs, on whatever the slot holds: its peers wait in
it) and one agreement raises on every rank (``io_agreement.raise_if_any_rank_failed``): the engine's after the
step, or, evaluating, the partitioner's at the end of the evaluation (``join``) -- an evaluation-only engine
on one rank raises at the gather itself.

The file uses the page cache (``nvme_direct`` is the optimizer file's): the publish writes unaligned
slices of a region. Every region is written in the same pieces, one per parameter slice (and the padding
between), so that a slice the publish rewrites replaces exactly its piece's CRC32 and a read checks them all
([Note: verified scratch reads], engine/placement/nvme_checksums.py).
"""

from __future__ import annotations

import contextlib
import enum
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from .nvme import ScratchFile, aligned_empty
from .nvme_space import io_failure, prepare_scratch
from .param_stores import ParamShardStore
from .location import Location

_ALIGN = 4096  # every unit's region starts on a page


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _pieces(layout) -> list[int]:
    """A unit shard cut at every parameter slice's ends (the publish's writes), in elements, covering it."""
    cuts = sorted({0, layout.shard_numel} | {c for off, spec in zip(layout.offsets, layout.specs)
                                             for c in (off, off + spec.shard_len)})
    return [b - a for a, b in zip(cuts, cuts[1:])]


class ShardHome(enum.Enum):
    RESIDENT = "resident"  # the shard's own storage holds the values (setup, whole views)
    ON_DISK = "on_disk"  # only in the file; the shard's storage holds 0 bytes
    STAGED = "staged"  # setup, before the cast to the compute dtype: fp32, in its staging region


class SlotUse(enum.Enum):
    FREE = "free"
    READ = "read"  # a read ahead issued (or done) for a unit not yet gathering: may be dropped
    SENDING = "sending"  # a gather reads the slot: kept until the gather no longer needs it


@dataclass
class _Slot:
    buf: torch.Tensor  # uint8, the ring's own memory
    unit: Optional[int] = None
    use: SlotUse = SlotUse.FREE
    read: Optional[Future] = None
    event: Optional[object] = None  # CUDA: the host->device copy out of the slot; synchronized before a reuse


@dataclass
class _Region:
    offset: int
    nbytes: int


class NvmeParams(ParamShardStore):
    """One rank's stage-3 parameter shards in a scratch file between uses: the ``"nvme"`` parameter-shard
    store ([Note: parameter-shard stores], param_stores.py)."""

    location = Location.NVME
    masters_may_alias = False  # a shard's storage is empty whenever it is on disk
    gathers_one_at_a_time = True  # a whole-model gather holds one unit's shard in the ring at a time
    checks_io = True

    def __init__(self, units, shard_dtype: torch.dtype, directory: str, rank: int, slots: int,
                 pin: bool = False, group=None, device: Optional[torch.device] = None) -> None:
        """``shard_dtype``: the dtype the shards will have when spilled (the compute dtype of a training
        engine); ``slots``: ring buffers, each of the largest unit shard. Planned before the shards are cut
        (from the units' layouts): free space is checked (with the bytes needed) and the file reserved before
        anything is written."""
        super().__init__(device if device is not None else torch.device("cpu"), torch.device("cpu"))
        self.units = {u.index: u for u in units if u.params and u.layout.shard_numel}
        esize = torch.empty((), dtype=shard_dtype).element_size()
        self.regions: dict[int, _Region] = {}
        end = 0
        for i, u in self.units.items():
            self.regions[i] = _Region(end, u.layout.shard_numel * esize)
            end += _up(u.layout.shard_numel * esize, _ALIGN)
        self.staging = self.regions  # where a unit's fp32 shard waits for the cast (setup)
        self._pieces = {i: _pieces(u.layout) for i, u in self.units.items()}  # elements per checksummed block
        total = end
        if shard_dtype != torch.float32:
            self.staging = {}
            for i, u in self.units.items():
                self.staging[i] = _Region(total, u.layout.shard_numel * 4)
                total += _up(u.layout.shard_numel * 4, _ALIGN)
        staged = "" if total == end else f", and {total - end:,} bytes more in fp32 during setup"
        self.file = prepare_scratch(directory, total, f"stage-3 parameter shards ({esize} bytes per element"
                                    f"{staged})", self.knob, rank, group,  # [Note: scratch space for the node]
                                    lambda: ScratchFile(directory, rank, tag="params"))
        self.file_bytes = end
        self.home = {i: ShardHome.RESIDENT for i in self.units}  # the shards are cut next: stage()
        self.slot_bytes = max((r.nbytes for r in self.regions.values()), default=0)
        # at most one slot per unit: more could never hold a read, and the ring must not outgrow the shards
        self.ring = [_Slot(aligned_empty(self.slot_bytes, pin)) for _ in range(min(slots, max(1, len(self.units))))]
        self._reader: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(1, thread_name_prefix="lightning_zero-params")
        self.failure: Optional[str] = None  # the first I/O error on this rank since the last agreement
        self.bytes_read = self.bytes_written = 0  # counted once a read is used / a write returned
        self.reads_ahead = self.reads_waited = 0  # reads issued ahead of their gather; gathers that read themselves

    @property
    def ring_bytes(self) -> int:
        """The bound on host bytes held for parameter shards during training (the ring's buffers)."""
        return len(self.ring) * self.slot_bytes

    @property
    def read_ahead_depth(self) -> int:
        return len(self.ring)

    def bytes_by_location(self) -> dict[Location, int]:
        on_disk = self.on_disk_bytes()
        return {Location.HOST: self.shard_bytes() - on_disk, Location.NVME: on_disk}

    # -- where the shards are -----------------------------------------------------------------------
    @staticmethod
    def _bytes_of(u) -> torch.Tensor:
        return u.shard.view(-1).view(torch.uint8)

    def resident(self, u) -> bool:
        return self.home.get(u.index, ShardHome.RESIDENT) is ShardHome.RESIDENT

    def on_disk_bytes(self) -> int:
        """Bytes of parameter shards only in the file now."""
        return sum(self._region(i).nbytes for i, h in self.home.items() if h is not ShardHome.RESIDENT)

    def _write_region(self, u, offset: int) -> None:
        """``u``'s whole shard at ``offset``, checksummed piece by piece (the publish rewrites single pieces)."""
        esize = u.shard.element_size()
        self.file.write(self._bytes_of(u), offset, [n * esize for n in self._pieces[u.index]])

    def _region(self, i: int) -> _Region:
        return self.staging[i] if self.home[i] is ShardHome.STAGED else self.regions[i]

    # -- setup, unit by unit ------------------------------------------------------------------------
    def install(self, u, chunk: torch.Tensor) -> None:
        """``chunk`` in memory of its own size (spilling frees exactly it; the ring is pinned, the shards not),
        then into the file: setup holds one unit's shard at a time."""
        chunk = chunk.cpu()
        if chunk.untyped_storage().nbytes() != chunk.numel() * chunk.element_size():
            chunk = chunk.clone()
        u.shard = chunk
        self.stage(u)

    def readable(self, u):
        return self.unit_resident(u)

    @torch.no_grad()
    def stage(self, u) -> None:
        """``u``'s fp32 shard, just cut, into the file and its memory freed (a failed write keeps it: the
        setup's agreement raises)."""
        if u.index not in self.units:
            return
        r = self.staging[u.index]
        if u.shard.dtype != torch.float32 or u.shard.numel() * 4 != r.nbytes:
            raise RuntimeError(f"offload_params='nvme': unit '{u.name}' was cut as {u.shard.numel()} "
                               f"{u.shard.dtype} elements, not the fp32 shard its file region was planned for")
        if self._io(self._write_region, u, r.offset, "write"):
            self.bytes_written += r.nbytes
            u.shard.untyped_storage().resize_(0)
            self.home[u.index] = ShardHome.ON_DISK if self.staging is self.regions else ShardHome.STAGED

    @contextlib.contextmanager
    def unit_resident(self, u):
        """``u``'s shard in memory of its own for a block that reads it (the masters are taken from it),
        freed again after; read errors raise (setup)."""
        i = u.index
        if i not in self.units or self.home[i] is ShardHome.RESIDENT:
            yield
            return
        r = self._region(i)
        u.shard.untyped_storage().resize_(r.nbytes)
        try:
            self.file.read(self._bytes_of(u), r.offset)
            self.bytes_read += r.nbytes
            yield
        finally:
            u.shard.untyped_storage().resize_(0)

    def cast(self, u, dtype: torch.dtype) -> None:
        if not self._cast_staged(u, dtype):
            u.shard = u.shard.to(dtype)

    @torch.no_grad()
    def _cast_staged(self, u, dtype: torch.dtype) -> bool:
        """A staged unit's shard as ``dtype`` into its region, one unit in memory (False: not staged here)."""
        if u.index not in self.units or self.home[u.index] is not ShardHome.STAGED:
            return False
        with self.unit_resident(u):
            new = u.shard.to(dtype)
        u.shard = new
        self.home[u.index] = ShardHome.RESIDENT  # a failed write keeps it so: the setup's agreement raises
        if self._io(self._write_region, u, self.regions[u.index].offset, "write"):
            self.bytes_written += self.regions[u.index].nbytes
            new.untyped_storage().resize_(0)
            self.home[u.index] = ShardHome.ON_DISK
        self._drop_staging()
        return True

    def _drop_staging(self) -> None:
        if self.staging is not self.regions and ShardHome.STAGED not in self.home.values():
            self.file.truncate(self.file_bytes)  # every shard cast: the staging regions are spent
            self.staging = self.regions

    @torch.no_grad()
    def spill(self) -> None:
        """Every resident shard into its region, its memory freed (setup's end, the end of every step)."""
        self.drop_reads()
        if ShardHome.STAGED in self.home.values():
            raise RuntimeError("offload_params='nvme': shards staged in fp32 were not cast to the compute dtype")
        self._drop_staging()
        for i, u in self.units.items():
            if self.home[i] is not ShardHome.RESIDENT:
                continue
            if u.shard.dtype.itemsize * u.shard.numel() != self.regions[i].nbytes:
                raise RuntimeError(f"offload_params='nvme': unit '{u.name}' holds {u.shard.dtype} shards, not the "
                                   f"dtype its file region was planned for")
            if not self._io(self._write_region, u, self.regions[i].offset, "write"):
                continue  # kept in memory: the run stops at the agreement, nothing is lost before it
            self.bytes_written += self.regions[i].nbytes
            u.shard.untyped_storage().resize_(0)
            self.home[i] = ShardHome.ON_DISK

    @torch.no_grad()
    def make_resident(self) -> None:
        """Every shard back in memory of its own (checkpoints, loading, whole views); read errors raise."""
        self.drop_reads()
        for i, u in self.units.items():
            if self.home[i] is ShardHome.RESIDENT:
                continue
            r = self._region(i)
            u.shard.untyped_storage().resize_(r.nbytes)
            self.file.read(self._bytes_of(u), r.offset)
            self.bytes_read += r.nbytes
            self.home[i] = ShardHome.RESIDENT

    # -- the ring -----------------------------------------------------------------------------------
    def _slot_of(self, index: int) -> Optional[_Slot]:
        return next((s for s in self.ring if s.unit == index and s.use is not SlotUse.FREE), None)

    def _free(self, s: _Slot) -> None:
        s.unit, s.use, s.read = None, SlotUse.FREE, None

    def _issue(self, s: _Slot, index: int) -> None:
        if s.event is not None:  # the slot's last send may still be copying to the device
            s.event.synchronize()
            s.event = None
        r = self.regions[index]
        s.unit, s.use = index, SlotUse.READ
        s.read = self._reader.submit(self.file.read, s.buf[: r.nbytes], r.offset)

    def read_ahead(self, u) -> None:
        """Read ``u``'s shard into a free slot on the reader thread (nothing if none is free: the gather
        then reads it itself)."""
        if u.index not in self.units or self.resident(u) or self._slot_of(u.index) is not None:
            return
        free = next((s for s in self.ring if s.use is SlotUse.FREE), None)
        if free is not None:
            self.reads_ahead += 1
            self._issue(free, u.index)

    def _take(self, index: int) -> _Slot:
        """A slot for a gather that was not read ahead: a free one, else one holding a read ahead."""
        s = next((s for s in self.ring if s.use is SlotUse.FREE), None)
        if s is None:
            s = next((s for s in self.ring if s.use is SlotUse.READ), None)
            if s is None:
                raise RuntimeError(f"offload_params='nvme': all {len(self.ring)} ring slots are held by gathers in "
                                   f"flight (prefetch deeper than the ring); raise nvme_buffer_count.")
            self._wait(s)
        self.reads_waited += 1
        self._issue(s, index)
        return s

    def _wait(self, s: _Slot) -> bool:
        ok = self._io(lambda: s.read.result(), None, None, "read") if s.read is not None else True
        s.read = None
        return ok

    @torch.no_grad()
    def send_of(self, u) -> torch.Tensor:
        """The tensor ``u``'s all-gather sends: its shard (resident) or the ring slot its bytes were read
        into; on CUDA the slot's copy on ``device`` (the slot is free again once that copy has run)."""
        device = self.device
        if self.resident(u):
            return u.shard.to(device, non_blocking=True)
        s = self._slot_of(u.index) or self._take(u.index)
        if self._wait(s):
            self.bytes_read += self.regions[u.index].nbytes
        view = s.buf[: self.regions[u.index].nbytes].view(u.shard.dtype)
        if device.type == "cuda":
            out = view.to(device, non_blocking=True)
            s.event = torch.cuda.Event()
            s.event.record(torch.cuda.current_stream(device))
            self._free(s)
            return out
        s.use = SlotUse.SENDING
        return view

    def gather_done(self, u) -> None:
        """``u``'s all-gather has completed: its slot may take the next read."""
        s = self._slot_of(u.index)
        if s is not None and s.use is SlotUse.SENDING:
            self._free(s)

    def drop_reads(self) -> None:
        """Reads ahead no gather used (the end of backward, before the shards change): waited for, dropped."""
        for s in self.ring:
            if s.use is SlotUse.READ:
                if s.read is not None:
                    try:
                        s.read.result()
                    except OSError:
                        pass  # nothing used it
                self._free(s)

    # -- the step's publish -------------------------------------------------------------------------
    @torch.no_grad()
    def write_slices(self, u, pairs, non_blocking: bool = False) -> None:
        """``pairs``: (source, master): each master, cast to the shard's dtype, into its source's place --
        in memory when the shard is resident, else straight into the file."""
        if self.resident(u):
            for src, m in pairs:
                src.copy_(m)
            return
        s = self._slot_of(u.index)
        if s is not None and s.use is SlotUse.READ:  # a stale read ahead (none are issued during a step)
            self._wait(s)
            self._free(s)
        esize, base, region = u.shard.element_size(), u.shard.storage_offset(), self.regions[u.index]
        for src, m in pairs:
            lo = src.storage_offset() - base
            if lo < 0 or lo + src.numel() > u.shard.numel():
                raise RuntimeError(f"offload_params='nvme': a source of unit '{u.name}' is not a slice of its shard")
            data = m.detach().reshape(-1).to(device="cpu", dtype=u.shard.dtype).contiguous()
            if self._io(self.file.write, data, region.offset + lo * esize, "write"):
                self.bytes_written += data.numel() * esize

    # -- errors, teardown ---------------------------------------------------------------------------
    def _io(self, fn, buf, offset, what: str) -> bool:
        try:
            fn() if buf is None else fn(buf, offset)
            return True
        except OSError as e:
            if self.failure is None:
                self.failure = io_failure(what, self.file.path, e)
            return False

    def close(self) -> None:
        """Remove the scratch file, drop the ring (idempotent)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self.file.close()
        self.ring = []
