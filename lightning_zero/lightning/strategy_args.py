"""The constructor arguments of the Trainer's, the pipeline's and Fabric's strategies, declared and documented once.

Design note
-----------
The three strategies take the same ZeroConfig knobs and the same process knobs (as Lightning's
``ModelParallelStrategy`` and its Fabric twin share theirs); each adds a few of its own (the Trainer's
precision plugin and checkpoint options, Fabric's ``precision`` and ``parallelize_fn``, the pipeline's
``pipeline_*``). Each argument is one :class:`Arg` here -- name, default, annotation and its documentation
-- and a strategy's ``__init__`` signature and its ``Args:`` docstring are built from its list
(:func:`signature`, :func:`docstring`), so ``inspect.signature``, Hydra, jsonargparse and ``help()`` see
real parameters. :func:`bind` resolves a call against the list: one ``TypeError`` naming every unknown
argument and what is allowed (a ``pipeline_*`` argument to the plain strategy names ZeroPipelineStrategy).
Imports nothing from Lightning: the defaults are torch's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.distributed.constants import default_pg_timeout


@dataclass(frozen=True)
class Arg:
    name: str
    default: Any
    annotation: Any
    doc: str = ""  # "" : documented together with the argument before it (e.g. the stage-3 unit options)


_O = Optional[Any]

#: the ZeroConfig knobs (named like its fields: ``zero_setup.zero_config`` takes them) and the process knobs
SHARED: tuple[Arg, ...] = (
    Arg("stage", 2, int, "0 (DDP-equivalent), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters)."),
    Arg("offload_optimizer", False, Union[bool, str], 'keep fp32 master shards and optimizer state off the device and '
        'step them on the CPU: True / "cpu" (host memory) or "nvme" (ZeRO-Infinity: per-rank scratch files under '
        '``nvme_path``, streamed through ``nvme_buffer_count`` host buffers each step); False / "none": on the device.'),
    Arg("offload_params", False, Union[bool, str], 'stage 3 only: where parameter shards live between uses: True / '
        '"cpu" (host memory) or "nvme" (per-rank scratch files under ``nvme_path``, each unit\'s shard read ahead of its '
        'gather in the recorded unit order through ``prefetch + nvme_buffer_count`` host buffers).'),
    Arg("nvme_path", None, Optional[str], "nvme_path, nvme_buffer_count, nvme_direct: the directory of the \"nvme\" "
        "offloads' scratch files (existing, writable, on a local NVMe disk; None = the environment variable "
        "LIGHTNING_ZERO_NVME_PATH), the optimizer's ring of host buffers (>= 2; 3 overlaps read, step and write) and "
        "O_DIRECT I/O for the optimizer's file (the disk's DMA instead of page-cache copies on the CPU)."),
    Arg("nvme_buffer_count", 3, int),
    Arg("nvme_direct", False, bool),
    Arg("optimizer_state_dtype", "fp32", str, 'optimizer_state_dtype, master_dtype: "fp32" (default) or "bf16": the '
        "optimizer's per-element state (Adam's moments) kept in bf16 between steps; the master in bf16 with a Kahan "
        "compensation term (the bf16 parameter itself where the states live on the device; needs bf16 precision). "
        "Each bucket steps in fp32."),
    Arg("master_dtype", "fp32", str),
    Arg("bucket_mb", 25.0, float, "size cap of one communication bucket (MiB)."),
    Arg("reduce_dtype", None, _O, 'dtype of gradient reductions (None = compute dtype, or "fp32").'),
    Arg("broadcast_buffers", True, bool, "copy rank 0's buffers to every rank before each training step (as DDP)."),
    Arg("unit_classes", None, Optional[Sequence[Any]],
        'unit_classes, unit_mb, persist_numel, prefetch, reshard_after_forward, order_check: stage 3 units (see '
        'ZeroConfig: prefetch True/False or how many units ahead; reshard_after_forward=False keeps a unit '
        'gathered from its forward to its backward); e.g. '
        '``unit_classes=["T5Block"]``; by default the model\'s ``_no_split_modules``, else its repeated blocks, '
        'else by size, with a persistence threshold relative to the units.'),
    Arg("unit_mb", None, Optional[float]),
    Arg("persist_numel", None, Optional[int]),
    Arg("prefetch", True, Union[bool, int]),
    Arg("reshard_after_forward", True, bool),
    Arg("order_check", "strict", str),
    Arg("accelerator", None, _O, "accelerator, parallel_devices, cluster_environment, checkpoint_io: as for "
                                  "Lightning's ``DDPStrategy`` (None: Lightning chooses)."),
    Arg("parallel_devices", None, Optional[list[torch.device]]),
    Arg("cluster_environment", None, _O),
    Arg("checkpoint_io", None, _O),
)

#: after the precision argument (Trainer: ``precision_plugin``, Fabric: ``precision``)
PROCESS: tuple[Arg, ...] = (
    Arg("process_group_backend", None, Optional[str], "process_group_backend, timeout: as for Lightning's "
                                                      "``DDPStrategy``."),
    Arg("timeout", default_pg_timeout, Optional[timedelta]),
    Arg("start_method", "popen", str, '"popen" (re-run the script per rank, like ``ddp``), "spawn", "fork" or '
                                      '"forkserver".'),
)

_TRUST = Arg("trust_checkpoint", False, bool,
             "read the pickles of the checkpoints this strategy loads unrestricted (a trusted checkpoint of an "
             "earlier build, or hparams holding other objects); default False: nothing in a checkpoint runs code "
             "when read (docs/security.md). ``weights_only=False`` opts in for one load.")
_TRAINABLE_ONLY = (
    Arg("checkpoint_trainable_only", False, bool,
        "checkpoint_trainable_only, checkpoint_base: save only what is trained (a LoRA / peft fine-tune's adapter, "
        "its optimizer state, buffers and loops) and record the frozen base by reference -- ``checkpoint_base`` (a "
        "save_pretrained directory, a state-dict file or an earlier lightning_zero checkpoint directory; default: "
        "``load_weights_from``) and a hash of the frozen weights, which a resume checks against the model it loads "
        "into and ``load_from_checkpoint`` / ``lightning-zero consolidate`` / ``export`` against the base they read "
        "(checkpoint/trainable_only.py)."),
    Arg("checkpoint_base", None, Optional[str]),
)
_ASYNC = Arg("async_save", False, bool,
             "sharded checkpoints written in the background: a save stops training only to copy this rank's share "
             "into host memory, a thread writes it (at most one save in flight; the checkpoint appears, and "
             "ModelCheckpoint's top-k removals happen, only once it is complete; a failed write is raised at the "
             "next step or at teardown). Costs a host copy of the rank's checkpoint share while it is written "
             "(docs/checkpoints.md, \"Asynchronous saves\").")
_SHARD_GROUP = Arg("shard_group_size", None, Optional[int],
                   "hybrid sharding (stages 1-3): shard within groups of this many consecutive ranks (e.g. the GPUs "
                   "of one node) and replicate across the groups, so parameter all-gathers and reduce-scatters stay "
                   "inside a node and only one all-reduce per gradient bucket and step crosses nodes; must divide "
                   "the world size (with tensor_parallel_size=T: the N / T data-parallel ranks). None = all of them "
                   "(plain ZeRO).")
_ACTIVATIONS = (
    Arg("activation_checkpointing", None, _O, 'None, "auto" (the stage-3 unit policy\'s blocks) or module classes / '
                                              'class names, e.g. ``["T5Block"]``: their forward is recomputed in '
                                              'backward instead of saved.'),
    Arg("offload_activations", False, bool, "saved activations go to (pinned) host memory during forward, back "
                                            "for backward."),
)
_COMMUNICATION = (
    Arg("grad_reduce", "auto", str, 'grad_reduce, overlap_publish, quantize_weights, quantize_grads: communication '
                                    '(see ZeroConfig): the gradient reduction ("auto" per backend, "reduce_scatter", '
                                    '"all_reduce" or "all_to_all"), the stage 1-2 parameter all-gather overlapped '
                                    'with the next forward, and int8 all-gathers (qwZ) / reduce-scatters (qgZ), off '
                                    'by default.'),
    Arg("overlap_publish", False, bool),
    Arg("quantize_weights", False, bool),
    Arg("quantize_grads", False, bool),
    Arg("offload_kernel", "fused", str, 'the offloaded optimizer step\'s kernel: "fused" (default: torch\'s fused '
                                        'CPU kernel replaces the user\'s; faster, about 1 ulp per step away from '
                                        'DDP) or "user" (the optimizer as the user made it: DDP-exact). The setup '
                                        'line says when the kernel was swapped.'),
)
_TENSOR_PARALLEL = Arg(
    "tensor_parallel_size", None, Optional[int],
    'tensor parallelism (stages 0-2): a 2-D ``DeviceMesh`` (N // T, T) with dims ("data_parallel", '
    '"tensor_parallel"), ``strategy.device_mesh`` (Trainer: also ``self.device_mesh`` in '
    '``LightningModule.configure_model``), where the model is cut with torch\'s ``parallelize_module`` over '
    '``device_mesh["tensor_parallel"]``; ZeRO shards each parameter\'s local piece over "data_parallel", the '
    'sampler splits the data by the data-parallel rank (lightning/tensor_parallel.py).')
_SEQUENCE_PARALLEL = Arg(
    "sequence_parallel_size", None, Optional[int],
    'sequence parallelism (Ulysses; any stage, hybrid sharding, offload): groups of S consecutive ranks share each '
    'batch and split its sequences along the length; every attention runs on S-th of its heads over the whole '
    'sequence between two all-to-alls. The model\'s HF attentions (GPT-2, Llama, T5\'s encoder) are swapped at '
    'setup, each batch is cut to the rank\'s slice (``input_ids``, ``attention_mask``, ``position_ids``, '
    '``labels``), the sampler splits by ``rank // S``, and the model\'s loss is the whole sequence\'s on every rank '
    '(lightning/sequence_parallel.py, docs/sequence_parallel.md).')

TRAINER: tuple[Arg, ...] = (
    *SHARED,
    Arg("precision_plugin", None, _O, "a ZeroPrecision (else the Trainer's ``precision=`` flag is mapped)."),
    *PROCESS,
    Arg("checkpoint_format", "sharded", str,
        '"sharded" (default: a torch.distributed.checkpoint directory per checkpoint, each rank writing its '
        'shards; reshards on load) or "full" (Lightning\'s single file with consolidated fp32 weights and '
        'optimizer state). Both load at any world size and stage.'),
    _TRUST, _ASYNC, *_TRAINABLE_ONLY, _SHARD_GROUP,
    Arg("memory_summary", True, bool, "after the first optimizer step, global rank 0 prints the per-rank "
                                      "model-state table (ZeRO beside DDP) and logs the numbers as ``zero/*`` "
                                      "metrics (``lightning/memory_summary.py``)."),
    *_ACTIVATIONS, *_COMMUNICATION, _TENSOR_PARALLEL, _SEQUENCE_PARALLEL,
    Arg("load_weights_from", None, Optional[str],
        "a ``save_pretrained`` directory (safetensors, sharded or not; ``pytorch_model.bin``) or a state-dict file "
        "whose weights the LightningModule's HF model gets at the first setup. At stage 3, with the model built in "
        "``configure_model`` (meta device, e.g. ``AutoModel.from_config``), each rank reads only the slices it "
        "keeps; no rank holds the model (engine/stage3/pretrained.py)."),
)

PIPELINE_ONLY: tuple[Arg, ...] = (
    Arg("pipeline_parallel_size", 2, int, "P, the stages of one pipeline; must divide the world size."),
    Arg("pipeline_microbatches", 4, int, "M, the micro-batches torch's schedule cuts each batch into (the bubble "
                                         "is (P - 1) / (M + P - 1) of a step)."),
    Arg("pipeline_schedule", "1f1b", str, '"1f1b" (default), "gpipe" or "interleaved" (``pipeline_chunks`` chunks '
                                          'per rank).'),
    Arg("pipeline_max_imbalance", 4.0, Optional[float], "refuse splits whose largest stage holds more than this "
                                                        "many times the parameters of the smallest (None: no check)."),
    Arg("pipeline_chunks", None, Optional[int], 'stage chunks per rank, V (default: 2 with "interleaved", else 1; '
                                                'more than one needs "interleaved").'),
)

#: the pipeline's memory table is not built (one engine per stage chunk): off by default there, True refused
PIPELINE: tuple[Arg, ...] = tuple(
    Arg(a.name, False, a.annotation, "not available with a pipeline (False).") if a.name == "memory_summary" else a
    for a in TRAINER) + PIPELINE_ONLY

FABRIC: tuple[Arg, ...] = (
    *SHARED,
    Arg("precision", None, _O, "a ZeroFabricPrecision (else Fabric's ``precision=`` flag is mapped)."),
    *PROCESS, _SHARD_GROUP, *_ACTIVATIONS, _TENSOR_PARALLEL, _SEQUENCE_PARALLEL,
    *_COMMUNICATION,
    Arg("parallelize_fn", None, Optional[Callable[[torch.nn.Module, Any], torch.nn.Module]],
        "``parallelize_fn(module, device_mesh) -> module`` cuts the model in ``fabric.setup_module`` (e.g. torch's "
        "``parallelize_module`` over ``device_mesh[\"tensor_parallel\"]``), as Lightning's Fabric "
        "``ModelParallelStrategy`` does."),
    _TRUST, _ASYNC, *_TRAINABLE_ONLY,
)


def signature(args: Sequence[Arg]) -> inspect.Signature:
    """``__init__(self, <args>)``, every argument also by keyword."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter("self", kind)]
                             + [inspect.Parameter(a.name, kind, default=a.default, annotation=a.annotation)
                                for a in args], return_annotation=None)


