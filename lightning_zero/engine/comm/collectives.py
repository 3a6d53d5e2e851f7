"""Collectives: the only place the engine talks to torch.distributed.

Design note
-----------
Every collective the engine issues goes through here so that (a) the few API differences between torch
releases and backends are handled once (torch 2.13 renamed the ``*_tensor`` collectives to ``*_single``;
gloo has no ``AVG``, and its list forms of all-gather / reduce-scatter -- into views of the flat buffer,
no copy -- are faster than its flat forms), and (b) tests can count exactly how many
collectives, and how many bytes, a training step costs (:data:`stats`), and on which group: hybrid
sharding names its groups "shard" and "replicate" (:func:`name_group`), every other group is "world"
(or "subgroup" when it spans fewer ranks), so a test can assert which group carried what. A world of size 1 -- or no
initialized process group -- short-cuts every call, so the engine runs unchanged on one process.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommStats:
    """Counts of collectives issued by this process (by op name) and the bytes they sent.

    ``bytes`` is the payload handed to the collective (all-gather: this rank's input; reduce-scatter and
    all-to-all: the whole input). ``by_group`` splits calls, payload and *wire* bytes -- what this rank
    sends under the ring algorithms (all-reduce 2(N-1)/N of the tensor, reduce-scatter and all-to-all
    (N-1)/N of the input, all-gather (N-1) times the input) -- by (op, group name).
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    by_group: dict = field(default_factory=dict)  # (op, group name) -> [calls, payload bytes, wire bytes]

    def record(self, op: str, tensor: torch.Tensor, group: Optional[Any] = None,
               wire: Optional[int] = None) -> None:
        """``wire``: the bytes that leave this rank, where the ring formula does not give them (uneven splits)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.calls[op] += 1
        self.bytes[op] += nbytes
        row = self.by_group.setdefault((op, group_name(group)), [0, 0, 0])
        row[0] += 1
        row[1] += nbytes
        row[2] += int(nbytes * _WIRE[op](world_size(group))) if wire is None else wire

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.by_group.clear()

    def snapshot(self) -> dict:
        return {k: list(v) for k, v in self.by_group.items()}

    @property
    def group_calls(self) -> Counter:  # (group name, op) -> calls
        return Counter({(g, op): row[0] for (op, g), row in self.by_group.items()})

    @property
    def group_bytes(self) -> Counter:  # (group name, op) -> payload bytes
        return Counter({(g, op): row[1] for (op, g), row in self.by_group.items()})

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


# bytes this rank sends per payload byte, ring algorithms with n ranks
_WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather_to_owner": lambda n: (n - 1) / n,  # the owner-rank step's all-to-alls (their wire bytes are exact)
    "scatter_from_owner": lambda n: (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "broadcast": lambda n: 1.0,
}
stats = CommStats()
_NAMES: dict[int, str] = {}  # id(group) -> name in stats


def name_group(group: Any, name: str) -> None:
    """Count ``group``'s collectives under ``name`` in :data:`stats` and ``comm_report()`` (hybrid: "shard",
    "replicate"; the stage-3 side group: "stage3_reduce"); an unnamed group is "world" or "subgroup"."""
    _NAMES[id(group)] = name


def group_name(group: Optional[Any]) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    name = _NAMES.get(id(group))
    if name is None:
        name = _NAMES[id(group)] = "world" if dist.get_world_size(group) == dist.get_world_size() else "subgroup"
    return name


class _Done:
    """Stand-in handle for work that completed synchronously (world size 1)."""

    def wait(self) -> bool:
        return True


def done() -> _Done:
    """The handle of work that needed no collective (one rank)."""
    return _Done()


def world_size(group: Optional[Any] = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group: Optional[Any] = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def group_ranks(group: Optional[Any] = None) -> tuple[int, ...]:
    """The global ranks of ``group`` in its rank order (``(0,)`` without an initialized process group): a
    name for the group that survives pickling, where the group object itself does not."""
    if not (dist.is_available() and dist.is_initialized()):
        return (0,)
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _is_gloo(group: Optional[Any]) -> bool:
    return dist.get_backend(group) == "gloo"


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False):
    """Sum-reduce ``input`` (``world_size * output.numel()`` elements, rank-major) into ``output``."""
    n = world_size(group)
    if n == 1:
        output.copy_(input.view(-1)[: output.numel()])
        return _Done() if async_op else None
    stats.record("reduce_scatter", input, group)
    if _is_gloo(group):  # gloo's list form is the faster path there (measured: 2.7-3.0 vs 3.0-3.5 ms, 2.6 MB)
        return dist.reduce_scatter(output, list(input.view(-1).chunk(n)), group=group, async_op=async_op)
    return _reduce_scatter(output, input, group=group, async_op=async_op)


class _KeepRow:
    """Handle of an all-reduce used as a reduce-scatter: once done, this rank's row lands in ``output``."""

    def __init__(self, work: Any, output: torch.Tensor, row: torch.Tensor) -> None:
        self._work, self._output, self._row = work, output, row

    def wait(self) -> bool:
        if self._row is not None:
            self._work.wait()
            self._output.copy_(self._row)
            self._row = None
        return True


