"""Deferred initialization (stage 3): build a model bigger than one rank without ever holding it whole.

Design note
-----------
The model is constructed on the ``meta`` device (no memory; Lightning's ``configure_model`` under
``ZeroStrategy(stage=3)``, ``Trainer/Fabric.init_module(empty_init=True)``, or ``with torch.device("meta")``).
The engine gives it values unit by unit; as soon as a unit has its values it is broadcast from rank 0
(ranks need not share an RNG state) and cut down to this rank's shard, so only the root's parameters and
one unit are ever whole at the same time. Where the values come from:

* plain modules: their own ``reset_parameters()``, walked in registration order -- the order eager
  construction initialized them -- so with the same seed the random stream is consumed as eager
  ``__init__`` consumed it and the values equal the eager model's.
* Hugging Face models (duck-typed, the engine does not import transformers: a module with
  ``_init_weights``, ``post_init`` and a ``config``): eager construction runs every submodule's torch
  default init first (``nn.Linear.__init__`` -> ``reset_parameters``) and then, in each model's
  ``post_init``, ``_init_weights`` over its subtree in post-order (nested models -- GPT-2's
  ``transformer``, T5's encoder/decoder stacks -- first, each with its own ``_init_weights``), skipping
  modules already initialized, and ties the embeddings last. A value is the last of these writes, but
  the random stream runs through all of them, across units. So a first pass replays the whole sequence
  on scratch storage (one unit at a time) only to note the generator state before each write; the
  second pass gives each unit its values by replaying just its own writes from the noted states. A write
  through a tied parameter by a module that did not own it yet (``lm_head`` before ``tie_weights``) goes
  to scratch, as in eager construction it went to the module's own, later discarded, tensor.
  A constructor that draws by itself, without ``reset_parameters`` (GPT-2's ``Conv1D``: ``nn.init.normal_``
  in ``__init__``), is replayed from what ``meta_init()`` -- the context the strategies build in -- noted of
  its in-place ops on its parameters. So the values are the eager CPU model's bit for bit, and the generator
  ends where eager construction left it. Built under a plain ``torch.device("meta")`` instead, such a draw
  is not known: what follows it in the stream is shifted (same distributions, other numbers).
  Values are computed on the CPU (the generator an eager build uses) and then moved to the device. An
  ``_init_weights(m)`` may write parameters of ``m``'s children (GPT-2's attention rescales ``c_proj``), which
  works when they are in ``m``'s unit or the root unit -- the case for units at block granularity.

A module with meta parameters and neither ``reset_parameters`` nor an HF model above it is refused
before anything is allocated; a parameter or floating buffer that no init wrote (it is filled with NaN
first) is refused after its unit, by name.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm import collectives as C

_WAYS_OUT = ("Allowed: build the model eagerly (outside configure_model / with init_module(empty_init=False)), "
             "add reset_parameters() to these modules, or load pretrained weights into the meta model "
             "(ZeroStrategy(stage=3, load_weights_from=DIR) / lightning_zero.load_pretrained).")


_OPS = "_zero_init_ops"  # on a meta Parameter: the in-place ops its constructor ran, (seq, op, args, kwargs)


class _ConstructionRecorder(TorchDispatchMode):
    """Notes the in-place ops run on meta parameters while a model is built (``nn.init.normal_`` in a
    constructor), so that deferred init can replay the draws of a module without ``reset_parameters``."""

    seq = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        # an op reading another tensor (copy_ from a meta source) has no value to replay: left to the NaN check
        if (isinstance(target, nn.Parameter) and target.is_meta and func._schema.is_mutable
                and func._schema.name.endswith("_")
                and not any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values()))):
            target.__dict__.setdefault(_OPS, []).append((next(self.seq), func, tuple(args[1:]), dict(kwargs)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build on the meta device (what ``configure_model`` / ``init_module(empty_init=True)`` enter at stage 3),
    noting what constructors do to their parameters."""
    with torch.device("meta"), _ConstructionRecorder():
        yield


def has_meta_params(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers())


