"""Flat communication buffers reused within a backward or a step, none kept between them.

[Note: kept communication buffers]
Every step, each bucket needs the same transient flat buffers: the packed gradients its reduction reads,
the rows an all-to-all reduce-scatter receives, the rank-major buffer its publish all-gather fills; at stage
3 each unit's gather needs its output buffer, given back once unpacked into the parameters' storage. Made
fresh each time they are the engine's own allocations on the hot path (bench/allocations.py counted 7 a
step at stages 1-2), and on a CPU rank a fresh buffer of a few MB costs its page faults again every step,
which a reused one does not. DDP keeps its buckets for the whole run, and DeepSpeed keeps its reduction and
all-gather buckets too. A :class:`BufferPool` keeps buffers given back while a backward or a step runs and
lends the smallest one that is large enough.

The rules that keep this exact:
* A buffer is given back only where its last reader has finished: after the collective's ``wait()``, and
  after the unpack that copies out of it. Nothing the engine hands out (gradients, gradient shards,
  parameters, full-state views) is a view of a pooled buffer, so reusing one cannot change a value
  anyone still reads. A buffer that outlives the step, such as the reduced gradient shard, is never pooled.
* CPU only. On an accelerator the caching allocator already reuses blocks and knows which stream last used
  one; a pool of ours would have to repeat that bookkeeping (``record_stream``). There, :meth:`take` is
  ``torch.empty``.
* Bounded by bytes, and by the step. While a step runs, the free buffers held add up to at most one buffer's
  worth: the largest the engine has taken (a bucket's pack buffer, or a stage-3 unit's gather), dropping the
  smallest first; that covers one step of a stage-1/2 bucket (its pack buffer is the publish's gather buffer
  again) and a stage-3 model's units, which follow one another. When a backward or a step ends (``drop_free``:
  the reducer's end of backward, the engine's ``step()``) every free buffer is dropped: between them the pool
  holds nothing but buffers still lent (an overlapped publish in flight), so the model states sit at their
  ZeRO floors, and the first use of each buffer in the next phase makes it anew. Six kept blocks the size of
  the largest bucket (a tied embedding: 65.8 MB on T5-small) cost 377 MiB a rank, which is what ZeRO exists
  to save. A fresh block would page-fault again (+24% step time at stages 1-2 on T5-small); glibc is told to
  keep freed blocks mapped for any later allocation instead ([Note: freed host memory kept mapped],
  host_heap.py), which makes the step faster than with the kept blocks at a lower peak. Held bytes appear in
  ``memory_report().comm_buffers``, not in the model states.
"""

from __future__ import annotations

import torch

from .host_heap import retain_freed_host_memory


class BufferPool:
    def __init__(self, keep: bool = True) -> None:
        self.keep = keep  # False: every buffer made fresh (the tests' reference run)
        self._free: list[torch.Tensor] = []  # flat 1-D blocks, any dtype (lent reinterpreted by dtype)
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its block
        self.allocations = 0  # blocks made
        self.largest = 0  # bytes of the largest buffer taken: the bound on the free blocks held
        self.peak_free = 0  # the most bytes of free blocks held at once (tests check the bound)

    def take(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """An uninitialised flat buffer of ``numel`` elements of ``dtype``: a view of a kept block if one is
        large enough, else a new block. Give it back with :meth:`give` once nothing reads it any more."""
        device = torch.device(device)
        if device.type != "cpu" or numel == 0:
            return torch.empty(numel, dtype=dtype, device=device)
        need = numel * dtype.itemsize
        self.largest = max(self.largest, need)
        fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
        if fits:  # by position: ``list.remove`` would compare tensors by value
            block = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            retain_freed_host_memory()  # a fresh block does not page-fault ([Note: freed host memory kept mapped])
            block = torch.empty(need, dtype=torch.uint8)
            self.allocations += 1
        view = block[:need].view(dtype)
        self._lent[view.data_ptr()] = block
        return view

    def give(self, t: torch.Tensor) -> None:
        """Return a buffer :meth:`take` lent (anything else is ignored: an accelerator's, or a plain tensor)."""
        block = self._lent.pop(t.data_ptr(), None) if t.device.type == "cpu" else None
        if block is None:
            return
        if not self.keep:
            return
        self._free.append(block)
        while sum(b.numel() for b in self._free) > self.largest:  # one buffer's worth: the smallest go first
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
        self.peak_free = max(self.peak_free, sum(b.numel() for b in self._free))

    def drop_free(self) -> None:
        """A backward or a step is over: the free buffers are dropped (see the Note: nothing is kept between)."""
        self._free.clear()

    def disown(self, t: torch.Tensor) -> None:
        """A buffer :meth:`take` lent that its borrower keeps for good (one rank's packed gradients become
        its reduced shard): forgotten here, freed with its last reference."""
        if t.device.type == "cpu":
            self._lent.pop(t.data_ptr(), None)

    @property
    def nbytes(self) -> int:
        """Bytes held now: kept blocks and lent ones."""
        return sum(b.numel() for b in self._free) + sum(b.numel() for b in self._lent.values())

    def clear(self) -> None:
        self._free.clear()
        self._lent.clear()