def reduce_scatter_by_all_reduce(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None,
                                 async_op: bool = False):
    """:func:`reduce_scatter` computed as an all-reduce of the whole (rank-major) ``input``, keeping this
    rank's row: faster on backends whose reduce-scatter is slow (gloo, see :data:`GRAD_REDUCE_BY_BACKEND`).
    Sums ``input`` in place."""
    n = world_size(group)
    if n == 1:
        return reduce_scatter(output, input, group=group, async_op=async_op)
    work = all_reduce(input, group=group, async_op=True)
    handle = _KeepRow(work, output, input.view(n, -1)[rank(group)])
    if async_op:
        return handle
    handle.wait()
    return None


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False):
    """Gather every rank's flat ``input`` into a flat ``output`` (rank-major)."""
    n = world_size(group)
    if n == 1:
        dst = output.view(-1)[: input.numel()]
        if dst.data_ptr() != input.data_ptr():  # packed in place already: nothing to move
            dst.copy_(input.view(-1))
        return _Done() if async_op else None
    stats.record("all_gather", input, group)
    if _is_gloo(group):
        if n == 2:  # one exchange, as below; also bit for bit a copy
            return _all_gather_pair(output, input, group, async_op)
        # into views of ``output``: no extra copy, and 1.9 vs 3.2 ms on gloo (2.6 MB); gloo's list form
        # copies the input into its own chunk, which must then not be that chunk itself
        chunks = list(output.view(-1).chunk(n))
        if input.data_ptr() == chunks[rank(group)].data_ptr():
            input = input.clone()
        return dist.all_gather(chunks, input.view(-1), group=group, async_op=async_op)
    return _all_gather(output.view(-1), input.view(-1), group=group, async_op=async_op)


def gathers_in_place(group: Optional[Any] = None) -> bool:
    """Whether :func:`all_gather` takes its input as a view of its own output chunk without an extra copy
    (one rank, gloo's two-rank exchange, NCCL's in-place all-gather); gloo's list form with more ranks
    would have to clone it first, so a separate send buffer is cheaper there."""
    n = world_size(group)
    return n == 1 or not _is_gloo(group) or n == 2


def _all_gather_pair(output: torch.Tensor, input: torch.Tensor, group: Optional[Any], async_op: bool):
    """The all-gather of two gloo ranks as one all-to-all exchange: each rank's chunk goes to the other's
    row of ``output`` and its own row is a local copy. The same bytes travel as gloo's all-gather moves,
    in 1.54 / 2.83 / 8.45 ms against its 1.99 / 3.71 / 10.73 ms at 1 / 2.5 / 8 MiB (2 gloo ranks, a loaded
    2-core machine, medians of 35 interleaved calls). With more ranks the chunk would have to be sent
    from W-1 copies, and gloo's own all-gather stays."""
    r = rank(group)
    grid = output.view(2, -1)
    if input.data_ptr() != grid[r].data_ptr():  # not packed in place already
        grid[r].copy_(input.view(-1))
    splits = [0, 1] if r == 0 else [1, 0]  # rank 0 sends to / receives from rank 1 only, and vice versa
    return dist.all_to_all_single(grid[1 - r : 2 - r], grid[r : r + 1], output_split_sizes=splits,
                                  input_split_sizes=splits, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op=None, group: Optional[Any] = None, async_op: bool = False):
    """In-place all-reduce (SUM by default; gloo has no AVG, so callers divide)."""
    if world_size(group) == 1:
        return _Done() if async_op else None
    stats.record("all_reduce", tensor, group)
    return dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_to_all_rows(output: torch.Tensor, rows: torch.Tensor, group: Optional[Any] = None, async_op: bool = False):
    """All-to-all of ``rows`` (``[N, w]``): row ``j`` goes to rank ``j``, except this rank's own row, which
    stays where it is (the caller reads it in place): ``output`` (``[N - 1, w]``) receives the other ranks'
    rows for this rank, in rank order. Skipping the self-copy saves a row of memory and a copy; counted as
    an all-to-all of all N rows, whose ring wire bytes ((N-1)/N of them) are exactly what travels."""
    n, r = world_size(group), rank(group)
    if n == 1:
        return _Done() if async_op else None
    stats.record("all_to_all", rows, group)
    splits = [1] * n
    splits[r] = 0
    # the other rows are one slice at the ends of the rank range, a copy in between
    send = rows[1:] if r == 0 else rows[:-1] if r == n - 1 else torch.cat([rows[:r], rows[r + 1 :]])
    return dist.all_to_all_single(output, send, output_split_sizes=splits, input_split_sizes=splits,
                                  group=group, async_op=async_op)


