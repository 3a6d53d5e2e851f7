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

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from torch import nn

from ..engine.config import PRESETS
from ..engine.memory.floors import optimizer_state_bytes_per_param, rank_model_states

GiB = 2**30
MiB = 2**20
# (stage, offload) -> conf/strategy preset; offload = optimizer offload (+ param shards at stage 3)
# (stage, offloaded) -> preset name, from the one preset table
SETTINGS: dict[tuple[int, Union[bool, str]], str] = {(kw["stage"], kw.get("offload_optimizer", False)): name
                                         for name, kw in PRESETS.items()}
PRECISIONS = {"32-true": False, "32": False, "bf16-mixed": True, "bf16": True, "16-mixed": True, "16": True}
from .estimate_knobs import check_estimate_knobs
from .estimate_nvme import nvme_bandwidth_line, nvme_ring_bytes, nvme_ring_line, nvme_step_bytes
from .t5_dims import (BYTE_VOCAB, RECIPE_VOCAB, T5_PRESETS, T5Dims, t5_activation_bytes,  # noqa: F401
                      t5_activation_memory, t5_dims, t5_dims_from_config)

@dataclass
class ModelInfo:
    """Parameter sizes the estimate needs (element counts)."""

    numel: int
    trainable: int
    sizes: list[int] = field(default_factory=list)  # per parameter (padding); empty: treat as one tensor
    trainable_sizes: list[int] = field(default_factory=list)
    largest_param: int = 0
    largest_unit: int = 0  # stage 3: the biggest unit (0: unknown)
    root_unit: int = 0  # stage 3: parameters outside every unit
    last_unit: int = 0  # stage 3: the unit forward runs last (kept gathered into its backward): the last registered
    name: str = "model"
    t5: Optional[T5Dims] = None

    def padded(self, world_size: int, trainable: bool) -> int:
        sizes = self.trainable_sizes if trainable else self.sizes
        if not sizes:
            return math.ceil((self.trainable if trainable else self.numel) / world_size)
        return sum(math.ceil(n / world_size) for n in sizes)


def info_from_module(module: nn.Module, unit_classes: Optional[Sequence] = None, unit_mb: Optional[float] = None,
                     name: Optional[str] = None) -> ModelInfo:
    """Sizes of a module (a meta-device module works: nothing is allocated); units as the engine's default
    policy chooses them (``unit_classes`` / ``unit_mb`` override, as in ZeroConfig)."""
    from ..engine.stage3.units import build_units

    params = list(module.parameters())
    sizes = [p.numel() for p in params]
    train = [p.numel() for p in params if p.requires_grad]
    units = build_units(module, 1, 0, unit_classes, max(1, int(unit_mb * MiB)) if unit_mb is not None else None)
    numels = [sum(p.numel() for p in u.params) for u in units]
    return ModelInfo(sum(sizes), sum(train), sizes, train, max(sizes, default=0), max(numels[:-1], default=0),
                     numels[-1], numels[-2] if len(numels) > 1 else 0, name or type(module).__name__)


def info_from_t5(dims: T5Dims) -> ModelInfo:
    blocks = [dims.block_numel(False, i == 0) for i in range(dims.num_layers)]
    blocks += [dims.block_numel(True, i == 0) for i in range(dims.dec_layers)]
    emb = dims.vocab_size * dims.d_model
    return ModelInfo(dims.numel, dims.numel, largest_param=max(emb, dims.d_model * dims.d_ff),
                     largest_unit=max(blocks), root_unit=dims.root_numel, last_unit=blocks[-1], name=dims.name,
                     t5=dims)


