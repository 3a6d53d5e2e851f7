"""Stage 3 unit policy: which modules are gathered and released as one unit.

Design note
-----------
The first rule that applies decides (the name goes into the setup log line):

``user``      ``unit_classes`` (classes, class names or qualified module names; every entry must match
              something) or an explicit ``unit_mb`` (the size rule below at that size).
``declared``  the model's own declaration: HF ``PreTrainedModel._no_split_modules``, the list accelerate's
              FSDP auto-wrap and ``device_map`` use, found on the root or on any submodule (a
              LightningModule holds the HF model as an attribute).
``repeated``  the class of the repeated children of the largest ``ModuleList`` / ``Sequential``
              (transformer blocks), and of every other outermost such container at least a quarter of its
              size (``nn.Transformer``'s encoder and decoder layers).
``size``      bottom-up: a module becomes a unit once the parameters no inner unit owns reach
              ``min(8 MiB, model / 8)``, so a small model still forms several units.

A unit must be a module whose ``forward`` runs: its pre-forward hook is what gathers it. A ``ModuleList``
/ ``ModuleDict`` has no forward, and a ``Sequential`` runs its forward only when the parent calls it as a
whole -- the parent may as well iterate it and call the children. Telling the two apart needs a trace, so
no rule ever picks a container: where one would be chosen its children are (through nested containers),
and those run in both cases. ``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling
``out_proj``: it is never split. Anything the rules cannot see (a parent reading a child's weight) is
caught at run time by :mod:`.guard`.
"""

from __future__ import annotations

import difflib
import statistics
from collections import Counter
from typing import Iterable, Optional, Sequence

from torch import nn

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
NO_FORWARD = (nn.ModuleList, nn.ModuleDict)  # calling one raises: never a unit, even when named by the user
ATOMIC = (nn.MultiheadAttention,)  # forward reads its children's parameters directly
AUTO_UNIT_BYTES = 8 * 2**20
MIN_UNITS = 8  # the size rule cuts a small model into about this many units
PERSIST_CAP = 10_000  # auto persistence never keeps a unit of more elements than this gathered


