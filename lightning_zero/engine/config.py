"""ZeroConfig: the validated knobs shared by the engine, the Lightning strategy and the Hydra schema.

Design note
-----------
Every invalid combination is refused here, once, with a message that names what is allowed, so the
strategy constructor, the Hydra config and direct engine users all fail the same way and early (at
construction, not in the middle of the first step).
"""

from __future__ import annotations

import difflib
import enum
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .dtypes import STATE_DTYPE_KNOBS, parse_dtype, state_dtype_name  # noqa: F401  (part of the API)
from .layout.dims import ParallelDims
from .placement.nvme import NVME_PATH_ENV, OffloadDevice, check_nvme_dir
from .placement.param_store_registry import param_store_knob

STAGES = (0, 1, 2, 3)
GRAD_REDUCE = ("auto", "reduce_scatter", "all_reduce", "all_to_all")
OFFLOAD_KERNELS = ("fused", "user")
# the knobs only NVMe offload reads: any other value without it is refused (it would be ignored)
NVME_KNOB_DEFAULTS = dict(nvme_path=None, nvme_buffer_count=3, nvme_direct=False)


class OrderCheck(enum.Enum):
    """``ZeroConfig.order_check`` named (the config keeps the strings users write: "strict", ...)."""

    STRICT = "strict"
    ALWAYS = "always"
    OFF = "off"

    @classmethod
    def parse(cls, value) -> "OrderCheck":
        try:
            return value if isinstance(value, cls) else cls(value)
        except ValueError:
            allowed = ", ".join(repr(c.value) for c in cls)
            raise ValueError(f"order_check must be one of {allowed}; got {value!r}.") from None


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def module_entries(knob: str, value, allowed: str) -> Optional[list]:
    """None, or the non-empty list of module classes / names ``value`` is (one class or name alone, a list,
    a tuple, Hydra's ListConfig); anything else is refused, naming ``knob``. Whether a name matches a module
    of the model is checked at setup, when the model is there (stage3/unit_policy.py)."""
    if value is None:
        return None
    alone = isinstance(value, (str, type))
    entries = [value] if alone else value
    entries = list(entries) if isinstance(entries, Iterable) and not isinstance(entries, Mapping) else []
    bad = [e for e in entries if not ((isinstance(e, str) and e and e == e.strip())
                                      or (isinstance(e, type) and issubclass(e, torch.nn.Module)))]
    if not entries or bad:
        shown = repr(value) if alone or not bad else f"{bad[0]!r} ({type(bad[0]).__name__}) in {value!r}"
        raise ValueError(f"{knob} must be {allowed} (e.g. ['T5Block']); got {shown}.")
    return entries