def docstring(summary: str, args: Sequence[Arg]) -> str:
    lines = [inspect.cleandoc(summary), "", "Args:"]
    for a in args:
        if a.doc:
            lines.append(f"    {a.name}: {a.doc}" if not a.doc.startswith(a.name + ",") else f"    {a.doc}")
    return "\n".join(lines) + "\n"


def bind(owner: str, args: Sequence[Arg], positional: tuple, keywords: dict) -> dict[str, Any]:
    """The call's value of every argument (defaults filled in); unknown or surplus arguments: one TypeError."""
    names = [a.name for a in args]
    unknown = sorted(k for k in keywords if k not in names)
    if unknown:
        pipeline = [k for k in unknown if k.startswith("pipeline_")]
        hint = (f" ({', '.join(pipeline)} configure pipeline parallelism: ZeroPipelineStrategy("
                f"pipeline_parallel_size=P, ...) takes them, with every ZeroStrategy argument)") if pipeline else ""
        raise TypeError(f"{owner} got unknown argument(s) {', '.join(unknown)}{hint}. Allowed: {', '.join(names)}.")
    if len(positional) > len(names):
        raise TypeError(f"{owner} takes at most {len(names)} positional arguments ({', '.join(names)}); got "
                        f"{len(positional)}.")
    given = dict(zip(names, positional))
    twice = sorted(set(given) & set(keywords))
    if twice:
        raise TypeError(f"{owner} got multiple values for {', '.join(twice)}.")
    given.update(keywords)
    return {a.name: given.get(a.name, a.default) for a in args}


def declare(cls: type, args: Sequence[Arg], summary: Optional[str] = None) -> type:
    """``cls.__init__``'s signature and ``Args:`` docstring from ``args`` (a class decorator's body)."""
    cls.__init__.__signature__ = signature(args)  # type: ignore[attr-defined]
    cls.__doc__ = docstring(summary if summary is not None else (cls.__doc__ or ""), args)
    return cls
