"""The host step's kernel: torch's fused (or foreach) CPU kernel swapped into an optimizer whose masters and
state live on the host (a state store with ``steps_on_host``), unless ``offload_kernel="user"``.

torch's fused implementations run on the CPU: the host step swaps them in (``offload_kernel="fused"``). They
are not bit-identical to the default (for-loop) kernel DDP runs: about 1 ulp per step, which Adam's
normalization turns into a full +-lr update where the true gradient is zero (a bias whose gradient cancels);
``offload_kernel="user"`` keeps the user's kernel for DDP-exact runs.
"""

from __future__ import annotations

from typing import Optional

import torch

_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def use_fused_cpu_kernels(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, _FUSED_ON_CPU):
        for group in optimizer.param_groups:
            if "foreach" in group and group.get("foreach") is None:
                group["foreach"] = True
        return
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            continue
        group["fused"], group["foreach"] = True, False
    optimizer.defaults.update(fused=True, foreach=False)


def uses_fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(g.get("fused") for g in optimizer.param_groups)


def kernel_note(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """What a swapped host step runs instead of the user's kernel; None if the kernel is the user's own."""
    name = type(optimizer).__name__
    if uses_fused(optimizer):
        return f"{name} steps with torch's fused CPU kernel (fused=True)"
    if any(g.get("foreach") for g in optimizer.param_groups):
        return f"{name} steps with torch's foreach kernel (foreach=True)"
    return None


def kernel_swap_line(shardeds: list) -> Optional[str]:
    """The setup line of an offloaded engine whose step does not run the user's own kernel."""
    notes = [n for n in (s.kernel_note() for s in shardeds) if n is not None]
    if not notes:
        return None
    return (f"offload_optimizer: {'; '.join(notes)} instead of the default kernel DDP runs: faster on the "
            "CPU, but not bit-identical to DDP (about 1 ulp per step; Adam turns that into +-lr where the true "
            "gradient is zero). offload_kernel='user' keeps your optimizer's own kernel (DDP-exact).")