def model_state_bytes(info: ModelInfo, stage: int, offload: bool, world_size: int, mixed: bool,
                      state_bytes: int = 8, accumulating: bool = True) -> dict[str, float]:
    """Bytes of params, grads, master and optimizer state one rank holds, and how many are on the host.

    Same kinds as :class:`~lightning_zero.engine.memory.floors.MemoryReport` (``grads`` here includes the reduced
    shards), measured after a backward. ``accumulating``: gradient accumulation (``no_sync``), where stage
    1 keeps full gradients (the stage-1 floor); without it stage 1 reduces each bucket during backward and
    holds gradient shards, like stage 2.
    ``offload``: the optimizer (master + state) on the host; at stage 3 also the parameter shards.
    The engine's own model (:func:`~lightning_zero.engine.memory.floors.rank_model_states`, which the floors use
    too) with the shards as the engine pads them.
    """
    return rank_model_states(
        stage, world_size, mixed, info.numel, info.trainable, state_bytes, offload_optimizer=offload,
        offload_params=(offload if offload == "nvme" else bool(offload)) if stage == 3 else False,  # the presets' rule
        full_grads=stage == 0 or (stage == 1 and accumulating),
        param_shard=info.padded(world_size, False), grad_shard=info.padded(world_size, True))


def buffer_bytes(info: ModelInfo, stage: int, offload: bool, world_size: int, mixed: bool,
                 bucket_mb: float = 25.0, accumulating: bool = False, overlap_publish: bool = False
                 ) -> dict[str, float]:
    """Transient device buffers on top of the model states: during backward and at the optimizer step."""
    p = 2 if mixed else 4
    if stage < 3:
        # the cap is checked against the fp32 parameters at wrap time; one parameter never splits
        cap = max(bucket_mb * MiB / 4, info.largest_param)
        bucket = p * min(info.trainable, cap)
        backward = 2 * bucket + (bucket if stage == 2 or (stage == 1 and not accumulating) else 0)
        # the step all-gathers at most two buckets at a time: send + gathered buffers of each; overlapped
        # with the next forward (engine/optim/publish.py) every bucket is in flight until its forward: the bound
        whole = p * (info.padded(world_size, True) * world_size + info.padded(world_size, True))
        step = 2 * (bucket + bucket / world_size) if stage >= 1 else 0
        step = whole if stage >= 1 and overlap_publish else min(step, whole)
        return {"backward": backward, "step": float(step)}
    unit = info.largest_unit or min(info.trainable, 8 * MiB / 4)  # unknown units: the default unit_mb
    root = info.root_unit
    backward = p * (root + 4 * unit)  # root + current + prefetched unit, its grads and reduce buffer
    backward = max(backward, p * 3 * root)  # end of backward: the root's grads and reduce buffer
    return {"backward": float(backward), "step": 0.0}


