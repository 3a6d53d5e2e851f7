"""Units (stage 3): which modules' parameters are gathered and released together.

Design note
-----------
A *unit* is a module whose parameters are all-gathered before its forward (and again before its
backward) and released right after, so a rank only ever holds the units in flight plus its shards. The
policy chooses unit modules either by class (``unit_classes=[T5Block]``: every instance becomes a unit,
the FSDP "transformer auto-wrap" rule) or automatically by size (bottom-up: a module becomes a unit once
the parameters it owns that no inner unit owns reach ``unit_mb``). The root always exists and holds
whatever is left; it stays gathered for the whole step, like parameters of units smaller than the
persistence threshold.

A parameter used by several modules (tied embeddings: T5 and GPT-2 share the input embedding with the
output layer) belongs to the *innermost unit that contains every module using it*, so it is gathered
whenever any user runs and its gradient is reduced once.

Each unit keeps this rank's slices of all its parameters in one flat ``shard`` tensor laid out like a
rank-major bucket (:mod:`sharding`): one all-gather rebuilds every parameter of the unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from .buckets import Bucket, _make


@dataclass
class Unit:
    index: int
    module: nn.Module
    name: str
    params: list[nn.Parameter]
    layout: Bucket  # rank-major layout of all of the unit's parameters (trainable and frozen)
    persistent: bool = False  # gathered once per step and kept (root, tiny units)
    shard: Optional[torch.Tensor] = None  # this rank's slices, flat, compute dtype (CPU when offloaded)
    gathered: bool = False
    pending: Optional[tuple] = None  # (work, out) of an all-gather in flight
    nbytes_full: list[int] = field(default_factory=list)

    @property
    def full_bytes(self) -> int:
        return sum(self.nbytes_full)

    def local_views(self) -> list[torch.Tensor]:
        return self.layout.local_views(self.shard)


def _unit_modules(root: nn.Module, unit_classes: Optional[Sequence[type]], unit_bytes: int) -> list[nn.Module]:
    if unit_classes:
        classes = tuple(c for c in unit_classes if isinstance(c, type))
        names = {c for c in unit_classes if isinstance(c, str)}
        # strings match a class name ("T5Block") or a module's qualified name ("encoder.block.0")
        picked = [m for n, m in root.named_modules()
                  if m is not root and (isinstance(m, classes) or type(m).__name__ in names or n in names)]
        if not picked:
            some = sorted({type(m).__name__ for m in root.modules()})[:12]
            raise ValueError(
                f"No module matches unit_classes={list(unit_classes)}. Allowed: module classes, class names "
                f"(e.g. {', '.join(some)}) or qualified module names (e.g. 'encoder.block.0')."
            )
        # a unit inside another unit would be gathered twice: keep the outermost
        inner = {id(x) for m in picked for x in m.modules() if x is not m}
        return [m for m in picked if id(m) not in inner]
    chosen: list[nn.Module] = []
    owned_by_unit: set[int] = set()

    def visit(m: nn.Module) -> int:
        size = 0
        for child in m.children():
            size += visit(child)
        own = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False) if id(p) not in owned_by_unit)
        size += own
        if m is not root and size >= unit_bytes:
            chosen.append(m)
            owned_by_unit.update(id(p) for p in m.parameters())
            return 0
        return size

    visit(root)
    return chosen


def build_units(
    root: nn.Module,
    world_size: int,
    rank: int,
    unit_classes: Optional[Sequence[type]] = None,
    unit_bytes: int = 8 * 2**20,
    persist_numel: int = 0,
) -> list[Unit]:
    """Partition the root's parameters into units; the root unit (last) holds the rest.

    Units are returned in module registration order, root last.
    """
    modules = _unit_modules(root, unit_classes, unit_bytes)
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    # the chain of unit modules that contain each module, innermost last
    unit_ids = {id(m) for m in modules}
    chains: dict[int, list[nn.Module]] = {}

    def walk(m: nn.Module, chain: list[nn.Module]) -> None:
        chain = chain + [m] if id(m) in unit_ids else chain
        chains.setdefault(id(m), chain)
        for child in m.children():
            walk(child, chain)

    walk(root, [])
    # a parameter belongs to the innermost unit containing every module that registers it
    users: dict[int, list[list[nn.Module]]] = {}
    for mod in root.modules():
        for p in mod.parameters(recurse=False):
            users.setdefault(id(p), []).append(chains[id(mod)])
    for _, mod in root.named_modules(remove_duplicate=False):  # modules registered under several names
        for p in mod.parameters(recurse=False):
            users[id(p)].append(chains[id(mod)])
    order = list(root.parameters())
    owner = {id(p): _innermost_common(users[id(p)]) for p in order}
    groups: dict[Optional[int], list[nn.Parameter]] = {}
    for p in order:
        o = owner[id(p)]
        groups.setdefault(id(o) if o is not None else None, []).append(p)
    units: list[Unit] = []
    for m in modules + [root]:
        key = None if m is root else id(m)
        params = groups.get(key, [])
        if not params and m is not root:
            continue
        layout = _make(len(units), params, world_size, rank, True) if params else None
        unit = Unit(len(units), m, names.get(id(m), "") or "<root>", params, layout)
        unit.persistent = m is root or sum(p.numel() for p in params) < persist_numel
        unit.nbytes_full = [p.numel() * p.element_size() for p in params]
        units.append(unit)
    return units


def _innermost_common(chains: list[list[nn.Module]]) -> Optional[nn.Module]:
    """Last unit module shared by the front of every chain (None: only the root contains them all)."""
    common = None
    for level in zip(*chains):
        if any(m is not level[0] for m in level):
            break
        common = level[0]
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