@dataclass
class ZeroConfig:
    """What to shard and where to keep it.

    stage: 0 (DDP-equivalent), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
    offload_optimizer: fp32 master shards and optimizer state live in CPU memory; the step runs there.
        True or "cpu": in host memory; "nvme" (ZeRO-Infinity): in per-rank scratch files under ``nvme_path``
        between steps, streamed through a ring of ``nvme_buffer_count`` host buffers during the step
        (engine/placement/nvme_states.py); False or "none": on the compute device. Read back normalized: True, False
        or "nvme".
    offload_params: stage 3 only -- where parameter shards live between uses: True or "cpu" (host memory),
        "nvme" (ZeRO-Infinity: per-rank scratch files under ``nvme_path``, each unit's shard read ahead of its
        gather in the recorded unit order through a ring of ``prefetch + nvme_buffer_count`` host buffers,
        engine/placement/nvme_params.py), False, or the name of a store registered with
        ``lightning_zero.register_param_store`` (engine/placement/param_store_registry.py). Read back
        normalized: True, False, "nvme" or the registered name.
    nvme_path: the directory of the NVMe scratch files (must exist and be writable); None = the
        environment variable LIGHTNING_ZERO_NVME_PATH (how the registered ``*_offload_nvme`` presets get it).
    nvme_buffer_count: host buffers of the NVMe ring (>= 2; 3 overlaps reading the next chunk, stepping
        this one and writing the previous one); each holds the largest bucket's masters and state.
    nvme_direct: open the scratch files with O_DIRECT (page-aligned ring buffers): the disk's DMA moves the
        bytes instead of a page-cache copy on the CPU cores the step runs on; refused at setup where the file
        system has no O_DIRECT (tmpfs).
    optimizer_state_dtype: "fp32" (default) or "bf16": the optimizer's per-element state (Adam's two moments,
        SGD's momentum, ...) kept in bf16 between steps; each bucket's step widens it to fp32, runs the user's
        optimizer and rounds it back (engine/optim/low_precision.py, [Note: low-precision optimizer states]).
    master_dtype: "fp32" (default) or "bf16": the master in bf16 plus a bf16 Kahan compensation term (what the
        rounding dropped, added back before the next update); with bf16 compute and the states on the device the
        master *is* the bf16 parameter (no second copy). Needs bf16 compute (precision "bf16-mixed" /
        "bf16-true"): in fp32 training the fp32 parameter is its own master already.
    offload_kernel: which kernel the offloaded step runs. "fused" (default): torch's fused CPU
        implementation replaces the user's (``fused=True`` for Adam, AdamW, SGD, Adagrad; ``foreach`` for
        the others): faster, but not bit-identical to DDP's default kernel (about 1 ulp per step, which Adam
        can turn into +-lr on a parameter whose true gradient is zero). "user": the optimizer's param groups
        are left as the user made them (DDP-exact). Without offload_optimizer it has no effect.
    bucket_mb: cap of one gradient/parameter communication bucket, in MiB.
    reduce_dtype: dtype of gradient reductions (None = the compute dtype; "fp32" for exact sums).
    broadcast_buffers: copy rank 0's buffers to all ranks before each training forward (like DDP).
    unit_classes (stage 3): module classes, class names or qualified module names whose instances are
        gathered/released as one unit, e.g. ["T5Block"]; None = automatic: the model's own
        ``_no_split_modules``, else its repeated blocks, else by size (see engine/stage3/unit_policy.py).
    unit_mb (stage 3): units by size: a module becomes a unit once it owns this many MiB of params;
        None = automatic (the rule above; the size rule then uses min(8 MiB, model / 8)).
    persist_numel (stage 3): units with fewer elements stay gathered for the whole step; None = a
        quarter of the average unit, at most 10,000 elements.
    prefetch (stage 3): all-gather the next unit(s) in the recorded order while the current one computes:
        True (= 1 unit ahead), False (= 0) or an int >= 0, how many units ahead, in forward and in backward.
    reshard_after_forward (stage 3): True (default) releases a unit after its forward and gathers it again
        for its backward (but the last unit of a training forward, whose backward comes next); False keeps it gathered from its forward to its backward (one all-gather per unit
        per step instead of two, for the memory of the whole gathered model at the end of forward; FSDP2's
        ``reshard_after_forward=False``). Evaluation forwards always release.
    order_check (stage 3): "strict" (record the first training forward, verify it across ranks, then
        require it every step: clean errors for diverging ranks, prefetch enabled), "always" (a tiny
        check before every gather: any consistent control flow, no prefetch) or "off".
    shard_group_size: hybrid sharding: stages 1-3 shard within groups of this many consecutive ranks and
        replicate across the groups (gradients: reduce-scatter inside, one all-reduce of the shard across);
        must divide the world size (with tensor parallelism: the N // T data-parallel ranks, whose groups it
        cuts); None = all of them (one group). Stage 0 ignores it.
    tensor_parallel_size: T, the tensor dim of the one parallel layout (layout.py, which also says which
        dims and stages combine); the engine then takes the process's (N // T, T) mesh unless given one.
    sequence_parallel_size: S, the sequence dim: groups of S consecutive ranks split each sequence along its
        length (Ulysses, lightning_zero/sequence_parallel/); the engine itself is unchanged -- every rank of a
        group returns the whole sequence's loss, so ZeRO shards and averages over all ranks as data-parallel
        ones ([Note: sequence parallelism over ZeRO], layout/dims.py). Any stage, hybrid sharding, offload.
    """

    stage: int = 2
    offload_optimizer: Union[bool, str] = False
    offload_params: Union[bool, str] = False
    bucket_mb: float = 25.0
    reduce_dtype: Optional[object] = None
    broadcast_buffers: bool = True
    unit_classes: Optional[Sequence[Union[type, str]]] = None
    unit_mb: Optional[float] = None
    persist_numel: Optional[int] = None
    prefetch: Union[bool, int] = True
    reshard_after_forward: bool = True
    order_check: str = "strict"
    # -- the parallel layout ([Note: one parallel layout], layout.py; checked there, against one table) ----
    # shard_group_size: hybrid sharding: shard within groups of this many consecutive ranks (a node),
    #     replicate across the groups; None = the whole world (plain ZeRO)
    # tensor_parallel_size: T, a (N // T, T) ("data_parallel", "tensor_parallel") mesh (stages 0-2); None = none
    # (the pipeline dim, P, is ZeroPipelineStrategy's / PipelineZero's own argument, checked by the same table)
    # sequence_parallel_size: S, groups of S consecutive ranks each splitting one batch's sequences (Ulysses)
    shard_group_size: Optional[int] = None
    tensor_parallel_size: Optional[int] = None
    sequence_parallel_size: Optional[int] = None

    # -- activation memory (engine/memory/activations.py) ------------------------------------------------------
    # activation_checkpointing: None; "auto" (the modules the stage-3 unit policy picks: the units at stage 3,
    #     the same blocks below); or module classes / class names, e.g. ["T5Block"]: their forward runs under
    #     non-reentrant torch.utils.checkpoint and is recomputed in backward.
    # offload_activations: saved activations go to (pinned) host memory during forward, back for backward.
    activation_checkpointing: Optional[Union[str, Sequence[Union[type, str]]]] = None
    offload_activations: bool = False

    # -- communication (engine/grads/reducer.py, publish.py, quantize.py) ---------------------------------
    # grad_reduce (stages 1-3): how a gradient bucket reaches its shard. "reduce_scatter"; "all_reduce" (the
    #     whole bucket summed, this rank's slice kept: same memory, since the full bucket exists either way,
    #     and the same sums); "all_to_all" (one all-to-all of the rank-major rows, the N received rows summed
    #     in fp32 in rank order: a reduce-scatter's bytes through gloo's faster all-to-all; quantize.py);
    #     "auto" = per backend from a fixed table (collectives.GRAD_REDUCE_BY_BACKEND: gloo, whose
    #     reduce-scatter is slow, gets its table entry; reduce_scatter elsewhere).
    # overlap_publish (stages 1-2, opt-in): the parameter all-gather after a step runs while the next
    #     forward computes; each bucket is waited for in the forward pre-hook of the modules that hold its
    #     parameters and wherever the engine reads or writes them (engine/optim/publish.py). Off by default: code
    #     that reads parameters between the step and the next forward (EMA / weight-averaging callbacks, a
    #     weight norm logged in on_train_batch_end) would see this rank's slice new and the rest one step
    #     old unless it calls engine.ensure_published() first.
    # quantize_weights: stage-3 unit gathers and the stage 1-2 publish travel as int8 blocks of 256 with
    #     one fp32 scale each (ZeRO++ qwZ); masters stay fp32. quantize_grads: gradients are reduced as int8
    #     blocks through one all-to-all per bucket, summed in fp32 (ZeRO++ qgZ). Both off by default.
    grad_reduce: str = "auto"
    overlap_publish: bool = False
    quantize_weights: bool = False
    quantize_grads: bool = False
    # -- the offloaded step's kernel (engine/optim/optimizer.py): "fused" | "user", see the docstring
    offload_kernel: str = "fused"
    # -- ZeRO-Infinity (engine/placement/nvme.py, nvme_states.py): where offload_optimizer="nvme" keeps the states
    nvme_path: Optional[str] = None
    nvme_buffer_count: int = 3
    nvme_direct: bool = False
    # -- low-precision optimizer states (engine/optim/low_precision.py): "fp32" (default) | "bf16"
    optimizer_state_dtype: str = "fp32"
    master_dtype: str = "fp32"

    def __post_init__(self) -> None:
        self._check_offload_devices()
        self._check_types()
        self._check_combinations()
        self._check_activation_options()

    def _check_types(self) -> None:
        if not _is_int(self.stage) or self.stage not in STAGES:
            raise ValueError(f"Unknown ZeRO stage {self.stage!r}. Allowed stages: 0, 1, 2, 3 (an int).")
        if not isinstance(self.prefetch, bool) and not (_is_int(self.prefetch) and self.prefetch >= 0):
            raise ValueError(f"prefetch must be True (1 unit ahead), False (none) or an int >= 0 (how many units "
                             f"ahead); got {self.prefetch!r}.")
        if _is_int(self.reshard_after_forward) and not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r}: resharding to a smaller group "
                             f"after forward (an int, ZeRO++ hpZ) is not available. Allowed: True (release after "
                             f"forward) or False (keep gathered until backward).")
        for flag in ("nvme_direct", "broadcast_buffers", "reshard_after_forward",
                     "overlap_publish",
                     "quantize_weights", "quantize_grads", "offload_activations"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False; got {getattr(self, flag)!r}.")
        for size in ("bucket_mb", "unit_mb"):
            value = getattr(self, size)
            if size == "unit_mb" and value is None:  # automatic (engine/stage3/unit_policy.py)
                continue
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                auto = " or None (automatic)" if size == "unit_mb" else ""
                raise ValueError(f"{size} must be a positive number of MiB (finite, e.g. 25 or 0.5){auto}; "
                                 f"got {value!r}.")
        if self.persist_numel is not None and (not _is_int(self.persist_numel) or self.persist_numel < 0):
            raise ValueError(f"persist_numel must be an int >= 0 (a number of elements; 0 = no unit stays "
                             f"gathered) or None (automatic); got {self.persist_numel!r}.")
        self.reduce_dtype = parse_dtype(self.reduce_dtype, "reduce_dtype")
        for knob in STATE_DTYPE_KNOBS:
            setattr(self, knob, state_dtype_name(getattr(self, knob), knob))
        self.order_check = OrderCheck.parse(self.order_check).value  # stays the user's string; engines use the enum
        if not isinstance(self.grad_reduce, str) or self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce must be one of {', '.join(map(repr, GRAD_REDUCE))}; got {self.grad_reduce!r}.")
        self.unit_classes = module_entries("unit_classes", self.unit_classes, "None or a non-empty list of "
                                           "module classes, class names or qualified module names")
        ParallelDims.of(self).check(self.stage)  # types, combinations, stages: one table (layout.py)

    def _check_offload_devices(self) -> None:
        """The device forms of the offload knobs, normalized to True / False / "nvme" (what the rest of the
        engine tests for truth keeps working); nvme_path resolved and checked (exists, writable)."""
        self.offload_optimizer = OffloadDevice.parse(self.offload_optimizer, "offload_optimizer").knob_value
        self.offload_params = param_store_knob(self.offload_params)  # or a registered store's name
        if not _is_int(self.nvme_buffer_count) or self.nvme_buffer_count < 2:
            raise ValueError(f"nvme_buffer_count must be an int >= 2 (host buffers of the NVMe ring; 3 overlaps "
                             f"read, step and write); got {self.nvme_buffer_count!r}.")
        if self.nvme_path is not None and not isinstance(self.nvme_path, (str, os.PathLike)):
            raise ValueError(f"nvme_path must be None or a directory path (str); got {self.nvme_path!r}.")
        on_nvme = [k for k in ("offload_optimizer", "offload_params") if getattr(self, k) == "nvme"]
        if not on_nvme:  # an NVMe knob set here would be ignored: say so rather than run without it
            given = [f"{k}={getattr(self, k)!r}" for k, default in NVME_KNOB_DEFAULTS.items()
                     if getattr(self, k) is not default and getattr(self, k) != default]
            if given:
                raise ValueError(f"{', '.join(given)} given without NVMe offload (offload_optimizer="
                                 f"{self.offload_optimizer!r}, offload_params={self.offload_params!r}): it would be "
                                 f"ignored. Allowed: NVMe knobs with offload_optimizer='nvme' or offload_params='nvme'; "
                                 f"else their defaults (nvme_path=None, nvme_buffer_count=3, nvme_direct=False).")
        if self.nvme_direct is True and on_nvme == ["offload_params"]:
            raise ValueError("nvme_direct=True opens the optimizer's scratch files with O_DIRECT; with "
                             "offload_params='nvme' alone there are none (the parameter file uses the page cache: "
                             "the publish writes unaligned slices). Allowed: nvme_direct=True with "
                             "offload_optimizer='nvme'.")
        if on_nvme:
            self._resolve_nvme_path(on_nvme[0])
            if self.overlap_publish and self.offload_device is OffloadDevice.NVME:
                raise ValueError("overlap_publish=True does not compose with offload_optimizer='nvme' (the masters "
                                 "are published bucket by bucket while they are in the NVMe ring). Allowed: "
                                 "overlap_publish with offload_optimizer False / True / 'cpu'.")

    def _resolve_nvme_path(self, knob: str) -> None:
        """``nvme_path`` (or LIGHTNING_ZERO_NVME_PATH) as this machine's existing, writable directory
        ([Note: nvme_path is the training machine's])."""
        if self.nvme_path is None:
            self.nvme_path = os.environ.get(NVME_PATH_ENV) or None
        if self.nvme_path is None:
            raise ValueError(f"{knob}='nvme' needs a directory for the scratch files: nvme_path=DIR "
                             f"(or the environment variable {NVME_PATH_ENV}). Allowed: an existing, "
                             f"writable directory on a local NVMe disk.")
        self.nvme_path = check_nvme_dir(os.fspath(self.nvme_path))

    @classmethod
    def for_another_machine(cls, **knobs) -> "ZeroConfig":
        """``ZeroConfig(**knobs)`` checked by every rule but those of the machine that trains: for knobs written
        here and run there (a DeepSpeed config translated on a login node). The result keeps ``nvme_path`` as
        written: it is for further checks, not for a run, whose own ``ZeroConfig`` checks the path where it starts.

        [Note: nvme_path is the training machine's]
        ``nvme_path`` and LIGHTNING_ZERO_NVME_PATH name a directory on the machine whose ranks write the scratch
        files; the machine that writes a config (a login node, a laptop) need not have it, or may have a
        different disk there. So existence, writability and the environment variable are checked only by the
        ``ZeroConfig`` a run builds (its strategy, at start), and a config checked elsewhere keeps the path as
        written."""
        return _ZeroConfigElsewhere(**knobs)

    @property
    def offload_device(self) -> OffloadDevice:
        """Where the fp32 masters and optimizer state live between steps."""
        return OffloadDevice.parse(self.offload_optimizer, "offload_optimizer")

    def _check_combinations(self) -> None:
        if self.offload_optimizer and self.stage == 0:
            raise ValueError(
                f"offload_optimizer={self.offload_optimizer!r} needs a sharded optimizer: stage 0 keeps replicated optimizer state. "
                "Allowed: offload_optimizer with stage 1, 2 or 3."
            )
        if self.offload_kernel not in OFFLOAD_KERNELS:
            raise ValueError(f"offload_kernel must be one of {', '.join(map(repr, OFFLOAD_KERNELS))} ('fused': "
                             f"torch's fused CPU kernel, faster; 'user': the optimizer's own kernel, DDP-exact); "
                             f"got {self.offload_kernel!r}.")
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"offload_params={self.offload_params!r} needs partitioned parameters (stage 3); got stage {self.stage}. "
                "Allowed: offload_params with stage 3 only (use offload_optimizer for stages 1-2)."
            )
        if self.quantize_grads and self.stage == 0:
            raise ValueError("quantize_grads=True quantizes the reduce-scatter of sharded gradients. Allowed: "
                             "quantize_grads with stage 1, 2 or 3 (stage 0 all-reduces whole gradients).")
        if self.quantize_weights and self.stage == 0:
            raise ValueError("quantize_weights=True quantizes the all-gather of parameter shards. Allowed: "
                             "quantize_weights with stage 1, 2 or 3 (stage 0 gathers nothing).")
        if self.master_dtype == "bf16" and self.quantize_weights:
            raise ValueError("master_dtype='bf16' keeps the master in the published bf16 parameter (plus a "
                             "compensation term); quantize_weights=True publishes int8-rounded parameters that "
                             "cannot be the master. Allowed: master_dtype='bf16' without quantize_weights, or "
                             "master_dtype='fp32'.")
        if self.overlap_publish and self.stage not in (1, 2):
            why = ("stage 0 steps every rank's whole copy, nothing is gathered" if self.stage == 0 else
                   "stage 3 gathers each unit before its own forward already")
            raise ValueError(f"overlap_publish=True overlaps the all-gather of the updated parameters after a step "
                             f"with the next forward; got stage {self.stage} ({why}). Allowed: overlap_publish "
                             f"with stage 1 or 2.")

    def _check_activation_options(self) -> None:
        ac = self.activation_checkpointing
        if ac != "auto":  # one class or class name alone, as unit_classes accepts
            ac = module_entries("activation_checkpointing", ac,
                                "None, 'auto' or a non-empty list of module classes / class names")
            near = [e for e in ac or ()
                    if isinstance(e, str) and difflib.get_close_matches(e.lower(), ["auto"], cutoff=0.75)]
            if near:  # 'autoo', 'Auto', ['auto']: surely meant the automatic choice, not a class of that name
                raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r}: did you mean 'auto' "
                                 f"(the string alone)? Allowed: None, 'auto' or a non-empty list of module classes / "
                                 f"class names (e.g. ['T5Block']).")
        self.activation_checkpointing = ac

    @property
    def unit_bytes(self) -> Optional[int]:
        return max(1, int(self.unit_mb * 2**20)) if self.unit_mb is not None else None

    @property
    def prefetch_depth(self) -> int:
        """How many units ahead stage 3 gathers (``prefetch``: True is 1)."""
        return int(self.prefetch)

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


