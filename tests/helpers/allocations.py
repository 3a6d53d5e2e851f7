"""Counting tensor allocations with a ``TorchDispatchMode`` (bench/allocations.py, tests/test_buffer_pool.py)."""

from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_ENGINE = os.path.join("lightning_zero", "engine")  # not the launcher or the adapters that call into it
_STEP_CALL = "optimizer.step("  # the engine's call of the user's optimizer (a state store's step): its allocations are the optimizer's


class AllocationCounter(TorchDispatchMode):
    """Every aten output with a storage of its own (not a view, none of the inputs') is one allocation;
    those whose innermost ``lightning_zero/engine`` frame is engine code, not the user's optimizer called from it,
    are also counted by call site in ``engine`` ("path:line op")."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.nbytes, self.engine = 0, 0, collections.Counter()
        self.sizes: list[int] = []  # bytes of each allocation, in order
        self.copies: collections.Counter = collections.Counter()  # engine "path:line" -> bytes copy_ wrote there

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default:
            ours = [f for f in traceback.extract_stack()[:-2] if _ENGINE in f.filename]
            if ours:
                dst = args[0]
                self.copies[f"{os.path.relpath(ours[-1].filename)}:{ours[-1].lineno}"] += dst.numel() * dst.element_size()
        inputs = {id(a.untyped_storage()) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and not t._is_view() and t.untyped_storage().nbytes()
                    and id(t.untyped_storage()) not in inputs):
                self.count += 1
                self.nbytes += t.untyped_storage().nbytes()
                self.sizes.append(t.untyped_storage().nbytes())
                ours = [f for f in traceback.extract_stack()[:-2] if _ENGINE in f.filename]
                if ours and _STEP_CALL not in (ours[-1].line or ""):
                    self.engine[f"{os.path.relpath(ours[-1].filename)}:{ours[-1].lineno} {func}"] += 1
        return out