def _nbytes(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def runnable(m: nn.Module) -> list[nn.Module]:
    """``m`` itself, or for a container the modules under it that run whatever way it is used."""
    if not isinstance(m, CONTAINERS):
        return [m]
    return [r for c in m.children() for r in runnable(c)]


def _outermost(picked: list[nn.Module]) -> list[nn.Module]:
    """A unit inside another unit would be gathered twice: keep the outer one."""
    inner = {id(x) for m in picked for x in m.modules() if x is not m}
    seen: set[int] = set()
    out = []
    for m in picked:
        if id(m) not in inner and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def _splittable_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module except the root and those inside an atomic module."""
    out, skip = [], set()
    for name, m in root.named_modules():
        if id(m) in skip:
            continue
        if isinstance(m, ATOMIC):
            skip.update(id(x) for x in m.modules() if x is not m)
        if m is not root:
            out.append((name, m))
    return out


def _by_classes(root: nn.Module, classes: tuple, names: set) -> list[nn.Module]:
    return _outermost([m for n, m in _splittable_modules(root)
                       if type(m) in classes or type(m).__name__ in names or n in names])


# -- user ------------------------------------------------------------------------------------------------
def _user_classes(root: nn.Module, unit_classes: Sequence) -> list[nn.Module]:
    named = dict(root.named_modules())
    class_names = sorted({type(m).__name__ for m in root.modules() if m is not root})
    for entry in unit_classes:
        if isinstance(entry, type):
            hit = any(isinstance(m, entry) for m in root.modules() if m is not root)
        elif isinstance(entry, str):
            hit = entry in class_names or (entry in named and entry != "")
        else:
            raise ValueError(f"unit_classes entries must be module classes, class names or qualified module "
                             f"names; got {entry!r} ({type(entry).__name__}).")
        if not hit:
            dotted = next((repr(n) for n, _ in _splittable_modules(root) if "." in n), repr("encoder.block.0"))
            raise ValueError(unmatched_entry("unit_classes", entry, root, names=list(named))
                             + f" or qualified module names (e.g. {dotted}).")
    classes = tuple(c for c in unit_classes if isinstance(c, type))
    strs = {c for c in unit_classes if isinstance(c, str)}
    # not inside nn.MultiheadAttention: unit_classes=[nn.Linear] would otherwise release out_proj, which it
    # reads without calling
    picked = [m for n, m in _splittable_modules(root)
              if isinstance(m, classes) or type(m).__name__ in strs or n in strs]
    for m in picked:
        if isinstance(m, NO_FORWARD):
            label = next(n for n, x in root.named_modules() if x is m)
            kids = sorted({type(c).__name__ for c in m.children()})
            raise ValueError(
                f"unit_classes picks '{label}', a {type(m).__name__}: it has no forward, so its parameters would "
                f"never be gathered. Name the modules it holds instead (e.g. {', '.join(kids) or 'its children'})."
            )
    return _outermost(picked)


def unit_candidates(root: nn.Module) -> list[str]:
    """Class names of the modules that could be units: a forward that runs, parameters of their own or
    below, not inside an atomic module; what the automatic policy picks comes first."""
    auto = [type(m).__name__ for m in (_declared(root) or _repeated(root))]
    found = sorted({type(m).__name__ for _, m in _splittable_modules(root)
                    if not isinstance(m, NO_FORWARD) and any(True for _ in m.parameters())})
    return list(dict.fromkeys(auto + found))


def unmatched_entry(knob: str, entry, root: nn.Module, names: Sequence[str] = ()) -> str:
    """The error of a ``knob`` entry that names no module of ``root``: a did-you-mean (difflib) and the
    class names the model offers; the caller appends what else it accepts."""
    label = entry.__name__ if isinstance(entry, type) else str(entry)
    offered = unit_candidates(root)
    close = difflib.get_close_matches(label, offered + [n for n in names if n not in offered], n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    return (f"{knob} entry {label!r} matches no module of {type(root).__name__}.{hint} Allowed: module classes "
            f"or class names of its modules that could be units ({', '.join(offered) or 'none'})")


# -- declared ----------------------------------------------------------------------------------------------
def declared_names(root: nn.Module) -> list[str]:
    """Union of every ``_no_split_modules`` declaration on the root and its submodules."""
    names: list[str] = []
    for m in root.modules():
        try:
            decl = getattr(m, "_no_split_modules", None)
        except Exception:  # a property that needs a fully built model
            decl = None
        if isinstance(decl, (list, tuple, set)):
            names.extend(str(x) for x in decl)
    return list(dict.fromkeys(names))


def _declared(root: nn.Module) -> list[nn.Module]:
    names = set(declared_names(root))
    if not names:
        return []
    return [m for m in _by_classes(root, (), names) if not isinstance(m, NO_FORWARD)]


# -- repeated ---------------------------------------------------------------------------------------------
def _repeated(root: nn.Module) -> list[nn.Module]:
    found = []  # (container bytes, container, classes of its repeated children)
    for m in [root] + [m for _, m in _splittable_modules(root)]:  # a Sequential root: its children
        if not isinstance(m, CONTAINERS):
            continue
        kids = [k for c in m.children() for k in runnable(c) if any(True for _ in k.parameters())]
        repeated = {cls for cls, n in Counter(type(k) for k in kids).items() if n >= 2}
        if repeated:
            found.append((_nbytes(m.parameters()), m, repeated))
    if not found:
        return []
    found.sort(key=lambda t: -t[0])
    chosen: list = []
    for size, m, classes in found:  # outermost containers, the largest first
        if size * 4 < found[0][0] or any(any(x is m for x in c.modules()) for _, c, _ in chosen):
            continue
        chosen.append((size, m, classes))
    classes = tuple(set().union(*(c for _, _, c in chosen)))
    return _outermost([m for _, m in _splittable_modules(root) if type(m) in classes])


# -- size ------------------------------------------------------------------------------------------------
def _by_size(root: nn.Module, unit_bytes: int) -> list[nn.Module]:
    chosen: list[nn.Module] = []
    owned: set[int] = set()

    def free(params) -> list:
        return [p for p in params if id(p) not in owned]

    def visit(m: nn.Module) -> int:
        if isinstance(m, ATOMIC):
            size = _nbytes(free(m.parameters()))
        else:
            size = sum(visit(c) for c in m.children()) + _nbytes(free(m.parameters(recurse=False)))
        if m is not root and size >= unit_bytes:
            # a container's children, never the container (its forward may not run)
            for u in runnable(m):
                if free(u.parameters()):
                    chosen.append(u)
                    owned.update(id(p) for p in u.parameters())
            return _nbytes(free(m.parameters(recurse=False)))
        return size

    visit(root)
    return chosen


def auto_unit_bytes(root: nn.Module) -> int:
    return max(1, min(AUTO_UNIT_BYTES, _nbytes(root.parameters()) // MIN_UNITS))


# -- the policy -------------------------------------------------------------------------------------------
def choose_unit_modules(root: nn.Module, unit_classes: Optional[Sequence] = None,
                        unit_bytes: Optional[int] = None) -> tuple[list[nn.Module], str]:
    """The unit modules (registration order) and the name of the rule that chose them."""
    if unit_classes:
        return _user_classes(root, unit_classes), "user unit_classes"
    if unit_bytes is not None:
        return _by_size(root, unit_bytes), f"user unit_mb={unit_bytes / 2**20:.3g}"
    picked = _declared(root)
    if picked:
        return picked, f"declared _no_split_modules {sorted({type(m).__name__ for m in picked})}"
    picked = _repeated(root)
    if picked:
        return picked, f"repeated children {sorted({type(m).__name__ for m in picked})}"
    size = auto_unit_bytes(root)
    return _by_size(root, size), f"size >= {size / 2**20:.3g} MiB"


def auto_persist_numel(unit_numels: list[int]) -> int:
    """Units below this stay gathered for the whole step: a quarter of an average unit, at most 10,000
    elements -- small units cost little to hold, and the ones that remain are still partitioned."""
    if not unit_numels:
        return 0
    return min(PERSIST_CAP, sum(unit_numels) // (4 * len(unit_numels)))


def _count(n: int) -> str:
    for div, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


def describe_units(units, policy: str, persist_numel: int) -> str:
    """One line: how many units, their sizes, which are persistent, and which rule chose them."""
    inner = units[:-1]
    sizes = sorted(sum(p.numel() for p in u.params) for u in inner)
    pers = [u for u in inner if u.persistent]
    root = sum(p.numel() for p in units[-1].params)
    if not sizes:
        return f"ZeRO-3 units: none besides the root ({_count(root)} params, persistent); policy: {policy}"
    return (f"ZeRO-3 units: {len(inner)} + root, params min/median/max {_count(sizes[0])}/"
            f"{_count(int(statistics.median(sizes)))}/{_count(sizes[-1])}, {len(pers)} persistent "
            f"(< {_count(persist_numel)} params), root {_count(root)} (persistent); policy: {policy}")