class _ZeroConfigElsewhere(ZeroConfig):
    """ZeroConfig's rules without the training machine's ([Note: nvme_path is the training machine's])."""

    def _resolve_nvme_path(self, knob: str) -> None:
        if self.nvme_path is not None:
            self.nvme_path = os.fspath(self.nvme_path)


# The named settings: the registered strategy names (zero2, zero2_fork, ...), the estimator's and tuner's
# rows and the Hydra presets conf/strategy/<name>.yaml (tests/test_hydra_recipe.py checks those agree) all read
# this one table.
PRESETS: dict[str, dict] = {
    "zero0": dict(stage=0),
    "zero1": dict(stage=1),
    "zero1_offload": dict(stage=1, offload_optimizer=True),
    "zero2": dict(stage=2),
    "zero2_offload": dict(stage=2, offload_optimizer=True),
    "zero3": dict(stage=3),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
    # ZeRO-Infinity: masters + optimizer state in NVMe files (nvme_path, or LIGHTNING_ZERO_NVME_PATH)
    "zero2_offload_nvme": dict(stage=2, offload_optimizer="nvme"),
    # stage 3 also the parameter shards, as Lightning's deepspeed_stage_3_offload_nvme (offload_param.device "nvme")
    "zero3_offload_nvme": dict(stage=3, offload_optimizer="nvme", offload_params="nvme"),
}
