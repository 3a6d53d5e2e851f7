"""Activation memory: checkpointing (recompute in backward) and offload of saved activations to host memory.

Design note
-----------
Model states sit at the ZeRO floors; what bounds the micro-batch then is the tensors autograd saves for
backward. Two options, applied by the engine from :class:`~.config.ZeroConfig` (no Lightning involved):

* ``activation_checkpointing``: each chosen module's forward runs under non-reentrant
  ``torch.utils.checkpoint``; only its inputs are saved, and backward recomputes the forward. The module's
  own hooks (stage 3's gather/release) stay *outside* the checkpoint: a Hugging Face
  ``GradientCheckpointingLayer`` is switched to its own checkpointing path with our function (it also
  drops the KV cache there, which a recompute would extend twice); any other module gets its ``forward``
  wrapped. Under stage 3, a region that is a unit (``"auto"``) or lies inside one is recomputed while its
  unit is gathered for backward: no extra gather. A region holding several units (``["T5Stack"]``) re-runs
  their forwards: :func:`recomputing` is true there, and the partitioner then gathers each unit without
  recording or checking the forward order, prefetching, or releasing (the unit is released when its
  gradients are reduced, as usual) -- see ``partition.py``.
* ``offload_activations``: every saved tensor but parameters is copied to host memory during forward
  (pinned, asynchronously, on CUDA) and back to its device when backward unpacks it
  (:class:`ActivationOffload`, ``torch.autograd.graph.save_on_cpu``'s mechanism). With checkpointing too,
  only the regions' inputs are saved, so only those travel. The context covers the root module's forward;
  the Lightning strategy also enters it around ``training_step`` (the loss is computed there).

:class:`SavedBytes` counts what autograd saves (each storage once, parameters excluded): the measurement
the estimator (``tools/t5_dims.py``) is calibrated against.
"""

from __future__ import annotations

import contextlib
import difflib
import threading
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..placement.activation_stores import activation_store
from ..placement.location import Location
from ..plan import ShardingPlan
from ..stage3.unit_policy import NO_FORWARD, _outermost, choose_unit_modules

_local = threading.local()  # recompute depth: per thread (CUDA backward runs on the autograd engine's device thread)
_measure: Optional["RecomputeBytes"] = None  # process-wide: read on whichever thread recomputes


def recomputing() -> bool:
    """True while a checkpointed forward is being recomputed in backward."""
    return getattr(_local, "depth", 0) > 0


def in_checkpointed_forward() -> bool:
    """True while a checkpointed forward runs for the first time: the units it runs are gathered again by its
    recompute in backward, before their own backward."""
    return getattr(_local, "first", 0) > 0


@contextlib.contextmanager
def _recompute(counter: str = "depth") -> Iterator[None]:
    setattr(_local, counter, getattr(_local, counter, 0) + 1)
    try:
        yield
    finally:
        setattr(_local, counter, getattr(_local, counter) - 1)


class RecomputeBytes:
    """The largest working set of one recompute (bytes its forward saves), while :func:`measure_recompute` is open."""

    def __init__(self) -> None:
        self.peak = 0
        self.count = 0


@contextlib.contextmanager
def measure_recompute() -> Iterator[RecomputeBytes]:
    """Measure what each recompute in the enclosed backward holds: its forward runs once more, first, under
    :class:`SavedBytes` (the real one's saves go to the checkpoint, out of any hook's sight), with the RNG
    state restored after it. Costs one extra forward per region; for measurements (the tuner's probes)."""
    global _measure
    prev, _measure = _measure, RecomputeBytes()
    try:
        yield _measure
    finally:
        _measure = prev


