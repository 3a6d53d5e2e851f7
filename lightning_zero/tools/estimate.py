"""Memory estimator: which ZeRO stage and offload setting fits a model, per rank, before running anything.

Design note
-----------
Three parts, each checked against a measurement (tests/test_estimate.py, docs/tuning.md):

* **Model states** (params, grads, fp32 master, optimizer state) follow what :class:`ZeroEngine` really
  allocates: the engine's one model (``engine/memory/floors.py`` ``rank_model_states``, whose exact Psi / N case
  is the model-state floors of docs/ARCHITECTURE.md) with per-parameter shards padded to a multiple of
  the world size, frozen parameters without master or state, and a master aliasing its source when
  nothing forces a copy (fp32 stages 1-2; fp32 stage 3 with offloaded params, whose host shard *is* the
  master). They match ``engine.memory_report()`` within padding.
* **Buffers** the engine holds on top (on an accelerator; gloo on CPU keeps every pending bucket until
  the end of backward): stages 0-2, two reduction buckets in flight (stage 2 also the full gradients of
  the bucket being filled); stage 3, the root unit plus the current and the prefetched unit, the current
  unit's full gradients and its flat reduce-scatter buffer. At the optimizer step, stages 1-2 keep at most
  two bucket all-gathers in flight (activations are gone by then) -- every bucket's, with the publish
  overlapped with the next forward (``overlap_publish=True``), each freed as its forward runs.
* **Activations** of HF T5 (encoder-decoder) from the architecture, batch and sequence lengths: the
  tensors autograd saves, counted per op (see :func:`t5_activation_bytes`), calibrated against the
  saved-tensors-hook measurement of the benchmark harness. Any other model: that measurement itself, of
  one probe step, scaled linearly in the batch size (``estimate_activations.py``, ``activation_probe=``).

Peak device bytes = states + max(backward buffers + activations, step buffers). Counting activations and
full gradients together is conservative (backward frees activations as gradients appear).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from torch import nn

from ..engine.memory.floors import low_precision_step_bytes, optimizer_state_bytes_per_param
from ..engine.placement.placement import Location, Placement
from .estimate_knobs import check_estimate_knobs, check_state_dtypes
from .estimate_nvme import nvme_lines, nvme_optimizer_bytes, nvme_ring_bytes, nvme_step_bytes
from .estimate_states import (SETTING_PLANS, SETTINGS, Row, buffer_bytes, host_step_grads,  # noqa: F401
                              model_state_bytes, plan_state_bytes, step_slice_numel)
from .estimate_state_dtypes import state_dtype_lines, state_dtype_rows
from .estimate_whole_tensor import WHOLE_TENSOR, state_for
from .model_sizes import GiB, MiB, ModelInfo, gib, info_from_module, info_from_t5  # noqa: F401
from .t5_dims import (BYTE_VOCAB, RECIPE_VOCAB, T5_PRESETS, T5Dims, t5_activation_bytes,  # noqa: F401
                      t5_activation_memory, t5_dims, t5_dims_from_config)

PRECISIONS = {"32-true": False, "32": False, "bf16-mixed": True, "bf16": True, "16-mixed": True, "16": True}
# where the optimizer's states live -> the table's "offload" column
OFFLOAD_WORDS = {Location.DEVICE: "no", Location.HOST: "yes", Location.NVME: "nvme"}


@dataclass
class Estimate:
    info: ModelInfo
    world_size: int
    num_nodes: int
    precision: str
    optimizer: str
    bucket_mb: float
    grad_accumulation: int
    rows: list[Row]
    batch: Optional[tuple[int, int, int]] = None
    activations: Optional[float] = None
    device_memory: Optional[float] = None  # bytes per device
    cpu_memory: Optional[float] = None  # bytes per node
    shard_group_size: Optional[int] = None  # hybrid sharding: ranks that shard the states (None: all)
    activation_checkpointing: bool = False
    offload_activations: bool = False
    activation_parts: Optional[dict] = None  # t5_activation_memory: device, host, saved, recompute
    tensor_parallel: Optional[object] = None  # estimate_tp.TensorParallelSplit (tensor_parallel_size only)
    activation_probe: Optional[object] = None  # estimate_activations.ActivationProbe (measured activations)
    nvme_step_time: float = 1.0  # seconds per optimizer step the NVMe bandwidth line is computed for
    whole_tensor: Optional[object] = None  # estimate_whole_tensor.WholeTensorState (optimizer muon / adafactor)
    optimizer_state_dtype: str = "fp32"  # the rows' plans: "fp32" | "bf16" ([Note: low-precision states ...])
    master_dtype: str = "fp32"
    state_dtype_rows: list = dataclasses.field(default_factory=list)  # estimate_state_dtypes.StateDtypeRow

    @property
    def ranks_per_node(self) -> int:
        return math.ceil(self.world_size / self.num_nodes)

    def row(self, setting: str) -> Row:
        return next(r for r in self.rows if r.setting == setting)

    def fitting(self) -> list[str]:
        return [r.setting for r in self.rows if r.fits]

    def __str__(self) -> str:
        return format_estimate(self)


ModelLike = Union[nn.Module, int, str, T5Dims, ModelInfo]


def estimate_model_states(
    model: ModelLike,
    world_size: int = 1,
    num_nodes: int = 1,
    precision: str = "32-true",
    optimizer: str = "adamw",
    bucket_mb: float = 25.0,
    grad_accumulation: int = 1,
    batch_size: Optional[int] = None,
    src_len: int = 512,
    tgt_len: int = 128,
    device_memory_gb: Optional[float] = None,
    cpu_memory_gb: Optional[float] = None,
    settings: Optional[Sequence[str]] = None,
    unit_classes: Optional[Sequence] = None,
    vocab_size: Optional[int] = RECIPE_VOCAB,
    shard_group_size: Optional[int] = None,
    activation_checkpointing: bool = False,
    offload_activations: bool = False,
    tensor_parallel_size: Optional[int] = None,
    tensor_parallel_plan: Optional[dict] = None,
    activation_probe: Optional[object] = None,
    nvme_step_time: float = 1.0,
    whole_tensor: Optional[object] = None,
    optimizer_state_dtype: str = "fp32",
    master_dtype: str = "fp32",
) -> Estimate:
    """Per-rank device bytes and per-node CPU RAM for every ZeRO stage x offload setting.

    ``model``: an ``nn.Module`` (meta-device is fine), a parameter count, a recipe preset name
    ("t5_tiny" ... "t5_3b", built with ``vocab_size``: the recipe's subword vocabulary by default, None for
    the preset's own), or :class:`T5Dims`. ``batch_size`` (per rank) with ``src_len``/``tgt_len`` adds
    the T5 activation estimate (T5 models only). ``grad_accumulation`` > 1: stage 1 holds full gradients
    between micro-batches. ``device_memory_gb``/``cpu_memory_gb`` are GiB (2**30).
    ``shard_group_size`` (hybrid sharding, ZeroConfig.shard_group_size): stages 1-3 shard over K ranks, not
    the world (stage 2 mixed: 2 Psi + 14 Psi / K per rank); each row also keeps its K = world figure.
    ``activation_checkpointing`` (every T5Block, the ``"auto"`` policy) / ``offload_activations``: the
    activations as those strategy options leave them (offloaded bytes count as host memory).
    ``tensor_parallel_size`` (T) / ``tensor_parallel_plan``: each rank's local pieces, sharded over N / T
    data-parallel ranks; stages 0-2 (``estimate_tp.py``).
    ``activation_probe`` (:func:`~.estimate_activations.probe_activations`): with ``batch_size``, the
    activations of any model, measured at the probe's micro-batch and scaled linearly (instead of the T5
    formula; without checkpointing or offload, which the probe does not apply).
    ``nvme_step_time``: the step time (s) the ``*_offload_nvme`` rows' needed disk bandwidth is given for.
    ``optimizer`` "muon" / "adafactor" (whole-tensor: state by parameter shape, on owner ranks; [Note: whole-tensor
    state in the estimate]) needs a module or a T5; ``whole_tensor``: its state, already computed.
    ``optimizer_state_dtype`` / ``master_dtype`` ("fp32" | "bf16", ZeroConfig's knobs): the rows' optimizer state
    and masters between steps, and the step's fp32 slice on top ([Note: low-precision states in the memory model]);
    ``state_dtype_rows`` compares every setting at fp32 / bf16 moments / bf16 moments + masters.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}. Allowed: 32-true, bf16-mixed, 16-mixed.")
    settings = check_estimate_knobs(settings, list(SETTINGS.values()), world_size=world_size, num_nodes=num_nodes,
                                    bucket_mb=bucket_mb, grad_accumulation=grad_accumulation, batch_size=batch_size,
                                    src_len=src_len, tgt_len=tgt_len, device_memory_gb=device_memory_gb,
                                    cpu_memory_gb=cpu_memory_gb, vocab_size=vocab_size, nvme_step_time=nvme_step_time)
    mixed = PRECISIONS[precision]
    optimizer = optimizer.lower()
    dtypes = dict(zip(("optimizer_state_dtype", "master_dtype"), check_state_dtypes(
        optimizer_state_dtype, master_dtype, precision, optimizer in WHOLE_TENSOR)))
    k = None if optimizer in WHOLE_TENSOR else _state_bytes(optimizer)
    if isinstance(model, str):
        model = t5_dims(model, vocab_size=vocab_size)
    if isinstance(model, T5Dims):
        info = info_from_t5(model)
    elif isinstance(model, ModelInfo):
        info = model
    elif isinstance(model, nn.Module):
        cfg = getattr(model, "config", None)
        is_t5 = cfg is not None and getattr(cfg, "model_type", "") == "t5"
        info = info_from_module(model, unit_classes)  # T5 declares T5Block (_no_split_modules)
        if is_t5:
            info.t5 = t5_dims_from_config(cfg)
    elif isinstance(model, int) and model > 0:
        info = ModelInfo(model, model, largest_param=0, name="(parameter count)")
    else:
        raise ValueError(f"model must be an nn.Module, a positive parameter count, a preset name "
                         f"({', '.join(T5_PRESETS)}) or T5Dims; got {model!r}.")
    act, parts = None, None
    activations_at = Placement.from_knobs(offload_activations=offload_activations).activations
    if batch_size is not None:
        if activation_probe is not None:
            if activation_checkpointing or activations_at.off_device:
                raise ValueError("A measured activation probe runs without activation checkpointing or offload. "
                                 "Allowed: those options with a T5 model (the formula), or the probe without them.")
            act = float(activation_probe.at(batch_size))
            parts = {"device": act, "host": 0.0, "saved": act, "recompute": 0.0}
        elif info.t5 is None:
            raise ValueError("The activation estimate needs a T5 model (the formula) or a measured probe step: "
                             "activation_probe=probe_activations(module) (lightning_zero.tools.estimate_activations;"
                             " `estimate --module pkg.mod:factory --batch-size B` runs it).")
        else:
            parts = t5_activation_memory(info.t5, batch_size, src_len, tgt_len, mixed, activation_checkpointing,
                                         offload_activations)
            act = float(parts["device"])
    from ..engine.layout.dims import ParallelDims

    dims = ParallelDims(shard_group_size, tensor_parallel_size)
    dims.check(0)  # types and combinations (the table's stages are per row)
    dims.check_world(world_size)
    dp = world_size // (tensor_parallel_size or 1)  # the data-parallel ranks ZeRO shards over (K of them: hybrid)
    shards = shard_group_size or dp  # the ranks one parameter (TP: its local piece) is cut over
    split = None
    if tensor_parallel_size is not None:  # the local pieces, sharded over the data-parallel ranks
        from .estimate_tp import tensor_parallel_info

        split, info = tensor_parallel_info(model, info, tensor_parallel_size, world_size, shard_group_size,
                                           tensor_parallel_plan)
    whole = None
    if optimizer in WHOLE_TENSOR:  # [Note: whole-tensor state in the estimate]
        if split is not None:
            raise ValueError(f"optimizer {optimizer!r} updates whole tensors, which tensor parallelism splits: the "
                             "run refuses it. Allowed: an elementwise optimizer with tensor_parallel_size.")
        whole = whole_tensor or state_for(optimizer, model, info.t5)
    ranks_per_node = math.ceil(world_size / num_nodes)
    rows = []
    accumulating = grad_accumulation > 1
    for (stage, offload), name in SETTINGS.items():
        plan = dataclasses.replace(SETTING_PLANS[name], **dtypes)
        # tensor parallelism shards local pieces over the data-parallel ranks: not partitioned parameters
        if (settings is not None and name not in settings) or (split is not None and plan.shards_params):
            continue
        if whole is not None:
            if not whole.runs_under(plan):  # NVMe optimizer state: the run refuses it
                continue
            k = whole.k(plan.shards_optimizer_state, shards)
        st = plan_state_bytes(info, plan, shards, mixed, k, accumulating)
        buf = buffer_bytes(info, plan, shards, mixed, bucket_mb, accumulating)
        # the owners' whole masters + gradients, where the step runs (on the host when offloaded)
        transient = whole.transient(shards) if whole is not None and plan.shards_optimizer_state else 0.0
        # under bf16 states / masters the step widens one bucket's slice to fp32 where it runs
        transient += low_precision_step_bytes(plan, step_slice_numel(info, plan, shards, bucket_mb), k)
        on_host = plan.placement.steps_on_host
        buf["step"] += 0.0 if on_host else transient
        peak = st["device"] + max(buf["backward"] + (act or 0.0), buf["step"])
        ring = nvme_ring_bytes(info, plan, shards, k, bucket_mb)
        host = st["host"] + host_step_grads(plan, info.trainable, shards) + (parts["host"] if parts else 0) + ring
        host += transient if on_host else 0.0
        row = Row(name, stage, offload, st, buf, act, peak, host, host * ranks_per_node, nvme_per_rank=st["nvme"],
                  nvme_moved_per_step=nvme_step_bytes(info, st, plan, shards, mixed), nvme_ring=ring,
                  nvme_optimizer=nvme_optimizer_bytes(info, plan, shards, k), plan=plan)
        if shards != dp and plan.shards_optimizer_state:  # hybrid: the same row sharded over every DP rank
            row.states_world = plan_state_bytes(info, plan, dp, mixed, k, accumulating)
        if device_memory_gb is not None:
            row.fits = peak <= device_memory_gb * GiB and (cpu_memory_gb is None or row.cpu_ram_per_node <= cpu_memory_gb * GiB)
        rows.append(row)
    compare = [] if whole is not None else state_dtype_rows(
        info, {r.setting: r.plan for r in rows}, shards, mixed, precision.startswith("bf16"), k, accumulating,
        bucket_mb)
    return Estimate(info, world_size, num_nodes, precision, optimizer, bucket_mb, grad_accumulation, rows,
                    (batch_size, src_len, tgt_len) if batch_size is not None else None, act,
                    device_memory_gb * GiB if device_memory_gb is not None else None,
                    cpu_memory_gb * GiB if cpu_memory_gb is not None else None,
                    shard_group_size if shards != dp else None,
                    activation_checkpointing, offload_activations, parts, split, activation_probe, nvme_step_time,
                    whole, state_dtype_rows=compare, **dtypes)