def all_to_all_v(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
                 group: Optional[Any] = None, op: str = "all_to_all") -> None:
    """All-to-all with a size per rank (the owner-rank step's gather and scatter, optim/owner_step.py):
    ``input_splits[j]`` elements of ``input`` go to rank ``j``, ``output_splits[j]`` arrive from it, in rank
    order. Its wire bytes are what leaves this rank (its own split stays); ``op``: its name in the counts."""
    n, r = world_size(group), rank(group)
    if n == 1:
        output.copy_(input)
        return
    stats.record(op, input, group, wire=(input.numel() - input_splits[r]) * input.element_size())
    dist.all_to_all_single(output, input, output_split_sizes=output_splits, input_split_sizes=input_splits,
                           group=group)


# grad_reduce="auto": on gloo, its own reduce-scatter is the slowest way to reduce-scatter; an all-reduce
# keeping this rank's rows beats it, and one all-to-all of the rows (quantize.reduce_scatter_by_all_to_all,
# half the all-reduce's bytes) beats both at every bucket size. Measured on 2 gloo ranks (CPU), fp32, median
# ms, bench/step_time.py --comm-only --comm-mib 1,2.5,8,25, two runs on a shared machine:
#   all_reduce           4.1-6.6 / 9.8-11.1 / 9.0-28.0 / 29.7-80.1
#   reduce_scatter list  7.8-8.8 / 11.8-14.9 / 12.3-18.7 / 38.4-93.1
#   all_to_all rows      3.5-4.9 / 6.8-7.0 / 7.6-8.6 / 19.7-42.7
# NCCL's reduce-scatter moves a reduce-scatter's bytes in one kernel and is the faster one there. A table
# (not a measurement at setup) keeps the choice identical on every rank without a collective to agree on it.
GRAD_REDUCE_BY_BACKEND = {"gloo": "all_to_all"}


def grad_reduce_mode(requested: str, group: Optional[Any] = None) -> str:
    """The gradient reduction of stages 1-3: ``requested`` unless "auto", else the backend's table entry."""
    if requested != "auto":
        return requested
    if world_size(group) == 1:
        return "reduce_scatter"
    return GRAD_REDUCE_BY_BACKEND.get(str(dist.get_backend(group)), "reduce_scatter")


def broadcast(tensor: torch.Tensor, src: int = 0, group: Optional[Any] = None) -> None:
    if world_size(group) == 1:
        return
    stats.record("broadcast", tensor, group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast(tensor, src=global_src, group=group)


def broadcast_flat(tensors: list[torch.Tensor], group: Optional[Any], cap: int = 64 * 2**20) -> None:
    """Broadcast tensors from rank 0 through a few flat buffers (grouped by dtype and device)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), ts in groups.items():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in ts + [None]:
            if t is None or (chunk and (size + t.numel()) * t.element_size() > cap):
                flat = torch.cat([c.reshape(-1) for c in chunk])
                broadcast(flat, 0, group)
                off = 0
                for c in chunk:
                    c.copy_(flat[off : off + c.numel()].view_as(c))
                    off += c.numel()
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += t.numel()


def barrier(group: Optional[Any] = None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


def gather_object(obj: Any, group: Optional[Any] = None) -> Optional[list]:
    """Every rank's ``obj`` on the group's first rank (None elsewhere): a consolidation's pieces, rare."""
    if world_size(group) == 1:
        return [obj]
    out: Optional[list] = [None] * world_size(group) if rank(group) == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return out


def all_gather_object(obj: Any, group: Optional[Any] = None) -> list:
    """Every rank's ``obj`` (small, picklable: setup decisions and error messages, never tensors of a step)."""
    if world_size(group) == 1:
        return [obj]
    out: list = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