# -- the estimate ----------------------------------------------------------------------------------------
@dataclass
class Row:
    setting: str
    stage: int
    offload: bool
    states: dict
    buffers: dict
    activations: Optional[float]
    peak_device: float
    host_per_rank: float
    cpu_ram_per_node: float
    fits: Optional[bool] = None
    nvme_per_rank: float = 0.0  # *_offload_nvme: masters + state (+ stage 3's parameter shards) in the scratch files
    nvme_moved_per_step: float = 0.0  # bytes those files move per step (nvme_step_bytes)
    nvme_ring: float = 0.0  # host bytes of the optimizer's NVMe ring (nvme_ring_bytes), part of host_per_rank
    nvme_optimizer: float = 0.0  # the masters + optimizer state that ring streams
    states_world: Optional[dict] = None  # hybrid sharding: the same setting's model states at K = world size


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
    """
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}. Allowed: 32-true, bf16-mixed, 16-mixed.")
    settings = check_estimate_knobs(settings, list(SETTINGS.values()), world_size=world_size, num_nodes=num_nodes,
                                    bucket_mb=bucket_mb, grad_accumulation=grad_accumulation, batch_size=batch_size,
                                    src_len=src_len, tgt_len=tgt_len, device_memory_gb=device_memory_gb,
                                    cpu_memory_gb=cpu_memory_gb, vocab_size=vocab_size, nvme_step_time=nvme_step_time)
    mixed = PRECISIONS[precision]
    k = optimizer_state_bytes_per_param(optimizer)
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
    if batch_size is not None:
        if activation_probe is not None:
            if activation_checkpointing or offload_activations:
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
    shards = shard_group_size or world_size  # the ranks one parameter is cut over
    split = None
    if tensor_parallel_size is not None:  # the local pieces, sharded over the data-parallel ranks
        from .estimate_tp import tensor_parallel_info

        split, info = tensor_parallel_info(model, info, tensor_parallel_size, world_size, shard_group_size,
                                           tensor_parallel_plan)
        shards = world_size // tensor_parallel_size
    ranks_per_node = math.ceil(world_size / num_nodes)
    rows = []
    for (stage, offload), name in SETTINGS.items():
        if (settings is not None and name not in settings) or (split is not None and stage == 3):
            continue
        st = model_state_bytes(info, stage, offload, shards, mixed, k, grad_accumulation > 1)
        buf = buffer_bytes(info, stage, offload, shards, mixed, bucket_mb, grad_accumulation > 1)
        peak = st["device"] + max(buf["backward"] + (act or 0.0), buf["step"])
        staging = 4 * info.trainable / shards if offload else 0.0  # fp32 gradient copies for the CPU step
        ring = nvme_ring_bytes(info, offload, shards, k, bucket_mb)
        host = st["host"] + staging + (parts["host"] if parts else 0) + ring
        row = Row(name, stage, offload, st, buf, act, peak, host, host * ranks_per_node, nvme_per_rank=st["nvme"],
                  nvme_moved_per_step=nvme_step_bytes(info, st, stage, offload, shards, mixed), nvme_ring=ring,
                  nvme_optimizer=(4 + k) * info.trainable / shards if offload == "nvme" else 0.0)
        if shards != world_size and stage >= 1:
            row.states_world = model_state_bytes(info, stage, offload, world_size, mixed, k, grad_accumulation > 1)
        if device_memory_gb is not None:
            row.fits = peak <= device_memory_gb * GiB and (cpu_memory_gb is None or row.cpu_ram_per_node <= cpu_memory_gb * GiB)
        rows.append(row)
    return Estimate(info, world_size, num_nodes, precision, optimizer, bucket_mb, grad_accumulation, rows,
                    (batch_size, src_len, tgt_len) if batch_size is not None else None, act,
                    device_memory_gb * GiB if device_memory_gb is not None else None,
                    cpu_memory_gb * GiB if cpu_memory_gb is not None else None,
                    shard_group_size if shards != world_size else None,
                    activation_checkpointing, offload_activations, parts, split, activation_probe, nvme_step_time)


def _offload_word(offload) -> str:
    return "nvme" if offload == "nvme" else ("yes" if offload else "no")


def _gib(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x / GiB:.2f}" if x >= 0.01 * GiB else f"{x / MiB:.2f}M"


def format_estimate(est: Estimate) -> str:
    info = est.info
    k = optimizer_state_bytes_per_param(est.optimizer)
    lines = [f"model: {info.name}, Psi = {info.numel:,} params ({info.trainable:,} trainable); {est.world_size} "
             f"rank(s) on {est.num_nodes} node(s); precision {est.precision}; optimizer {est.optimizer} "
             f"(K = {k} B/param); bucket {est.bucket_mb:g} MiB; gradient accumulation {est.grad_accumulation}"
             + ("" if est.grad_accumulation > 1 else " (stage 1 keeps full gradients only when accumulating)")]
    if est.batch is not None and est.activation_probe is not None:
        pr = est.activation_probe
        lines.append(f"activations: micro-batch {est.batch[0]} per rank = {_gib(est.activations)} GiB on the device "
                     f"(measured: saved-tensor bytes of one training forward at micro-batch {pr.probe_batch}, "
                     f"{_gib(pr.probe_bytes)} GiB from {pr.source}, scaled linearly in the batch size)")
    elif est.batch is not None:
        b, s, t = est.batch
        lines.append(f"activations: micro-batch {b} x (src {s}, tgt {t}) tokens per rank = {_gib(est.activations)} "
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
        params_dev = 0.0 if (r.stage == 3 and r.offload) else st["params"]
        mo = 0.0 if r.offload else st["master"] + st["optimizer_state"]
        fits = f" {'yes' if r.fits else 'NO':>{len(cap) - 3}} |" if cap else ""
        lines.append(
            f"| {r.setting:<{w}} | {r.stage:>5} | {_offload_word(r.offload):>7} | {_gib(params_dev):>6} "
            f"| {_gib(st['grads']):>5} | {_gib(mo):>12} | {_gib(st['device']):>13} "
            f"| {_gib(r.buffers['backward']) + '/' + _gib(r.buffers['step']):>16} | {_gib(r.activations):>11} "
            f"| {_gib(r.peak_device):>11} | {_gib(r.host_per_rank):>9} | {_gib(r.cpu_ram_per_node):>12} "
            f"| {_gib(r.nvme_per_rank):>9} |{fits}")
    if est.tensor_parallel is not None:
        from .estimate_tp import tensor_parallel_line

        lines.append(tensor_parallel_line(est))
    if est.shard_group_size is not None:
        lines.append(f"hybrid sharding: shard_group_size={est.shard_group_size} (states sharded over "
                     f"{est.shard_group_size} ranks, replicated {est.world_size // est.shard_group_size}x); "
                     f"device states per rank at K={est.world_size} vs K={est.shard_group_size}: " + ", ".join(
                         f"{r.setting} {_gib(r.states_world['device'])} vs {_gib(r.states['device'])}"
                         for r in est.rows if r.states_world is not None))
    lines.append(f"host/rank: offloaded states + fp32 gradient copies for the CPU step; CPU RAM/node = host/rank x "
                 f"{est.ranks_per_node} rank(s) per node (plus {_gib(4 * info.numel * est.ranks_per_node)} GiB/node "
                 "while building an fp32 model eagerly; stage 3 with meta-device init avoids it).")
    nvme = [r for r in est.rows if r.nvme_per_rank]
    if nvme:
        lines.append(nvme_bandwidth_line(nvme, est.ranks_per_node, est.nvme_step_time))
        lines.append(nvme_ring_line(nvme, info, est.bucket_mb))
    if est.device_memory is not None:
        ok = [r for r in est.rows if r.fits]
        no = [r for r in est.rows if not r.fits]
        cap_s = f"{est.device_memory / GiB:g} GiB per device"
        if est.cpu_memory is not None:
            cap_s += f" and {est.cpu_memory / GiB:g} GiB CPU RAM per node"
        if ok:
            lines.append(f"FITS in {cap_s}: " + ", ".join(f"{r.setting} ({_gib(r.peak_device)})" for r in ok) + ".")
        else:
            lines.append(f"NOTHING FITS in {cap_s}" + (" at this micro-batch" if est.batch else "") + ".")
        if no:
            lines.append("Does not fit: " + ", ".join(f"{r.setting} (needs {_gib(r.peak_device)})" for r in no) + ".")
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
        parts.append(f"forward saves {_gib(p.get('saved'))}, one block's recompute {_gib(p.get('recompute'))}")
    if off:
        parts.append(f"{_gib(p.get('host'))} GiB per rank in host memory")
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
                                    activation_probe=est.activation_probe).rows[0]
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
        if not est.activation_checkpointing:
            parts.append("activation_checkpointing='auto' (recompute each block in backward)")
        if not est.offload_activations:
            parts.append("offload_activations=True (saved activations in host memory)")
        parts.append("a smaller micro-batch or shorter sequences")
    return "What would fit: " + ("; ".join(parts) if parts else "nothing at this memory size") + "."
