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
Psi / N of the table; the estimator (``tools/estimate_states.py``) with the per-parameter padding of the flat
shards, frozen parameters and stage 1 without accumulation -- so the two agree by construction.
Measurement (``memory_report.measure_model_states``) counts real tensor bytes (no allocator guesses), so tests can
compare it with both exactly.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Union

from ..placement.nvme import OffloadDevice
from ..placement.placement import Location, Placement
from ..plan import ShardingPlan


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


def _own_master(placement: Placement) -> bool:
    """Whether an fp32 parameter (stage 3: its shard) can serve as its own master, by where it lives: on the
    device when the step runs there, in host memory always (the step or a CPU run reads it there), in a
    scratch file never (its memory is empty between uses)."""
    return {Location.DEVICE: not placement.steps_on_host, Location.HOST: True,
            Location.NVME: False}[placement.param_shards]


def rank_model_states(
    plan: ShardingPlan, world_size: int, mixed: bool, numel: float, trainable: Optional[float] = None,
    state_bytes: int = 8, full_grads: Optional[bool] = None, param_shard: Optional[float] = None,
    grad_shard: Optional[float] = None,
) -> dict[str, float]:
    """Bytes of params, grads, master and optimizer state one rank holds under ``plan``, and how many of them
    are on the host and in NVMe scratch files (``plan.placement`` books them, [Note: placement]).

    ``numel`` parameters, ``trainable`` of them with a master and optimizer state (default: all). Sharded
    parameters keep ``param_shard`` elements and sharded gradients ``grad_shard`` (defaults: the exact
    ``numel / N`` and ``trainable / N``; the engine's flat shards pad each parameter to a multiple of N).
    ``full_grads``: full-size gradients (default: unless the plan shards them; stage 1 reducing during
    backward, without accumulation, holds shards like stage 2). An fp32 parameter shard in host memory
    *is* its master (no separate copy); one in a scratch file never is.
    """
    n = world_size
    trainable = numel if trainable is None else trainable
    p = 2 if mixed else 4
    full_grads = not plan.shards_grads if full_grads is None else full_grads
    params = p * ((numel / n if param_shard is None else param_shard) if plan.shards_params else numel)
    grads = p * trainable if full_grads else p * (trainable / n if grad_shard is None else grad_shard)
    div = n if plan.shards_optimizer_state else 1
    separate_master = mixed or plan.separate_masters or not _own_master(plan.placement)
    master = 4 * trainable / div if separate_master else 0.0
    opt = state_bytes * trainable / div
    # whole parameters (no shards) are on the device: the placement has them there
    booked = plan.placement.book(param_shards=params, optimizer_states=master + opt)
    host, nvme = booked[Location.HOST], booked[Location.NVME]
    total = params + grads + master + opt
    return {"params": params, "grads": grads, "master": master, "optimizer_state": opt,
            "model_states": total, "host": host, "nvme": nvme, "device": total - host - nvme}


def model_state_floor(
    stage: int, numel: int, world_size: int, mixed: bool, state_bytes: int = 8,
    offload_optimizer: Union[bool, str] = False, offload_params: Union[bool, str] = False,
) -> dict[str, float]:
    """Device and host bytes per rank for params, grads, master and optimizer state (the ZeRO floor):
    :func:`rank_model_states` with the exact Psi / N of the table, every parameter trainable, for the plan
    of ``stage`` with the offload knobs' placement (``offload_params``: stage 3 only, as ``ZeroConfig``)."""
    knobs = SimpleNamespace(**{k: OffloadDevice.parse(v, k).knob_value for k, v in (
        ("offload_optimizer", offload_optimizer), ("offload_params", offload_params))})
    shards_params = ShardingPlan.for_stage(stage).shards_params
    # the knobs' placement by ZeroConfig's rule: parameter shards only where the plan has them
    plan = ShardingPlan.for_stage(stage, placement=Placement.of(knobs, shards_params=shards_params))
    r = rank_model_states(plan, world_size, mixed, numel, state_bytes=state_bytes)
    return {"params": r["params"], "grads": r["grads"], "optimizer": r["master"] + r["optimizer_state"],
            "device": r["device"], "host": r["host"], "nvme": r["nvme"]}
