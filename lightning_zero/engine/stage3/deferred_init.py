"""Deferred initialization (stage 3): build a model bigger than one rank without ever holding it whole.

Design note
-----------
The model is constructed on the ``meta`` device (no memory; Lightning's ``configure_model`` under
``ZeroStrategy(stage=3)``, or ``with torch.device("meta")``). The engine then walks the modules in
registration order -- the order eager construction initialized them -- and for each module allocates
its own parameters on the real device and calls its ``reset_parameters()``. With the same seed this
consumes the random stream exactly as eager ``__init__`` did, so the values equal the eager model's.
As soon as the walk leaves a unit's subtree, the unit is broadcast from rank 0 (ranks need not share an
RNG state) and cut down to this rank's shard; only the root's (small) parameters and one unit are ever
whole at the same time.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .. import collectives as C


def has_meta_params(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers())


@torch.no_grad()
def materialize(root: nn.Module, unit_modules: list[nn.Module], device: torch.device, group,
                on_unit_done: Callable[[nn.Module], None]) -> None:
    """Initialize ``root`` module by module; call ``on_unit_done(unit_module)`` after each unit subtree."""
    unit_ids = {id(m) for m in unit_modules}
    missing = [
        name for name, m in root.named_modules()
        if any(p.is_meta for p in m.parameters(recurse=False)) and not hasattr(m, "reset_parameters")
    ]
    if missing:
        raise ValueError(
            "Deferred (meta-device) initialization needs reset_parameters() on every module that owns "
            f"parameters; missing on: {', '.join(missing[:8])}. Build the model eagerly, or add reset_parameters()."
        )

    def visit(m: nn.Module) -> None:
        fresh = False
        for p in m.parameters(recurse=False):
            if p.is_meta:  # swap in real storage, keeping the Parameter object (units and hooks hold it)
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
                fresh = True
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)
                fresh = True
        if fresh and hasattr(m, "reset_parameters"):
            m.reset_parameters()
        for child in m.children():
            visit(child)
        if id(m) in unit_ids:
            flat = [p.data for p in m.parameters()] + [b for b in m.buffers()]
            for t in flat:
                C.broadcast(t, 0, group)
            on_unit_done(m)

    visit(root)
    rest = [p.data for p in root.parameters() if p.untyped_storage().nbytes() > 0]
    for t in rest + list(root.buffers()):
        C.broadcast(t, 0, group)


def compute_device(module: nn.Module) -> torch.device:
    """Where a (possibly meta) module computes: where its first real tensor is, else the current device."""
    for t in list(module.parameters()) + list(module.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
