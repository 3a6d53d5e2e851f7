"""Memory accounting: the per-stage model-state floors and the bytes a rank really holds.

Design note
-----------
ZeRO's promise is a formula (Rajbhandari et al. 2020; docs/ARCHITECTURE.md, "Memory floors"): with Psi
parameters, N ranks and K bytes of optimizer state per parameter, a rank holds

    mixed precision (2-byte params/grads, fp32 master)   fp32 (the parameter is its own master)
    stage 0: (2 + 2 + 4 + K) Psi                          (4 + 4 + K) Psi
    stage 1: (2 + 2) Psi + (4 + K) Psi / N                (4 + 4) Psi + K Psi / N
    stage 2: 2 Psi + (2 + 4 + K) Psi / N                  4 Psi + (4 + K) Psi / N
    stage 3: (2 + 2 + 4 + K) Psi / N                      (4 + 4 + K) Psi / N

(K = 8 for Adam's two moments, giving the paper's 16 Psi, 4 Psi + 12 Psi / N, ...). The floors count
*device* bytes; with the optimizer offloaded, master (always a separate fp32 copy then) and optimizer
state move to host memory.
Measurement counts real tensor bytes (no allocator guesses), so tests can compare them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


def optimizer_state_bytes_per_param(name: str) -> int:
    """Bytes of fp32 optimizer state per parameter element (K without the master copy)."""
    name = name.lower()
    if name in ("adam", "adamw", "nadam", "radam", "adamax"):
        return 8
    if name in ("sgd_momentum", "rmsprop", "adagrad"):
        return 4
    if name in ("adadelta",):
        return 8
    if name == "sgd":
        return 0
    raise ValueError(f"Unknown optimizer {name!r} for the memory estimate.")


def model_state_floor(
    stage: int, numel: int, world_size: int, mixed: bool, state_bytes: int = 8, offload_optimizer: bool = False
) -> dict[str, float]:
    """Device and host bytes per rank for params, grads, master and optimizer state (the ZeRO floor)."""
    n = world_size
    p16 = 2 if mixed else 4
    master = 4 if (mixed or offload_optimizer) else 0  # an offloaded master is always a separate fp32 copy
    param = p16 * numel / (n if stage >= 3 else 1)
    grad = p16 * numel / (n if stage >= 2 else 1)
    opt = (master + state_bytes) * numel / (n if stage >= 1 else 1)
    device = param + grad + (0 if offload_optimizer else opt)
    host = opt if offload_optimizer else 0.0
    return {"params": param, "grads": grad, "optimizer": opt, "device": device, "host": host}


@dataclass
class MemoryReport:
    """Tensor bytes one rank holds right now, by kind."""

    params: int = 0  # trainable parameters as the module sees them (full, or shards in stage 3)
    grads: int = 0  # full-size gradients in ``param.grad``
    grad_shards: int = 0  # reduced gradient shards (stages 1-3)
    master: int = 0  # fp32 master copies that do not alias the parameters
    optimizer_state: int = 0  # tensors in optimizer.state
    host: int = 0  # bytes of the above that live in CPU memory while compute is on an accelerator

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.grad_shards + self.master + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["model_states"] = self.model_states
        return d
