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

One model, two uses: :func:`rank_model_states` is what a rank holds, given how many elements of
parameters and gradients it really keeps. The floor (:func:`model_state_floor`) calls it with the exact
Psi / N of the table; the estimator (``tools/estimate.py``) with the per-parameter padding of the flat
shards, frozen parameters and stage 1 without accumulation -- so the two agree by construction.
Measurement (:func:`measure_model_states`) counts real tensor bytes (no allocator guesses), so tests can
compare it with both exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Union

from ..plan import ShardingPlan
from ..layout.tensor_parallel import local


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
    raise ValueError(f"Unknown optimizer {name!r} for the memory estimate. Allowed: adam, adamw, nadam, radam, "
                     f"adamax, adadelta (8 bytes of state per parameter), sgd_momentum, rmsprop, adagrad (4), sgd (0).")


def rank_model_states(
    stage: int, world_size: int, mixed: bool, numel: float, trainable: Optional[float] = None,
    state_bytes: int = 8, offload_optimizer: Union[bool, str] = False, offload_params: Union[bool, str] = False,
    full_grads: Optional[bool] = None, param_shard: Optional[float] = None, grad_shard: Optional[float] = None,
) -> dict[str, float]:
    """Bytes of params, grads, master and optimizer state one rank holds, and how many are on the host.

    ``numel`` parameters, ``trainable`` of them with a master and optimizer state (default: all). Stage 3
    keeps ``param_shard`` elements of parameters and stages 2-3 ``grad_shard`` of gradients (defaults: the
    exact ``numel / N`` and ``trainable / N``; the engine's flat shards pad each parameter to a multiple of
    N). ``full_grads``: full-size gradients (default: stages 0-1; stage 1 reducing during backward, without
    accumulation, holds shards like stage 2). ``offload_params`` (stage 3): the parameter shards live on the
    host, and in fp32 such a shard *is* the master (no separate copy); ``offload_params="nvme"``: in the
    scratch files, with a separate fp32 master (the shard's memory is empty between uses).
    """
    n = world_size
    plan = ShardingPlan.for_stage(stage)  # [Note: sharding plan]
    trainable = numel if trainable is None else trainable
    p = 2 if mixed else 4
    full_grads = not plan.shards_grads if full_grads is None else full_grads
    if not plan.shards_params:
        params = p * numel
    else:
        params = p * numel / n if param_shard is None else p * param_shard
    if full_grads:
        grads = p * trainable
    else:
        grads = p * trainable / n if grad_shard is None else p * grad_shard
    div = n if plan.shards_optimizer_state else 1
    disk_params = plan.shards_params and offload_params == "nvme"
    host_params = plan.shards_params and bool(offload_params) and not disk_params
    # a separate fp32 master: mixed precision, or offloaded (the host copy), unless it is the host shard;
    # parameter shards on NVMe never hold a master
    separate_master = ((mixed or offload_optimizer) and not (host_params and not mixed)) or disk_params
    master = 4 * trainable / div if separate_master else 0.0
    opt = state_bytes * trainable / div
    # offload_optimizer="nvme": master + state in the scratch files (the step's ring is not a model state)
    on_disk = offload_optimizer == "nvme"
    host = (master + opt if offload_optimizer and not on_disk else 0.0) + (params if host_params else 0.0)
    nvme = (master + opt if on_disk else 0.0) + (params if disk_params else 0.0)
    total = params + grads + master + opt
    return {"params": params, "grads": grads, "master": master, "optimizer_state": opt,
            "model_states": total, "host": host, "nvme": nvme, "device": total - host - nvme}


def model_state_floor(
    stage: int, numel: int, world_size: int, mixed: bool, state_bytes: int = 8, offload_optimizer: bool = False,
    offload_params: bool = False,
) -> dict[str, float]:
    """Device and host bytes per rank for params, grads, master and optimizer state (the ZeRO floor):
    :func:`rank_model_states` with the exact Psi / N of the table, every parameter trainable."""
    r = rank_model_states(stage, world_size, mixed, numel, state_bytes=state_bytes,
                          offload_optimizer=offload_optimizer, offload_params=offload_params)
    return {"params": r["params"], "grads": r["grads"], "optimizer": r["master"] + r["optimizer_state"],
            "device": r["device"], "host": r["host"], "nvme": r["nvme"]}


def measure_model_states(params, shardeds, reducer=None, partitioner=None, offload_optimizer: bool = False,
                         offload_params: bool = False, frozen=()) -> "MemoryReport":
    """The tensor bytes one rank holds now: ``params`` (managed parameters) and ``frozen`` (the module's
    parameters no optimizer manages: LoRA's base, whole and replicated on every rank at stages 0-2, like
    DDP's), the ShardedOptimizers' masters and state, the reducer's gradient shards, stage 3's unit shards
    (frozen parameters are partitioned like the others) and gathered units."""
    def nbytes(ts):  # a DTensor (tensor parallel) counts its local piece: what this rank holds
        return sum(local(t).numel() * t.element_size() for t in ts if t is not None)

    part = partitioner
    r = MemoryReport(
        params=part.shard_bytes() + part.gathered_bytes() if part is not None else nbytes(params) + nbytes(frozen),
        grads=nbytes(p.grad for p in params),
        grad_shards=nbytes(reducer.grad_shards) if reducer is not None else 0,
        master=sum(s.master_bytes() for s in shardeds),
        optimizer_state=sum(s.state_bytes() for s in shardeds),
    )
    if offload_optimizer:  # NVMe: what is only in the scratch files now is on disk, not in host memory
        r.nvme = sum(s.nvme_bytes() for s in shardeds)
        r.ring = sum(s.ring_bytes() for s in shardeds)
        r.host = r.master + r.optimizer_state - r.nvme
    if part is not None and offload_params:  # NVMe: the shards only in the file now are on disk, the ring aside
        r.host += part.shard_bytes() - part.nvme_shard_bytes()
        r.nvme += part.nvme_shard_bytes()
        r.ring += part.nvme.ring_bytes if part.nvme is not None else 0
    return r


@dataclass
class MemoryReport:
    """Tensor bytes one rank holds right now, by kind."""

    params: int = 0  # every parameter (frozen too) as this rank holds it (full, or shards in stage 3)
    grads: int = 0  # full-size gradients in ``param.grad``
    grad_shards: int = 0  # reduced gradient shards (stages 1-3)
    master: int = 0  # fp32 master copies that do not alias the parameters
    optimizer_state: int = 0  # tensors in optimizer.state
    host: int = 0  # bytes of the above that live in CPU memory while compute is on an accelerator
    nvme: int = 0  # bytes of the above only in NVMe scratch files now (offload_optimizer="nvme")
    ring: int = 0  # host buffers the NVMe step streams those through (not model states: the bound on them)
    comm_buffers: int = 0  # flat collective buffers kept across steps (buffer_pool.py; not model states)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.grad_shards + self.master + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["model_states"] = self.model_states
        return d
