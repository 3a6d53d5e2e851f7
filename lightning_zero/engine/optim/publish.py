"""Publishing updated masters into the module; in stages 1-2 the all-gather can overlap the next forward.

Design note
-----------
After the optimizer steps, each bucket's updated shards must reach every rank before the parameters are
read again. Blocking in ``step()`` puts the whole all-gather on the critical path; instead
:meth:`PublishQueue.launch` issues every bucket's all-gather asynchronously, in forward order (the
reverse of the bucket order, which follows backward), and returns. The collectives are all issued inside
``step()``, in the same order on every rank, so nothing about the sequence of collectives changes -- only
when their results are copied into the parameters:

* in the forward pre-hook of every module that registers a parameter of a pending bucket (a tied
  parameter is registered by each of its modules), that bucket is waited for and unpacked; buckets that
  have already arrived are unpacked too, so their buffers are freed early;
* everything else that reads or writes the parameters or the masters first drains the queue
  (:meth:`PublishQueue.ensure`, "ensure published"): the engine's next gradient finalize / clip / step
  (with fp32 masters aliasing the parameters, a late unpack would overwrite the new step), the end of
  backward (buckets of modules this forward did not run), the whole-model views (``master_rows``:
  checkpoints, consolidation, handing the module back), ``module.state_dict()`` / ``load_state_dict()``
  (hooks on the root), a second optimizer's step, and ``remove()``. ``zero_grad`` touches only gradients.

What stays the caller's part -- hence ``overlap_publish`` is opt-in: a parameter read directly
(``module.weight``) after a step and before the forward of a module that holds it sees this rank's slice
updated and the rest one step old. Lightning's ``EMAWeightAveraging`` does exactly that in
``on_train_batch_end`` (tests/test_lifecycle_callbacks.py fails with the overlap on), as would a callback
logging weight norms there. Such code calls ``engine.ensure_published()`` first (or keeps the default,
``overlap_publish=False``); the root module's own parameters are waited for before ``training_step``
(``prepare_forward``). Under the Trainer, ZeroStrategy does this itself: when a callback outside
Lightning's bookkeeping ones (progress bars, checkpointing, summaries, timers, LR monitors, early
stopping) or a LightningModule hook that runs between a step and the next forward is present, each
optimizer step completes its all-gathers before returning (``lightning/callback_checks.weight_readers``).

Memory: until its forward runs, each bucket's gathered buffer (compute dtype) is alive, so between the
step and the forward up to one more copy of the managed parameters exists transiently (blocking: at most
three buckets); it shrinks bucket by bucket as the forward reaches them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..layout import tensor_parallel as TP
from ..grads.buckets import Bucket
from ..plan import Publish, ShardingPlan
from ..layout.tensor_parallel import local_data


@torch.no_grad()
def publish_masters(rows: list[tuple[list[torch.Tensor], Bucket]], plan: ShardingPlan, table: Any,
                    partitioner: Optional[Any], queue: Optional["PublishQueue"], group: Optional[Any],
                    host: bool, quantized: bool) -> None:
    """Copy the updated masters of ``rows`` ((masters, bucket) pairs) into the module's parameters, the way
    ``plan.publish`` says ([Note: sharding plan]).

    COPY (stage 0): where a master does not alias its parameter. ALL_GATHER (stages 1-2): one all-gather per
    bucket over ``group``, blocking or queued on ``queue`` (``overlap_publish``). UNIT_SHARDS (stage 3): the
    masters into the unit shards (``table``'s sources), which units are gathered from when next used. An
    evaluation-only engine has no masters (``rows`` empty): its unit shards already hold the values.
    """
    if plan.publish is Publish.UNIT_SHARDS and partitioner is not None:
        for row, b in rows:
            into_unit_shards(row, b, table, partitioner)
        partitioner.after_step()
    elif plan.publish is Publish.COPY:
        for row, b in rows:
            for m, p in zip(row, b.params):
                if m is not TP.local(p):
                    TP.local_data(p).copy_(m.view_as(TP.local(p)))
    elif queue is not None:
        queue.launch(rows, group, host, quantized)
    else:  # also a stage-3 module handed back whole: its buckets' rows, gathered
        publish_blocking(rows, group, host, quantized)


@torch.no_grad()
def publish_chunk(row: list[torch.Tensor], b: Bucket, plan: ShardingPlan, table: Any, group: Optional[Any],
                  quantized: bool, partitioner: Optional[Any] = None) -> None:
    """One bucket's updated host masters, published while they are in memory (NVMe offload streams the
    buckets through a ring): into the unit shards (stage 3; the engine's after-step follows the whole
    step) or by the bucket's all-gather (stages 1-2)."""
    if plan.publish is Publish.UNIT_SHARDS:
        into_unit_shards(row, b, table, partitioner, non_blocking=False)
    else:
        publish_blocking([(row, b)], group, True, quantized)


@torch.no_grad()
def into_unit_shards(row: list[torch.Tensor], b: Bucket, table: Any, partitioner: Optional[Any],
                     non_blocking: bool = True) -> None:
    """Stage 3: one bucket's masters into their unit-shard sources (the bucket table's), a master that *is*
    its source (fp32 host shards) already there; each unit's slices written by the parameter-shard store
    ([Note: parameter-shard stores]: in memory, or NVMe's region of the parameter file when the shard is on
    disk). ``non_blocking=False``: the masters' memory is reused right after (a streaming state store's ring)."""
    by_unit: dict[int, list] = {}
    for m, src, p in zip(row, table.sources(b.index), b.params):
        if m is not src:
            by_unit.setdefault(partitioner.unit_of[id(p)].index, []).append((src, m))
    for index, pairs in by_unit.items():
        partitioner.store.write_slices(partitioner.units[index], pairs, non_blocking=non_blocking)