def is_hf_model(m: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` by its shape: its own per-module init and a config."""
    return (callable(getattr(m, "_init_weights", None)) and callable(getattr(m, "post_init", None))
            and getattr(m, "config", None) is not None)


def hf_owners(root: nn.Module) -> dict[int, nn.Module]:
    """Each module's nearest HF model (itself included): whose ``_init_weights`` initializes it."""
    owners: dict[int, nn.Module] = {}

    def walk(m: nn.Module, owner: Optional[nn.Module]) -> None:
        owner = m if is_hf_model(m) else owner
        if owner is not None:
            owners.setdefault(id(m), owner)
        for child in m.children():
            walk(child, owner)

    walk(root, None)
    return owners


def _own_meta(m: nn.Module) -> bool:
    return (any(p.is_meta for p in m.parameters(recurse=False))
            or any(b is not None and b.is_meta for b in m.buffers(recurse=False)))


def check_initializable(root: nn.Module, owners: dict[int, nn.Module]) -> None:
    missing = [f"{name} ({type(m).__name__})" for name, m in root.named_modules()
               if any(p.is_meta for p in m.parameters(recurse=False))
               and not hasattr(m, "reset_parameters") and id(m) not in owners]
    if missing:
        raise ValueError(
            "Deferred (meta-device) initialization at stage 3 needs, on every module that owns parameters, "
            "reset_parameters() or a Hugging Face model above it whose _init_weights() initializes it; "
            f"neither on: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. {_WAYS_OUT}")


@torch.no_grad()
def materialize(root: nn.Module, units: Sequence, device: torch.device, group,
                on_unit_done: Callable[[object], None]) -> None:
    """Give ``root`` its values unit by unit (``units``: the non-root units, each with ``.module`` and
    ``.params``); call ``on_unit_done(unit)`` after each, once its values are on every rank."""
    owners = hf_owners(root)
    check_initializable(root, owners)
    if owners:
        _HFReplay(root, units, owners, device, group, on_unit_done).run()
    else:
        _materialize_in_order(root, units, device, group, on_unit_done)


def _materialize_in_order(root, units, device, group, on_unit_done) -> None:
    """Plain modules: ``reset_parameters`` in registration order, a unit done as the walk leaves it."""
    by_module = {id(u.module): u for u in units}

    def visit(m: nn.Module) -> None:
        if _allocate_own(m, device, nan=False) and hasattr(m, "reset_parameters"):
            m.reset_parameters()
        for child in m.children():
            visit(child)
        if id(m) in by_module:
            _broadcast(list(m.parameters()) + list(m.buffers()), group)
            on_unit_done(by_module[id(m)])

    visit(root)
    _broadcast([p for p in root.parameters() if p.untyped_storage().nbytes() > 0] + list(root.buffers()), group)


def _allocate_own(m: nn.Module, device, nan: bool) -> bool:
    """Real storage for ``m``'s own meta parameters and buffers (the Parameter objects are kept: units
    and hooks hold them). ``nan``: filled so that a value no init writes is found afterwards."""
    fresh = False
    for p in m.parameters(recurse=False):
        if p.is_meta:
            t = torch.empty_like(p, device=device)
            if nan and t.is_floating_point():
                t.fill_(float("nan"))
            torch.utils.swap_tensors(p, nn.Parameter(t, p.requires_grad))
            fresh = True
    for name, b in list(m._buffers.items()):
        if b is not None and b.is_meta:
            t = torch.empty_like(b, device=device)
            if nan and t.is_floating_point():
                t.fill_(float("nan"))
            m._buffers[name] = t
            fresh = True
    return fresh


def _to_meta(m: nn.Module) -> None:
    for p in m.parameters(recurse=False):
        if not p.is_meta:
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
    for name, b in list(m._buffers.items()):
        if b is not None and not b.is_meta:
            m._buffers[name] = torch.empty_like(b, device="meta")


def _broadcast(tensors: list[torch.Tensor], group) -> None:
    for t in tensors:
        C.broadcast(t.data if isinstance(t, nn.Parameter) else t, 0, group)


class _HFReplay:
    """The two passes of the design note over a tree that holds HF models."""

    def __init__(self, root, units, owners, device, group, on_unit_done) -> None:
        self.root, self.units, self.owners = root, list(units), owners
        self.device, self.group, self.on_unit_done = torch.device(device), group, on_unit_done
        self.modules = list(root.modules())
        # a module's unit: the innermost unit module above it (or the root unit, None)
        self.unit_of: dict[int, Optional[int]] = {}
        unit_ids = {id(u.module): i for i, u in enumerate(self.units)}

        def walk(m: nn.Module, unit: Optional[int]) -> None:
            unit = unit_ids.get(id(m), unit)
            self.unit_of.setdefault(id(m), unit)
            for child in m.children():
                walk(child, unit)

        walk(root, None)
        # a tied parameter belongs to the first module registering it; other modules' writes are scratch
        self.first_holder: dict[int, int] = {}
        for m in self.modules:
            for p in m.parameters(recurse=False):
                self.first_holder.setdefault(id(p), id(m))
        # what constructors did to their parameters on meta (meta_init); read now: storage swaps drop it
        self.recorded = {id(p): p.__dict__.get(_OPS) for m in self.modules for p in m.parameters(recurse=False)}
        self.events = self._eager_order()

    def _eager_order(self) -> list[tuple[str, nn.Module]]:
        """("reset", m) / ("hf", m) in the order eager construction ran them."""
        events: list[tuple[str, nn.Module]] = []
        done: set[int] = set()  # modules an HF pass has initialized (HF's _is_hf_initialized)

        seen: set[int] = set()  # a module registered twice (a shared embedding) was constructed once

        def construct(m: nn.Module) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            if any(True for _ in m.parameters(recurse=False)) and hasattr(m, "reset_parameters"):
                events.append(("reset", m))
            elif any(self.recorded.get(id(p)) for p in m.parameters(recurse=False)):
                events.append(("ops", m))  # its constructor's own draws (GPT-2's Conv1D), as recorded
            for child in m.children():
                construct(child)
            if is_hf_model(m):  # its post_init: _init_weights over its subtree, children first
                for x in _post_order(m):
                    if id(x) not in done:
                        done.add(id(x))
                        events.append(("hf", x))

        construct(self.root)
        return events

    def _run_event(self, kind: str, m: nn.Module) -> None:
        # a tied parameter first held elsewhere: eager wrote this module's own tensor, dropped at tying
        swapped = {}
        for name, p in list(m._parameters.items()):
            if p is not None and self.first_holder.get(id(p)) != id(m):
                swapped[name] = p
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
        try:
            if kind == "reset":
                m.reset_parameters()
            elif kind == "ops":
                ops = sorted(op + (p,) for p in m.parameters(recurse=False) for op in self.recorded.get(id(p)) or ())
                for _, func, args, kwargs, p in ops:
                    func(p.data, *args, **kwargs)
            else:
                self.owners[id(m)]._init_weights(m)
        finally:
            m._parameters.update(swapped)

    def _unit_modules(self, unit: Optional[int]) -> list[nn.Module]:
        return [m for m in self.modules if self.unit_of[id(m)] == unit]

    def run(self) -> None:
        cpu = torch.device("cpu")
        # pass 1: the generator state before every write, on scratch storage (the root and one unit real)
        states: list[torch.Tensor] = []
        for m in self._unit_modules(None):
            _allocate_own(m, cpu, nan=False)
        real: Optional[int] = None
        for kind, m in self.events:
            unit = self.unit_of[id(m)]
            if unit is not None and unit != real:
                if real is not None:
                    for x in self._unit_modules(real):
                        _to_meta(x)
                for x in self._unit_modules(unit):
                    _allocate_own(x, cpu, nan=False)
                real = unit
            states.append(torch.get_rng_state())
            self._run_event(kind, m)
        end_state = torch.get_rng_state()
        if real is not None:
            for x in self._unit_modules(real):
                _to_meta(x)
        for m in self._unit_modules(None):
            _to_meta(m)
        # pass 2: each unit's own writes from their states; the root's (tied embeddings) last
        order = list(range(len(self.units))) + [None]
        for unit in order:
            members = self._unit_modules(unit)
            for m in members:
                _allocate_own(m, cpu, nan=True)
            for (kind, m), state in zip(self.events, states):
                if self.unit_of[id(m)] == unit:
                    torch.set_rng_state(state)
                    self._run_event(kind, m)
            if unit is None:
                self._tie(self.root)
            self._check_written(members)
            for m in members:
                _move_own(m, self.device)
            if unit is not None:
                _broadcast(list(self.units[unit].module.parameters()) + list(self.units[unit].module.buffers()),
                           self.group)
                self.on_unit_done(self.units[unit])
        torch.set_rng_state(end_state)  # the generator where eager construction left it (dropout, data)
        _broadcast([p for p in self.root.parameters() if p.untyped_storage().nbytes() > 0]
                   + list(self.root.buffers()), self.group)

    @staticmethod
    def _tie(root: nn.Module) -> None:
        # the meta build already tied (the same Parameter objects); re-tie in case a model re-creates them
        for m in root.modules():
            if is_hf_model(m) and callable(getattr(m, "tie_weights", None)):
                m.tie_weights()
                break

    def _check_written(self, members: list[nn.Module]) -> None:
        names = {id(m): n for n, m in self.root.named_modules()}
        bad = []
        for m in members:
            for n, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None and t.is_floating_point() and t.numel() and not t.is_meta and t.isnan().all():
                    bad.append(f"{names.get(id(m), '?')}.{n}".lstrip("."))
        if bad:
            raise ValueError(
                "Deferred (meta-device) initialization at stage 3: no reset_parameters() or _init_weights() wrote "
                f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''} (a value only the constructor sets). "
                + _WAYS_OUT)


def _post_order(m: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []

    def walk(x: nn.Module) -> None:
        for child in x.children():
            walk(child)
        out.append(x)

    walk(m)
    return out


def _move_own(m: nn.Module, device: torch.device) -> None:
    if device.type == "cpu":
        return
    for p in m.parameters(recurse=False):
        if not p.is_meta and p.device != device:
            p.data = p.data.to(device)
    for name, b in list(m._buffers.items()):
        if b is not None and b.device != device:
            m._buffers[name] = b.to(device)


def compute_device(module: nn.Module) -> torch.device:
    """Where a (possibly meta) module computes: where its first real tensor is, else the current device."""
    for t in list(module.parameters()) + list(module.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
