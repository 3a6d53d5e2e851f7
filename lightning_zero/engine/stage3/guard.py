"""Stage 3 safety net: a forward that reaches a released parameter gathers it, or fails with one clear error.

Design note
-----------
A unit is gathered by the pre-forward hook of its module. Two ways around that hook exist:

* **a module of the unit runs outside the unit's forward** (a ``ModuleList`` named as a unit, whose
  children the parent calls; a block calling another block's submodule). Every module that registers
  parameters of a non-root unit gets a pre-forward hook: if its unit is not gathered there, it is
  gathered on demand for that module's forward (released after it, gathered again for its backward),
  with one warning naming the unit. In the normal path the hook only reads a flag: no collective.
* **a parent reads a child's parameter** (``F.linear(x, self.blocks[0].fc.weight)``): no module of the
  unit runs, so no module hook can see it. During the first forwards (until the first backward ends; for
  an evaluation-only engine, the first evaluation forward), a ``TorchFunctionMode`` checks the arguments of every torch call
  for released parameters and raises one error naming the parameter, its unit and the ``unit_classes``
  fix, instead of torch's storage-size error from deep inside an operator. Model structure does not
  change between steps, so one checked step covers the next ones; the mode costs a Python call per torch
  op (measured: a tiny GPT-2 step on one CPU thread ~50% slower) and is removed after it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# reading these does not touch a tensor's data: allowed on a released parameter
_METADATA_ATTRS = {"shape", "dtype", "data", "device", "requires_grad", "grad", "is_leaf", "ndim", "is_meta",
                   "layout", "is_cuda", "is_sparse", "is_quantized", "names", "_version", "grad_fn", "name",
                   "itemsize", "_base", "is_nested", "is_cpu", "output_nr"}
_METADATA_METHODS = {"numel", "size", "dim", "is_floating_point", "untyped_storage", "element_size", "stride",
                     "is_contiguous", "requires_grad_", "get_device", "is_complex", "register_hook",
                     "register_post_accumulate_grad_hook", "__hash__", "nelement", "storage_offset",
                     "retain_grad", "__len__", "__repr__", "__format__", "is_signed", "data_ptr", "result_type",
                     # new tensors shaped like the parameter: its data is not read
                     "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_empty",
                     "new_zeros", "new_ones", "new_full"}


def _is_metadata(func) -> bool:
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and owner is not None:
        return getattr(owner, "__name__", "") in _METADATA_ATTRS
    return getattr(func, "__name__", "") in _METADATA_METHODS


class ReleasedParameterError(RuntimeError):
    """A forward used a ZeRO-3 parameter whose unit was not gathered."""


class _Probe(TorchFunctionMode):
    def __init__(self, guard: "ReleasedParamGuard") -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_metadata(func):
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, nn.Parameter) and self.guard.is_released(t):
                    self.guard.raise_released(t, func)
        return func(*args, **kwargs)


class ReleasedParamGuard:
    def __init__(self, partitioner) -> None:
        self.part = part = partitioner
        root = part.module
        self.param_names = {id(p): n for n, p in root.named_parameters()}
        self.module_names = {id(m): n for n, m in root.named_modules()}
        self.handles: list[Any] = []
        self._trigger: dict[int, nn.Module] = {}  # unit index -> module that gathered it on demand
        self._warned: set[int] = set()
        for m in root.modules():
            units = {part.unit_of[id(p)].index: part.unit_of[id(p)] for p in m.parameters(recurse=False)
                     if id(p) in part.unit_of}
            outside = [u for u in units.values() if u is not part.root and u.module is not m]
            if outside:
                self.handles.append(m.register_forward_pre_hook(self._make_pre(outside)))
                self.handles.append(m.register_forward_hook(self._make_post(outside), always_call=True))
        # the probe: every module, until a training forward's backward has ended and an eval forward ran
        self._probe_handles = []
        for m in root.modules():
            self._probe_handles.append(m.register_forward_pre_hook(self._probe_enter))
            self._probe_handles.append(m.register_forward_hook(self._probe_exit, always_call=True))
        self._depth = 0
        self._stack: list[nn.Module] = []
        self._mode = None
        self._eval_probed = False
        self.eval_only = False  # an engine without optimizer: the first evaluation forward ends the probe

    # -- on demand ----------------------------------------------------------------------------------
    def _make_pre(self, units):
        def hook(module, _args):
            if self.part._gathered_depth:
                return
            for u in units:
                if u.gathered or u.index in self._trigger:
                    continue
                if u.index not in self._warned:
                    self._warned.add(u.index)
                    warnings.warn(
                        f"ZeRO-3 unit '{u.name}' was gathered on demand for '{self.module_names.get(id(module))}' "
                        f"({type(module).__name__}), which ran outside the unit's own forward: one all-gather per "
                        f"such call. Name the modules that run as units instead, e.g. "
                        f"unit_classes=['{type(module).__name__}'].", stacklevel=2)
                self._trigger[u.index] = module
                self.part.gather(u)

        return hook

    def _make_post(self, units):
        def hook(module, _args, output):
            for u in units:
                if self._trigger.get(u.index) is module:
                    del self._trigger[u.index]
                    self.part._make_post_forward(u)(module, _args, output)

        return hook

    # -- probe --------------------------------------------------------------------------------------
    def _probing(self, module: nn.Module) -> bool:
        return bool(self._probe_handles) and (module.training or not self._eval_probed)

    def _probe_enter(self, module, _args) -> None:
        if self._depth == 0 and not self._probing(module):
            return
        if self._depth == 0:
            self._mode = _Probe(self)
            self._mode.__enter__()
            self._top_training = module.training
        self._depth += 1
        self._stack.append(module)

    def _probe_exit(self, module, _args, _output) -> None:
        if self._depth == 0 or not self._stack or self._stack[-1] is not module:
            return
        self._stack.pop()
        self._depth -= 1
        if self._depth == 0:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
            if not self._top_training:
                self._eval_probed = True
                if self.eval_only:
                    self.end_probe()

    def end_probe(self) -> None:
        """After the first backward: the structure has been checked."""
        if self._depth:
            return
        for h in self._probe_handles:
            h.remove()
        self._probe_handles.clear()

    def is_released(self, p: nn.Parameter) -> bool:
        u = self.part.unit_of.get(id(p))
        return (u is not None and not u.gathered and not self.part._gathered_depth and p.numel() > 0
                and p.untyped_storage().nbytes() == 0)

    def raise_released(self, p: nn.Parameter, func) -> None:
        u = self.part.unit_of[id(p)]
        user = self._stack[-1] if self._stack else self.part.module
        uname = self.module_names.get(id(user)) or "<root>"
        fname = getattr(func, "__name__", str(func))
        if user is not self.part.module and any(m is u.module for m in user.modules()):
            fix = f"unit_classes=['{type(user).__name__}'] (one unit holding both)"
        else:  # the reader is the root or beside the unit: leave the unit to the always-gathered root
            others = [x.name for x in self.part.units[:-1] if x is not u]
            shown = ", ".join(repr(n) for n in others[:4]) + (", ..." if len(others) > 4 else "")
            fix = (f"unit_classes=[{shown}] (every unit but '{u.name}', whose parameters then stay in the "
                   "always-gathered root unit)")
        raise ReleasedParameterError(
            f"ZeRO-3: parameter '{self.param_names.get(id(p), '?')}' of unit '{u.name}' was used by {fname}() in "
            f"the forward of '{uname}' ({type(user).__name__}) while its unit was released: it is read there "
            f"without the forward of '{u.name}' running, so it was never gathered. Fix: {fix}, or call the "
            "owning module instead of reading its parameter."
        )

    def remove(self) -> None:
        for h in self.handles + self._probe_handles:
            h.remove()
        self.handles.clear()
        self._probe_handles.clear()
