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

[Note: low-precision states in the memory model]
The plan's ``optimizer_state_dtype`` / ``master_dtype`` ("bf16": ``ZeroConfig``'s knobs) change two terms of the
table, per trainable element of the rank's share:

    optimizer state    K (fp32)  ->  K / 2 (bf16: Adam's two moments 8 -> 4, SGD's momentum 4 -> 2)
    master             4 (fp32, or 0 where the fp32 parameter is its own master)  ->
                       2 (bf16: the Kahan compensation term alone; the bf16 master *is* the bf16 parameter
                          slice / stage-3 unit shard the step runs beside, on the device), or
                       2 + 2 (bf16 master + compensation, a copy of their own where the step runs on the host:
                          offload_optimizer cpu or nvme; under nvme the master is in the scratch file with the
                          state, the compensation in host memory)

Gradients keep their bytes (the masters' ``.grad`` is the fp32 reduced shard). A bf16 master needs bf16 compute.
Mixed precision with Adam: 16 -> 12 bytes per parameter with bf16 moments, 10 with bf16 masters too (stage 0;
every stage's sharded terms shrink alike). The step widens one bucket's slice at a time to fp32 -- the moments
(K per element) and the master (4) -- runs the user's optimizer and rounds them back:
:func:`low_precision_step_bytes` is that transient, where the step runs.
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


def state_bytes_per_element(plan: ShardingPlan, state_bytes: int) -> float:
    """Bytes of the optimizer's per-element state between steps: ``state_bytes`` (K, fp32) halved when the plan
    keeps it in bf16 ([Note: low-precision states in the memory model])."""
    return state_bytes / 2 if plan.optimizer_state_dtype == "bf16" else float(state_bytes)


def master_bytes_per_element(plan: ShardingPlan, mixed: bool) -> float:
    """Bytes of the master per trainable element of the rank's share ([Note: low-precision states in the memory
    model]): fp32 4, or 0 where the fp32 parameter is its own master; bf16 the 2-byte compensation, plus its own
    2-byte copy of the master where the step runs on the host (or qwZ rounds the published parameters)."""
    if plan.master_dtype == "bf16":
        if not mixed:
            raise ValueError("master_dtype='bf16' needs bf16 compute (precision 'bf16-mixed' / 'bf16-true'): in "
                             "fp32 training the fp32 parameter is its own master already. Allowed: master_dtype="
                             "'bf16' with bf16 parameters, or master_dtype='fp32'.")
        # the bf16 slice / unit shard is the master where the step reads it in place: beside device states
        on_device = not plan.shards_params or plan.placement.param_shards is Location.DEVICE
        aliases_param = on_device and not plan.placement.steps_on_host and not plan.separate_masters
        return 2.0 if aliases_param else 4.0
    separate_master = mixed or plan.separate_masters or not _own_master(plan.placement)
    return 4.0 if separate_master else 0.0


def low_precision_step_bytes(plan: ShardingPlan, slice_numel: float, state_bytes: int) -> float:
    """The step's transient under bf16 states or masters: one bucket's slice (``slice_numel`` elements) widened
    to fp32 while that bucket steps -- the optimizer state (K bytes per element) and the master (4) of whichever
    the plan keeps in bf16; 0 when both are fp32. It lives where the step runs (``plan.placement.steps_on_host``)."""
    per_element = (state_bytes if plan.optimizer_state_dtype == "bf16" else 0) \
        + (4 if plan.master_dtype == "bf16" else 0)
    return float(per_element * slice_numel)


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
    *is* its master (no separate copy); one in a scratch file never is. The plan's ``optimizer_state_dtype`` /
    ``master_dtype`` set the state's and the master's bytes ([Note: low-precision states in the memory model]).
    """
    n = world_size
    trainable = numel if trainable is None else trainable
    p = 2 if mixed else 4
    full_grads = not plan.shards_grads if full_grads is None else full_grads
    params = p * ((numel / n if param_shard is None else param_shard) if plan.shards_params else numel)
    grads = p * trainable if full_grads else p * (trainable / n if grad_shard is None else grad_shard)
    div = n if plan.shards_optimizer_state else 1
    master = master_bytes_per_element(plan, mixed) * trainable / div
    opt = state_bytes_per_element(plan, state_bytes) * trainable / div
    compensation = (2.0 if plan.master_dtype == "bf16" else 0.0) * trainable / div  # part of ``master``
    # whole parameters (no shards) are on the device: the placement has them there
    booked = plan.placement.book(param_shards=params, optimizer_states=master - compensation + opt)
    # a bf16 master's compensation term stays in the memory the step reads, where its reduced gradients are (the
    # device, or host memory for host and NVMe states: the scratch files stream masters and state, not it)
    booked[plan.placement.grad_shards] += compensation
    host, nvme = booked[Location.HOST], booked[Location.NVME]
    total = params + grads + master + opt
    return {"params": params, "grads": grads, "master": master, "optimizer_state": opt,
            "model_states": total, "host": host, "nvme": nvme, "device": total - host - nvme}


def model_state_floor(
    stage: int, numel: int, world_size: int, mixed: bool, state_bytes: int = 8,
    offload_optimizer: Union[bool, str] = False, offload_params: Union[bool, str] = False,
    optimizer_state_dtype: str = "fp32", master_dtype: str = "fp32",
) -> dict[str, float]:
    """Device and host bytes per rank for params, grads, master and optimizer state (the ZeRO floor):
    :func:`rank_model_states` with the exact Psi / N of the table, every parameter trainable, for the plan
    of ``stage`` with the offload knobs' placement (``offload_params``: stage 3 only, as ``ZeroConfig``) and
    the state dtypes ("fp32" | "bf16", as ``ZeroConfig`` normalizes them)."""
    for knob, value in (("optimizer_state_dtype", optimizer_state_dtype), ("master_dtype", master_dtype)):
        if value not in ("fp32", "bf16"):  # ZeroConfig's spellings, as it normalizes them
            raise ValueError(f"{knob} must be 'fp32' (default) or 'bf16'; got {value!r}.")
    knobs = SimpleNamespace(**{k: OffloadDevice.parse(v, k).knob_value for k, v in (
        ("offload_optimizer", offload_optimizer), ("offload_params", offload_params))})
    shards_params = ShardingPlan.for_stage(stage).shards_params
    # the knobs' placement by ZeroConfig's rule: parameter shards only where the plan has them
    plan = ShardingPlan.for_stage(stage, placement=Placement.of(knobs, shards_params=shards_params),
                                  optimizer_state_dtype=optimizer_state_dtype, master_dtype=master_dtype)
    r = rank_model_states(plan, world_size, mixed, numel, state_bytes=state_bytes)
    return {"params": r["params"], "grads": r["grads"], "optimizer": r["master"] + r["optimizer_state"],
            "device": r["device"], "host": r["host"], "nvme": r["nvme"]}