@torch.no_grad()
def publish_blocking(rows: list[tuple[list[torch.Tensor], Bucket]], group: Optional[Any], host: bool,
                     quantized: bool) -> None:
    """The default publish: every bucket's all-gather before ``step()`` returns, at most three in flight
    (two overlap communication without a second model copy). ``host`` (offload): the host masters are cast
    into a pinned host chunk, then one asynchronous host->device copy per bucket."""
    pending: list[tuple[Bucket, Any, torch.Tensor, Optional[int]]] = []
    for row, b in rows:
        work, flat = b.all_gather(row, b.params[0].dtype, group, host=host, async_op=True,
                                  quantized=quantized, pooled=True)
        pending.append((b, work, flat, _own_row_in_place(row, b, quantized)))
        if len(pending) > 2:
            _unpack(*pending.pop(0))
    for item in pending:
        _unpack(*item)


def _own_row_in_place(masters: list[torch.Tensor], b: Bucket, quantized: bool) -> Optional[int]:
    """This rank's row index when every master *is* its parameter's slice (fp32 compute, no offload): the
    step already wrote that row into the parameters, so the unpack skips it. None otherwise -- separate
    masters, or qwZ, where every rank must read the same rounded values, its own chunk included."""
    if quantized:
        return None
    for m, p, spec in zip(masters, b.params, b.specs):
        if not spec.shard_len:
            continue  # none of this parameter lives in this rank's row
        data = local_data(p)
        if m is None or m.dtype != data.dtype or m.data_ptr() != data.data_ptr() + spec.lo * data.element_size():
            return None
    return b.specs[0].rank


def _unpack(b: Bucket, work: Any, flat: torch.Tensor, skip_rank: Optional[int] = None) -> None:
    work.wait()
    b.unpack_rank_major(flat, [local_data(p) for p in b.params], skip_rank=skip_rank)
    b.done_with(flat)  # copied out: [Note: kept communication buffers]


class PublishQueue:
    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # bucket index -> (b, work, flat, own row written in place or None), launch order
        self._pending: dict[int, tuple[Bucket, Any, torch.Tensor, Optional[int]]] = {}
        self._bucket_of: dict[int, int] = {}  # id(param) -> bucket index, for pending buckets
        # counters: buckets launched; forward pre-hooks that had to wait; buckets unpacked inside a forward
        self.launches = self.waits_in_forward = self.unpacked_in_forward = 0
        self._handles = []
        self._root_ids = [id(p) for p in module.parameters(recurse=False)]
        for m in module.modules():
            ids = [id(p) for p in m.parameters(recurse=False)]
            if ids:
                self._handles.append(m.register_forward_pre_hook(self._make_hook(ids)))
        self._handles.append(module.register_state_dict_pre_hook(lambda *_: self.ensure()))
        self._handles.append(module.register_load_state_dict_pre_hook(lambda *_a, **_k: self.ensure()))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    @torch.no_grad()
    def launch(self, rows: list[tuple[list[torch.Tensor], Bucket]], group: Optional[Any], host: bool,
               quantized: bool) -> None:
        """Issue the all-gather of every bucket of ``rows`` (masters, bucket), first-used first; no wait."""
        self.ensure()
        for row, b in sorted(rows, key=lambda rb: -rb[1].index):
            work, flat = b.all_gather(row, b.params[0].dtype, group, host=host, async_op=True,
                                  quantized=quantized, pooled=True)
            self._pending[b.index] = (b, work, flat, _own_row_in_place(row, b, quantized))
            for p in b.params:
                self._bucket_of[id(p)] = b.index
            self.launches += 1

    def _make_hook(self, ids: list[int]):
        def hook(_module, _args) -> None:
            if self._pending:
                self._wait_for(ids)

        return hook

    def wait_for_module(self, module: nn.Module) -> None:
        """The buckets of the root's own parameters (a ``training_step`` may use them outside a forward)."""
        if self._pending and module is self.module:
            self._wait_for(self._root_ids)

    def _wait_for(self, ids: list[int]) -> None:
        before = len(self._pending)
        needed = [self._bucket_of[i] for i in ids if i in self._bucket_of]
        if needed:
            self.waits_in_forward += 1
            for bi in needed:
                self._unpack(bi)
        self._unpack_arrived()
        self.unpacked_in_forward += before - len(self._pending)

    @torch.no_grad()
    def _unpack(self, bi: int) -> None:
        item = self._pending.pop(bi, None)
        if item is None:
            return
        _unpack(*item)
        b = item[0]
        for p in b.params:
            self._bucket_of.pop(id(p), None)

    def _unpack_arrived(self) -> None:
        for bi, (_b, work, _f, _s) in list(self._pending.items()):
            done = getattr(work, "is_completed", None)
            if done is None or not done():
                return  # collectives complete in launch order: nothing later has arrived either
            self._unpack(bi)

    def ensure(self) -> None:
        """Wait for every pending bucket and write it into the parameters ("ensure published")."""
        for bi in list(self._pending):
            self._unpack(bi)

    def remove(self, wait: bool = True) -> None:
        """``wait=False`` after a failure: peers may be gone, and waiting would turn the error into a hang."""
        if wait:
            self.ensure()
        for h in self._handles:
            h.remove()
        self._handles.clear()
