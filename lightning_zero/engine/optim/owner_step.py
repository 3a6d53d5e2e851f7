"""The owner-rank step: a whole-tensor optimizer (Muon, Adafactor, a trust ratio) at ZeRO stages 1-3.

[Note: owner-rank step]
An update that reads whole tensors (Muon's Newton-Schulz orthogonalization, Adafactor's row and column
moments, LAMB's trust ratio) computes something else on a slice. At stages 1-3 every rank keeps its slice of
every parameter as for an elementwise optimizer -- masters, reduced gradients, the norm and clipping, the
publish, the model's checkpoint entries and every store are unchanged -- and each parameter gets one *owner*
rank. The optimizer's step is then three moves:

    gather   one all-to-all per bucket: every rank sends its gradient slice of each parameter to the
             parameter's owner (and the master's slice, unless the owner can read the values from the module);
             the owner assembles the whole fp32 parameter and gradient, its *whole master* (parameter-shaped)
    step     the user's optimizer object, its class unchanged, steps the owner's whole masters: its
             ``param_groups`` hold them for that call only, so the groups' hyper-parameters, an LR scheduler
             and ``add_param_group`` act on the groups as always
    scatter  one all-to-all back per bucket: each owner sends every rank its slice of the updated parameter,
             into that rank's master, and frees its whole masters; the engine publishes as for any optimizer

The slice masters stay the one truth of the values (a checkpoint load, a module load, the publish read them),
so a whole master exists only during the step: its storage is freed once scattered (its shape stays, and the
optimizer's state is keyed on it). A step's extra memory is thus the owned parameters' whole masters and
gradients (8 bytes per owned element) plus one bucket's buffers (``OwnerStep.step_bytes``). The optimizer
state lives whole on the owner alone, so a rank holds the state of the parameters it owns; owners are assigned
greedily, largest cost first, to the least loaded rank (cost: numel, or m*n*min(m, n) for a Newton-Schulz
step), and the memory report shows each rank's own bytes.

What travels: gradients always. Values only where the owner cannot read them: at stages 1-2 with fp32
parameters every rank holds the whole parameter, equal to its master (the publish wrote it), so the owner
reads it there; at stage 3, or with a bf16 / fp16 module (rounded parameters), the master slices travel with
the gradients. Against an elementwise optimizer a step adds the gather (each rank sends (N-1)/N of its fp32
gradient shard bytes, twice that with values) and the scatter (the same for the updated values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..comm import collectives as C
from ..layout import tensor_parallel as TP


@dataclass(eq=False)
class OwnedParam:
    """One managed parameter as the owner-rank step sees it."""

    master: torch.Tensor  # this rank's fp32 slice (the ShardedOptimizer's master)
    param: torch.Tensor
    spec: Any  # its ShardSpec
    shape: tuple
    owner: int = -1


def numel_cost(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def newton_schulz_cost(shape: tuple) -> int:
    """A Newton-Schulz step on an m x n matrix multiplies m x n by n x m products: m * n * min(m, n)."""
    if len(shape) != 2:
        return numel_cost(shape)
    m, n = shape
    return m * n * min(m, n)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _allocate(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1)
    return t if t.numel() == n else torch.cat([t, t.new_zeros(n - t.numel())])


class OwnerStep:
    """The owners, whole masters and gather / step / scatter of one ShardedOptimizer ([Note: owner-rank step])."""

    def __init__(self, sharded: Any, group: Optional[Any], cost: Callable[[tuple], int]) -> None:
        self.sharded, self.group, self.cost = sharded, group, cost
        self.world, self.rank = C.world_size(group), C.rank(group)
        self.items: list[OwnedParam] = []
        # per bucket of the ShardedOptimizer, per owner rank: its parameters, in bucket order (what each bucket's
        # all-to-alls send to and receive from every rank), made once when the bucket is assigned
        self.by_bucket: list[list[list[OwnedParam]]] = []
        self.whole: dict[int, torch.Tensor] = {}  # id(slice master) -> whole master, on its owner only
        self._load = [0] * self.world
        self._seen = 0  # buckets of the ShardedOptimizer assigned so far (add_param_group adds more)
        plan = sharded.plan
        self.values_from_params = (not plan.shards_params and sharded._compute_fp32 and not plan.separate_masters)
        self.sync()

    # -- owners ---------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Owners (and whole masters) for the parameters of buckets added since the last call; earlier owners
        stay, as their state does. Every rank computes the same assignment from the same buckets."""
        s, rows = self.sharded, []
        for bi in range(self._seen, len(s.masters)):
            b = s.buckets[bi]
            rows.append([OwnedParam(m, p, spec, tuple(p.shape))
                         for m, p, spec in zip(s.masters[bi], b.params, b.specs)])
        self._seen = len(s.masters)
        new = [it for row in rows for it in row]
        for it in sorted(new, key=lambda it: -self.cost(it.shape)):  # stable: equal costs keep bucket order
            it.owner = min(range(self.world), key=lambda r: (self._load[r], r))
            self._load[it.owner] += self.cost(it.shape)
            if it.owner == self.rank:
                w = torch.empty(it.shape, dtype=torch.float32, device=s.master_device)
                _free(w)
                self.whole[id(it.master)] = w
        self.items += new
        self.by_bucket += [[[it for it in row if it.owner == r] for r in range(self.world)] for row in rows]

    def owned(self, rank: int) -> list[OwnedParam]:
        return [it for it in self.items if it.owner == rank]

    def holder(self, master: torch.Tensor) -> Optional[torch.Tensor]:
        """The tensor the optimizer's state of ``master``'s parameter is keyed on here; None: another rank owns it."""
        self.sync()
        return self.whole.get(id(master))

    def cost_by_rank(self) -> list[int]:
        """The assigned cost per rank (what the balance evens out)."""
        self.sync()
        return list(self._load)

    def step_bytes(self) -> int:
        """The most this rank allocates for a step beyond its persistent state: its whole masters and their
        gradients (fp32), plus one bucket's send and receive buffers ([Note: owner-rank step])."""
        self.sync()
        per = 1 if self.values_from_params else 2
        owned = sum(it.spec.numel for it in self.owned(self.rank))
        buffers = max((per * sum(it.spec.shard_numel for mine in owners for it in mine) +
                       per * self.world * sum(it.spec.shard_numel for it in owners[self.rank])
                       for owners in self.by_bucket), default=0)
        return 4 * (2 * owned + buffers)

    # -- the step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, run_step: Callable[[], None]) -> None:
        """Gather, ``run_step()`` (the user's optimizer, its groups holding this rank's whole masters), scatter;
        one all-to-all each way per bucket, so the buffers stay within a bucket's size."""
        self.sync()
        try:
            for owners in self.by_bucket:
                self._gather(owners)
            with self.whole_groups():
                run_step()
            for owners in self.by_bucket:
                self._scatter(owners)
        finally:
            self._release(self.owned(self.rank))

    @torch.no_grad()
    def init_state(self, masters: list[torch.Tensor], zero_lr_step: Callable[[Any, list], None]) -> None:
        """Create the optimizer state of the owned parameters among ``masters`` that have none (a checkpoint
        load fills it next): ``zero_lr_step`` on their whole masters, values immaterial. No collective."""
        opt = self.sharded.optimizer
        need = [self.whole[id(m)] for m in masters if id(m) in self.whole and not opt.state.get(self.whole[id(m)])]
        for w in need:
            _allocate(w)
            w.zero_()
        try:
            with self.whole_groups():
                zero_lr_step(opt, need)
        finally:
            for w in need:
                w.grad = None
                _free(w)

    def whole_groups(self):
        """A context in which the optimizer's groups hold this rank's whole masters instead of the slices."""
        return _Swapped(self.sharded.optimizer, self.whole)

    def _gather(self, owners: list[list[OwnedParam]]) -> None:
        """One bucket (``owners``: its parameters by owner rank): every rank's slices of each parameter to its
        owner, assembled into the whole master."""
        dev, mine = self.sharded.device, owners[self.rank]
        values = not self.values_from_params
        per = 2 if values else 1
        parts, in_splits = [], []
        for r in range(self.world):
            n = 0
            for it in owners[r]:
                c = it.spec.shard_numel
                if values:
                    parts.append(_padded(it.master.to(dev), c))
                g = it.master.grad
                parts.append(_padded(g.to(dev), c) if g is not None else torch.zeros(c, device=dev))
                n += per * c
            in_splits.append(n)
        width = per * sum(it.spec.shard_numel for it in mine)
        send = torch.cat(parts) if parts else torch.zeros(0, device=dev)
        out = torch.empty(self.world * width, dtype=torch.float32, device=dev)
        C.all_to_all_v(out, send.float(), [width] * self.world, in_splits, self.group, op="gather_to_owner")
        out = out.view(self.world, width)
        off = 0
        for it in mine:
            c, numel, w = it.spec.shard_numel, it.spec.numel, self.whole[id(it.master)]
            _allocate(w)
            if values:
                w.view(-1).copy_(out[:, off : off + c].reshape(-1)[:numel])
                off += c
            else:
                w.copy_(TP.local_data(it.param).view(it.shape))
            if it.master.grad is not None:  # every rank reduced the same buckets: the same parameters have one
                w.grad = out[:, off : off + c].reshape(-1)[:numel].to(w.device).view(it.shape)
            off += c

    def _scatter(self, owners: list[list[OwnedParam]]) -> None:
        """One bucket: each owner's updated parameters back to every rank's slice masters; the owner's whole
        masters of the bucket are freed as soon as they are sent."""
        dev, mine = self.sharded.device, owners[self.rank]
        if mine:
            rows = [_padded(self.whole[id(it.master)].to(dev), self.world * it.spec.shard_numel).view(self.world, -1)
                    for it in mine]
            send = torch.cat(rows, dim=1).reshape(-1)  # row r: every owned parameter's slice for rank r
        else:
            send = torch.zeros(0, device=dev)
        self._release(mine)
        width = sum(it.spec.shard_numel for it in mine)
        out_splits = [sum(it.spec.shard_numel for it in owners[r]) for r in range(self.world)]
        out = torch.empty(sum(out_splits), dtype=torch.float32, device=dev)
        C.all_to_all_v(out, send, out_splits, [width] * self.world, self.group, op="scatter_from_owner")
        off = 0
        for r in range(self.world):
            for it in owners[r]:
                n = it.spec.shard_len
                it.master.copy_(out[off : off + n].view_as(it.master))
                off += it.spec.shard_numel

    def _release(self, mine: list[OwnedParam]) -> None:
        for it in mine:
            w = self.whole[id(it.master)]
            w.grad = None
            if w.untyped_storage().size():
                _free(w)


class _Swapped:
    """The optimizer's groups with each slice master replaced by its whole master, owned ones only."""

    def __init__(self, optimizer: Any, whole: dict[int, torch.Tensor]) -> None:
        self.optimizer, self.whole = optimizer, whole

    def __enter__(self) -> None:
        groups = self.optimizer.param_groups
        self.saved = [g["params"] for g in groups]
        for g, params in zip(groups, self.saved):
            g["params"] = [self.whole[id(m)] for m in params if id(m) in self.whole]

    def __exit__(self, *exc) -> None:
        for g, params in zip(self.optimizer.param_groups, self.saved):
            g["params"] = params