def _state_bytes(optimizer: str) -> int:
    try:
        return optimizer_state_bytes_per_param(optimizer)
    except ValueError as e:
        raise ValueError(f"{e} Whole-tensor (state by parameter shape, on owner ranks): {', '.join(WHOLE_TENSOR)}.") \
            from None


def format_estimate(est: Estimate) -> str:
    info = est.info
    k = "by shape" if est.whole_tensor is not None else f"{optimizer_state_bytes_per_param(est.optimizer)} B/param"
    lines = [f"model: {info.name}, Psi = {info.numel:,} params ({info.trainable:,} trainable); {est.world_size} "
             f"rank(s) on {est.num_nodes} node(s); precision {est.precision}; optimizer {est.optimizer} "
             f"(K = {k}), optimizer_state_dtype {est.optimizer_state_dtype}, master_dtype {est.master_dtype}; bucket "
             f"{est.bucket_mb:g} MiB; gradient accumulation {est.grad_accumulation}"
             + ("" if est.grad_accumulation > 1 else " (stage 1 keeps full gradients only when accumulating)")]
    if est.batch is not None and est.activation_probe is not None:
        pr = est.activation_probe
        lines.append(f"activations: micro-batch {est.batch[0]} per rank = {gib(est.activations)} GiB on the device "
                     f"(measured: saved-tensor bytes of one training forward at micro-batch {pr.probe_batch}, "
                     f"{gib(pr.probe_bytes)} GiB from {pr.source}, scaled linearly in the batch size)")
    elif est.batch is not None:
        b, s, t = est.batch
        lines.append(f"activations: micro-batch {b} x (src {s}, tgt {t}) tokens per rank = {gib(est.activations)} "
                     f"GiB on the device (T5 formula, docs/tuning.md); {activation_line(est)}")
    elif info.t5 is None:
        lines.append("activations: not included (give --batch-size: the T5 formula, or one measured probe step "
                     "of a --module factory)")
    lines.append("GiB per rank unless noted (M = MiB); states = params + grads + master + optimizer state")
    cap = f" fits {est.device_memory / GiB:g} GiB |" if est.device_memory is not None else ""
    w = max([13] + [len(r.setting) for r in est.rows])
    head = (f"| {'setting':<{w}} | stage | offload | params | grads | master+optim | device states | buffers bwd/step "
            f"| activations | peak device | host/rank | CPU RAM/node | NVMe/rank |{cap}")
    lines += [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in est.rows:
        st = r.states
        params_dev = r.plan.placement.book(param_shards=st["params"])[Location.DEVICE]
        offload = OFFLOAD_WORDS[r.plan.placement.optimizer_states]
        mo = r.plan.placement.book(optimizer_states=st["master"] + st["optimizer_state"])[Location.DEVICE]
        fits = f" {'yes' if r.fits else 'NO':>{len(cap) - 3}} |" if cap else ""
        lines.append(
            f"| {r.setting:<{w}} | {r.stage:>5} | {offload:>7} | {gib(params_dev):>6} "
            f"| {gib(st['grads']):>5} | {gib(mo):>12} | {gib(st['device']):>13} "
            f"| {gib(r.buffers['backward']) + '/' + gib(r.buffers['step']):>16} | {gib(r.activations):>11} "
            f"| {gib(r.peak_device):>11} | {gib(r.host_per_rank):>9} | {gib(r.cpu_ram_per_node):>12} "
            f"| {gib(r.nvme_per_rank):>9} |{fits}")
    if est.whole_tensor is not None:
        lines.append(est.whole_tensor.line(est.shard_group_size or est.world_size))
    if est.tensor_parallel is not None:
        from .estimate_tp import tensor_parallel_line

        lines.append(tensor_parallel_line(est))
    if est.shard_group_size is not None:  # K splits the data-parallel ranks (N / T under tensor parallelism)
        dp = est.world_size // (est.tensor_parallel.size if est.tensor_parallel is not None else 1)
        lines.append(f"hybrid sharding: shard_group_size={est.shard_group_size} (states sharded over "
                     f"{est.shard_group_size} ranks, replicated {dp // est.shard_group_size}x); "
                     f"device states per rank at K={dp} vs K={est.shard_group_size}: " + ", ".join(
                         f"{r.setting} {gib(r.states_world['device'])} vs {gib(r.states['device'])}"
                         for r in est.rows if r.states_world is not None))
    lines.append(f"host/rank: offloaded states + fp32 gradient copies for the CPU step; CPU RAM/node = host/rank x "
                 f"{est.ranks_per_node} rank(s) per node (plus {gib(4 * info.numel * est.ranks_per_node)} GiB/node "
                 "while building an fp32 model eagerly; stage 3 with meta-device init avoids it).")
    lines += nvme_lines(est.rows, info, est.ranks_per_node, est.nvme_step_time, est.bucket_mb)
    lines += state_dtype_lines(est.state_dtype_rows, info, est.precision.startswith("bf16"),
                               est.optimizer if est.whole_tensor is not None else "")
    if est.device_memory is not None:
        ok = [r for r in est.rows if r.fits]
        no = [r for r in est.rows if not r.fits]
        cap_s = f"{est.device_memory / GiB:g} GiB per device"
        if est.cpu_memory is not None:
            cap_s += f" and {est.cpu_memory / GiB:g} GiB CPU RAM per node"
        if ok:
            lines.append(f"FITS in {cap_s}: " + ", ".join(f"{r.setting} ({gib(r.peak_device)})" for r in ok) + ".")
        else:
            lines.append(f"NOTHING FITS in {cap_s}" + (" at this micro-batch" if est.batch else "") + ".")
        if no:
            lines.append("Does not fit: " + ", ".join(f"{r.setting} (needs {gib(r.peak_device)})" for r in no) + ".")
        if not ok:
            lines.append(suggestion(est))
    return "\n".join(lines)


def activation_line(est: Estimate) -> str:
    """The activation options and what they leave where."""
    p = est.activation_parts or {}
    ck, off = est.activation_checkpointing, est.offload_activations
    if not (ck or off):
        return "activation_checkpointing off, offload_activations off"
    parts = [f"activation_checkpointing {'auto (every T5Block)' if ck else 'off'}",
             f"offload_activations {'on' if off else 'off'}"]
    if ck:
        parts.append(f"forward saves {gib(p.get('saved'))}, one block's recompute {gib(p.get('recompute'))}")
    if off:
        parts.append(f"{gib(p.get('host'))} GiB per rank in host memory")
    return ", ".join(parts)


def min_ranks_to_fit(est: Estimate, setting: str, max_ranks: int = 4096) -> Optional[int]:
    """Smallest power-of-two world size at which ``setting``'s peak fits ``est.device_memory`` (None: never)."""
    n = 1
    b = est.batch or (None, 512, 128)
    while n <= max_ranks:
        row = estimate_model_states(est.info, n, 1, est.precision, est.optimizer, est.bucket_mb,
                                    est.grad_accumulation, b[0], b[1], b[2], settings=[setting],
                                    activation_checkpointing=est.activation_checkpointing,
                                    offload_activations=est.offload_activations,
                                    activation_probe=est.activation_probe, whole_tensor=est.whole_tensor,
                                    optimizer_state_dtype=est.optimizer_state_dtype,
                                    master_dtype=est.master_dtype).rows[0]
        if row.peak_device <= est.device_memory:
            return n
        n *= 2
    return None


def suggestion(est: Estimate) -> str:
    """What would fit when nothing does: more ranks (stage 3 shards everything), offload, a smaller batch."""
    parts = []
    for name in ("zero3", "zero3_offload"):
        n = min_ranks_to_fit(est, name)
        if n is not None:
            parts.append(f"{name} on >= {n} ranks")
    if est.activations:
        remedies = {"activation_checkpointing='auto' (recompute each block in backward)": est.activation_checkpointing,
                    "offload_activations=True (saved activations in host memory)": est.offload_activations}
        parts += [remedy for remedy, already_on in remedies.items() if not already_on]
        parts.append("a smaller micro-batch or shorter sequences")
    return "What would fit: " + ("; ".join(parts) if parts else "nothing at this memory size") + "."
