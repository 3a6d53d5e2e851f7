"""Units (stage 3): which modules' parameters are gathered and released together.

Design note
-----------
A *unit* is a module whose parameters are all-gathered before its forward (and again before its
backward) and released right after, so a rank only ever holds the units in flight plus its shards. Which
modules become units is :mod:`.unit_policy`'s choice (the user's classes, the model's declaration, its
repeated blocks, or size). The root always exists and holds whatever is left; it stays gathered for the
whole step, like units smaller than the persistence threshold (by default relative to the model's units).

A parameter used by several modules (tied embeddings: T5 and GPT-2 share the input embedding with the
output layer; a shared ``nn.Parameter``; a shared *module* registered under two blocks) belongs to the
*innermost unit that contains every module using it, on every path that reaches it*, so it is gathered
whenever any user runs and its gradient is reduced once.

Each unit keeps this rank's slices of all its parameters in one flat ``shard`` tensor laid out like a
rank-major bucket (:mod:`sharding`): one all-gather rebuilds every parameter of the unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from ..grads.buckets import Bucket, _make
from .lifecycle import UnitState
from .unit_policy import auto_persist_numel, choose_unit_modules, describe_units


@dataclass
class Unit:
    index: int
    module: nn.Module
    name: str
    params: list[nn.Parameter]
    layout: Bucket  # rank-major layout of all of the unit's parameters (trainable and frozen)
    persistent: bool = False  # gathered once per step and kept (root, tiny units)
    shard: Optional[torch.Tensor] = None  # this rank's slices, flat, compute dtype (CPU when offloaded)
    state: UnitState = UnitState.SHARDED  # [Note: unit lifecycle] in lifecycle.py
    inflight: Optional[tuple] = None  # (work, out, out is a buffer of its own) of the all-gather while GATHERING
    nbytes_full: list[int] = field(default_factory=list)

    def move(self, to: UnitState) -> None:
        self.state = self.state.check(to, self.name)

    @property
    def gathered(self) -> bool:
        return self.state is UnitState.UNSHARDED

    @property
    def full_bytes(self) -> int:
        return sum(self.nbytes_full)

    def local_views(self) -> list[torch.Tensor]:
        storage = self.shard.untyped_storage()
        if storage.nbytes() == 0 and self.shard.numel():  # on NVMe: a view is cut only within its storage's
            storage.resize_(self.shard.numel() * self.shard.element_size())  # size (never written: no copy)
            try:
                return self.layout.local_views(self.shard)
            finally:
                storage.resize_(0)
        return self.layout.local_views(self.shard)


class Units(list):
    """The units, root last, with the rule that chose them and the persistence threshold applied."""

    policy: str = ""
    persist_numel: int = 0

    def describe(self) -> str:
        return describe_units(self, self.policy, self.persist_numel)


def build_units(
    root: nn.Module,
    world_size: int,
    rank: int,
    unit_classes: Optional[Sequence] = None,
    unit_bytes: Optional[int] = None,
    persist_numel: Optional[int] = None,
) -> Units:
    """Partition the root's parameters into units; the root unit (last) holds the rest.

    ``unit_bytes`` / ``persist_numel`` None: chosen for the model (see :mod:`.unit_policy`).
    Units are returned in module registration order, root last.
    """
    modules, policy = choose_unit_modules(root, unit_classes, unit_bytes)
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    # every chain of unit modules that contains a module, one per path it is reached by, outermost first:
    # a module registered under two units (a shared Linear) is run from both
    unit_ids = {id(m) for m in modules}
    chains: dict[int, list[list[nn.Module]]] = {}

    def walk(m: nn.Module, chain: list[nn.Module], path: set[int]) -> None:
        chain = chain + [m] if id(m) in unit_ids else chain
        chains.setdefault(id(m), []).append(chain)
        for child in m.children():
            if id(child) not in path:  # a module holding its own ancestor would recurse forever
                walk(child, chain, path | {id(child)})

    walk(root, [], {id(root)})
    # a parameter belongs to the innermost unit that contains every module registering it, on every path
    users: dict[int, list[list[nn.Module]]] = {}
    for mod in root.modules():
        for p in mod.parameters(recurse=False):
            users.setdefault(id(p), []).extend(chains[id(mod)])
    order = list(root.parameters())
    owner = {id(p): _innermost_common(users[id(p)]) for p in order}
    groups: dict[Optional[int], list[nn.Parameter]] = {}
    for p in order:
        o = owner[id(p)]
        groups.setdefault(id(o) if o is not None else None, []).append(p)
    units = Units()
    units.policy = policy
    for m in modules + [root]:
        key = None if m is root else id(m)
        params = groups.get(key, [])
        if not params and m is not root:
            continue
        layout = _make(len(units), params, world_size, rank, True) if params else None
        unit = Unit(len(units), m, names.get(id(m), "") or "<root>", params, layout)
        unit.nbytes_full = [p.numel() * p.element_size() for p in params]
        units.append(unit)
    if persist_numel is None:
        persist_numel = auto_persist_numel([sum(p.numel() for p in u.params) for u in units[:-1]])
    units.persist_numel = persist_numel
    for u in units:
        u.persistent = u.module is root or sum(p.numel() for p in u.params) < persist_numel
    return units


def _innermost_common(chains: list[list[nn.Module]]) -> Optional[nn.Module]:
    """Innermost unit module present in every chain (None: only the root contains them all).

    Chains are ordered outermost first, and two units on one path never appear in the other order on
    another (that would be a cycle), so the last unit of the first chain found in all others is it.
    """
    common = None
    rest = [{id(m) for m in c} for c in chains[1:]]
    for m in chains[0]:
        if all(id(m) in r for r in rest):
            common = m
    return common


def grad_buckets_for_units(units: list[Unit], managed: list[nn.Parameter], world_size: int, rank: int):
    """One gradient bucket per unit (its trainable, optimizer-managed parameters), in backward order.

    Returns (buckets, sources, owner): ``sources[b][i]`` is the unit-shard view of bucket ``b``'s
    parameter ``i`` (where its master comes from); ``owner[b]`` is the unit of bucket ``b``.
    Backward runs the units in reverse forward order and the root (embeddings, tied heads) last, so the
    buckets are the non-root units reversed, then the root: in-order launching then rarely waits.
    """
    wanted = {id(p) for p in managed}
    buckets, sources, owner = [], [], []
    for u in list(reversed(units[:-1])) + [units[-1]]:
        params = [p for p in u.params if id(p) in wanted]
        if not params:
            continue
        views = dict(zip((id(p) for p in u.params), u.local_views()))
        buckets.append(_make(len(buckets), params, world_size, rank, True))
        sources.append([views[id(p)] for p in params])
        owner.append(u)
    return buckets, sources, owner