def checkpointed_call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpointing; its later calls (recomputes) are marked."""
    first = [True]

    def body(*a: Any, **kw: Any) -> Any:
        if first[0]:
            first[0] = False
            with _recompute("first"):
                return fn(*a, **kw)
        with _recompute():
            rec = _measure
            if rec is not None:  # before the real recompute, which stops early once backward has what it needs
                saved = SavedBytes(())
                cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
                with torch.random.fork_rng(devices=cuda), saved.hooks():  # the same dropout masks after it
                    fn(*a, **kw)
                rec.peak, rec.count = max(rec.peak, saved.bytes), rec.count + 1
            return fn(*a, **kw)

    return checkpoint(body, *args, use_reentrant=False, **kwargs)


def _is_hf_checkpointing_layer(m: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)


def checkpoint_modules(root: nn.Module, spec: Union[None, str, Sequence[Union[type, str]]],
                       unit_classes: Optional[Sequence] = None, unit_bytes: Optional[int] = None) -> list[nn.Module]:
    """The modules whose forward is checkpointed (outermost only): ``None`` none, ``"auto"`` the modules the
    stage-3 unit policy picks (with the same ``unit_classes`` / ``unit_bytes``), else every instance of the
    named classes. An entry that matches no module is refused, naming the classes the model has."""
    if spec is None:
        return []
    if spec == "auto":
        return choose_unit_modules(root, unit_classes, unit_bytes)[0]
    modules = [m for m in root.modules() if m is not root]
    found = sorted({type(m).__name__ for m in modules})
    for entry in spec:
        hit = any(isinstance(m, entry) for m in modules) if isinstance(entry, type) else entry in found
        if not hit:
            label = entry.__name__ if isinstance(entry, type) else entry
            auto = sorted({type(m).__name__ for m in choose_unit_modules(root)[0]})
            close = difflib.get_close_matches(label, found, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"activation_checkpointing entry {label!r} matches no module of {type(root).__name__}.{hint} Allowed: "
                f"'auto' (here {auto or 'no unit'}), or classes / class names of its modules: {', '.join(found)}.")
    classes = tuple(e for e in spec if isinstance(e, type))
    names = {e for e in spec if isinstance(e, str)}
    picked = [m for m in modules if isinstance(m, classes) or type(m).__name__ in names]
    for m in picked:
        if isinstance(m, NO_FORWARD):
            raise ValueError(f"activation_checkpointing picks a {type(m).__name__}, which has no forward to "
                             f"checkpoint. Name the modules it holds instead.")
    return _outermost(picked)


class ActivationCheckpointing:
    """Checkpoints the forward of ``modules`` (inside ``root``) until :meth:`remove`."""

    def __init__(self, modules: list[nn.Module], root: Optional[nn.Module] = None) -> None:
        self.modules = modules
        self._undo: list[Callable[[], None]] = []
        for m in modules:
            self._undo.append(self._install(m))
        if root is not None:
            self._undo.extend(self._flag_hf_models(root, modules))

    @staticmethod
    def _flag_hf_models(root: nn.Module, modules: list[nn.Module]) -> list[Callable[[], None]]:
        """[Note: HF's model-level checkpointing flag] An HF model holding checkpointed layers reads its own
        ``gradient_checkpointing`` too: GPT2Model hands its KV cache to the blocks positionally unless it is
        set, past the layer's own cache check, so a training step with the config's ``use_cache=True`` keeps
        every layer's K and V of the whole sequence through backward, and the recompute extends the cache a
        second time. HF's ``gradient_checkpointing_enable`` sets the flag on the models; so does the engine,
        on every module above a checkpointed layer that has one, restored by :meth:`remove`."""
        layers = {id(m) for m in modules if _is_hf_checkpointing_layer(m)}
        undo: list[Callable[[], None]] = []
        if not layers:
            return undo
        for p in root.modules():
            if id(p) not in layers and "gradient_checkpointing" in p.__dict__ \
                    and any(id(c) in layers for c in p.modules()):
                undo.append(lambda p=p, before=p.__dict__["gradient_checkpointing"]:
                            setattr(p, "gradient_checkpointing", before))
                p.gradient_checkpointing = True
        return undo

    @staticmethod
    def _install(m: nn.Module) -> Callable[[], None]:
        if _is_hf_checkpointing_layer(m):
            before = {k: m.__dict__[k] for k in ("gradient_checkpointing", "_gradient_checkpointing_func")
                      if k in m.__dict__}
            m.gradient_checkpointing = True
            m._gradient_checkpointing_func = checkpointed_call

            def undo() -> None:
                for k in ("gradient_checkpointing", "_gradient_checkpointing_func"):
                    m.__dict__.pop(k, None)
                m.__dict__.update(before)

            return undo
        original = m.forward
        # a forward the module already had on the instance (a tiled MLP's) is what the engine hands back
        own = m.__dict__.get("forward")

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not (m.training and torch.is_grad_enabled()):
                return original(*args, **kwargs)
            return checkpointed_call(original, *args, **kwargs)

        m.forward = forward

        def undo() -> None:
            m.__dict__.pop("forward", None)
            if own is not None:
                m.forward = own

        return undo

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()


class ActivationMemory:
    """Both options on one module: checkpointed regions and the offload context around the root's forward."""

    def __init__(self, root: nn.Module, checkpointing: list[nn.Module], where: Location) -> None:
        """``where``: the saved activations' location (the plan's ``placement.activations``)."""
        self.root = root
        self.store = activation_store(where)
        self.checkpointing = ActivationCheckpointing(checkpointing, root)
        self.offloaded_bytes = 0  # bytes the store moved off the device
        self._open: list[Any] = []
        self._handles = []
        if self.store.moves_saved_tensors:  # the root's own forward (outside training_step) goes there too
            self._handles = [root.register_forward_pre_hook(self._enter),
                             root.register_forward_hook(self._exit, always_call=True)]

    @property
    def checkpointed(self) -> list[nn.Module]:
        return self.checkpointing.modules

    def context(self) -> contextlib.AbstractContextManager:
        """Where saved activations go for a block of training code (Lightning: ``training_step``)."""
        return self.store.context(self)

    def _enter(self, module: nn.Module, _args) -> None:
        ctx = self.context()
        ctx.__enter__()
        self._open.append(ctx)

    def _exit(self, module: nn.Module, _args, _output) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.checkpointing.remove()


def activation_memory(root: nn.Module, config, units=None) -> Optional[ActivationMemory]:
    """The options of a :class:`~.config.ZeroConfig` applied to ``root`` (None when both are off); at stage 3
    (``units`` given) ``"auto"`` checkpoints exactly the units."""
    spec = config.activation_checkpointing
    where = ShardingPlan.of(config).placement.activations
    if spec is None and not activation_store(where).moves_saved_tensors:
        return None
    if spec == "auto" and units is not None:
        regions = [u.module for u in units[:-1]]
    else:
        regions = checkpoint_modules(root, spec, config.unit_classes, config.unit_bytes)
    return ActivationMemory(root, regions, where)


class SavedBytes:
    """Bytes of the tensors autograd saves in a forward: each storage once, parameters excluded.

    A parameter can be saved as itself or as a view (``F.linear`` saves ``weight.t()``); both share the
    parameter's storage, already counted as a model state, so storages of parameters are skipped.
    Copies of parameters (autocast's bf16 weights) have storages of their own and count. Tensors saved
    inside a checkpointed region are not saved (only the region's inputs are), so they are not seen.
    """

    def __init__(self, params) -> None:
        params = list(params)
        self.param_ids = {id(p) for p in params}
        self.seen: set[int] = {p.untyped_storage().data_ptr() for p in params if p.untyped_storage().nbytes()}
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in self.param_ids and id(base) not in self.param_ids and not isinstance(base, nn.Parameter):
            st = t.untyped_storage()
            if st.data_ptr() not in self.seen:
                self.seen.add(st.data_ptr())
                self.bytes += st.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
