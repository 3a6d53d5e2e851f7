"""ZeroPipelineStrategy: pipeline parallelism x ZeRO 0-2 under the Lightning Trainer (engine/pipeline/pipeline_zero.py).

Design note
-----------
``ZeroPipelineStrategy(pipeline_parallel_size=P, ...)`` (every ZeroStrategy argument, plus ``pipeline_*``). The world is the engine's ``(P, D)``
layout: rank ``r`` holds stage ``r // D``, as replica ``r % D`` (:func:`~..engine.pipeline.pipeline_layout`).

The LightningModule's contract:

* ``configure_model`` builds only the modules of ``self.trainer.strategy.pipeline_stage_index`` (of
  ``pipeline_parallel_size``), e.g. ``self.stage_module = split_gpt2(model, P, index)``; the module's ``forward``
  is the stage's forward (token ids in on the first stage, the previous stage's output elsewhere).
* ``pipeline_loss(output, target)``: the last stage's loss on one micro-batch (a mean over it).
* ``training_step`` is not called: Lightning requires one, but the strategy runs torch's schedule over
  ``pipeline_microbatches`` micro-batches of the batch instead (a batch is ``(inputs, targets)``, or one
  tensor that is both, as for a language model). ``on_before_backward`` / ``on_after_backward`` /
  ``on_before_optimizer_step`` are not called either: backward happens inside the schedule.
* ``configure_optimizers``: one optimizer over ``self.parameters()`` (this stage's), with any LR scheduler.
* ``validation_step`` / ``test_step`` / ``predict_step`` are not called either: validation (during fit or
  ``trainer.validate``) and ``trainer.test`` run the forward pipeline and log ``val_loss`` / ``test_loss``,
  the last stage's mean over the global batch, broadcast so every rank's ``callback_metrics`` agree.
  ``trainer.predict`` returns the last stage's outputs per batch on *every* rank of the replica that read
  it (broadcast along the pipeline; each replica its own share of the data, as with DDP).
  Outside fit the pipeline is an evaluation-only one: fp32 weights as given (or from ``ckpt_path``),
  mixed precision under autocast, as ZeroStrategy evaluates. After a fit under the fork/spawn launcher
  the trained stages lived in the workers only (no rank, and not the main process, holds the whole model),
  so evaluating that module again needs ``ckpt_path=`` (anything else is one clear error).
* Several chunks per rank (``pipeline_schedule="interleaved"``, ``pipeline_chunks=V``): ``configure_model``
  sets ``self.pipeline_stages`` to the V chunk modules of ``strategy.pipeline_stage_indices`` (of
  ``strategy.pipeline_virtual_stages`` = P * V), each with its own stage forward; the one optimizer is
  split per chunk (lightning/pipeline_chunks.py).
* Precision: "32-true", "bf16-mixed", "16-mixed" as ZeroStrategy (the stage module in fp16/bf16, fp32
  masters); the fp16 loss scaler skips a step on every stage when any stage overflows, and the LR scheduler
  does not advance on a skipped step.

Lightning's loop stays in charge of *when*: its accumulation boundary (every ``accumulate_grad_batches``-th
batch, or an epoch's last) is the boundary the pipeline reduces and steps at, its LR schedulers step as
usual. The pipeline decides *how*: the loss is scaled by 1/(M * accumulation), ``gradient_clip_val`` clips
by the norm over all stages, the logged ``train_loss`` is the last stage's mean over the global batch,
broadcast to every rank. The sampler splits the data by data-parallel rank only: the P stages of a replica
read the same batch (the first stage its inputs, the last its targets).

How it shares ZeroStrategy
--------------------------
A subclass that keeps ZeroStrategy's process side (launcher, process groups, the torchrun attempt's group,
the knobs and their checks, the precision plugin, the even-inputs check, teardown's failure handling) and
installs a different collaborator for the rest: ZeroStrategy's hooks that decide what is trained and how a
step runs (``setup``, the steps, ``backward``, ``optimizer_step``, ``block_backward_sync``, the end of fit,
``teardown``, the checkpoint hooks) hand the call to ``self.model_side``, ZeroStrategy's
:class:`~.engine_side.EngineSide` or the pipeline's :class:`~.pipeline_side.PipelineSide`. So this class
overrides only its constructor and the (P, D) layout (launcher check, sampler), and no engine code of
ZeroStrategy's sits in it, skipped only because no engine is set. Not a sibling of a shared base class:
``isinstance(strategy, ZeroStrategy)`` stays true (the batch-size finder's and the Tuner's refusals, users'
own checks), and every hook ZeRO answers stays in one class, where a base class would split them by which
subclass happens to agree. ``tests/test_strategy_shape.py`` counts the overrides (at most 8) and checks that
both sides have the same methods.

Checkpoints are :meth:`PipelineZero.save`'s directory (checkpoint/pipeline_dir.py): per stage a sharded DCP
directory written by its data-parallel group (any data-parallel size and ZeRO stage resumes), Lightning's
``meta.pt`` beside them, written as ``X.zero-tmp`` and renamed into place. ``lightning-zero consolidate X
out.pt`` (or ``consolidate_pipeline_checkpoint(X)``) gives the uncut model's own state dict.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch

from ..engine.layout.dims import ParallelDims
from ..engine.pipeline.pipeline_zero import SCHEDULES, PipelineZero, check_pipeline_size, virtual_stages
from .compat import MultiProcessingLauncher
from .pipeline_launcher import PipelineLauncher
from .pipeline_side import PipelineSide
from .strategy import ZeroStrategy
from .strategy_args import PIPELINE as PIPELINE_ARGS, PIPELINE_ONLY, bind, declare


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}.")
    return value


def _check_inherited(knobs: dict) -> None:
    """ZeroStrategy's arguments whose machinery a pipeline does not run (one engine per stage chunk, the schedule
    instead of training_step): refused, rather than silently ignored."""
    if knobs["memory_summary"] is not False:  # check_strategy_knobs refused non-bools already
        raise ValueError("memory_summary=True is not available with pipeline_parallel_size: the model-state table "
                         "covers one engine, a pipeline rank holds one per stage chunk. Allowed: "
                         "memory_summary=False (the default here).")
    if knobs["checkpoint_trainable_only"]:
        raise ValueError("checkpoint_trainable_only=True is not available with pipeline_parallel_size: the pipeline "
                         "writes one directory per stage. Allowed: checkpoint_trainable_only=False.")
    if knobs["load_weights_from"] is not None:
        raise ValueError(f"load_weights_from={knobs['load_weights_from']!r} is not available with "
                         f"pipeline_parallel_size: each rank builds only its own stages in configure_model. Allowed: "
                         f"load_weights_from=None (load the pretrained weights into the stage modules there).")


def _check_pipeline_knobs(config, max_imbalance: Any) -> None:
    """The pipeline's own float knob; its combinations with the ZeRO stage and the other parallel dims are
    ZeroConfig's (engine/layout/dims.py's one table), the ints are checked where they are read."""
    if max_imbalance is not None and (isinstance(max_imbalance, bool) or not isinstance(max_imbalance, numbers.Real)
                                      or not math.isfinite(max_imbalance) or max_imbalance < 1):
        raise ValueError(f"pipeline_max_imbalance must be a finite number >= 1 (the largest stage's parameters over "
                         f"the smallest's) or None (no check); got {max_imbalance!r}.")


class ZeroPipelineStrategy(ZeroStrategy):
    """ZeRO stage 0, 1 or 2 over the data-parallel replicas of each of P pipeline stages:
    ``Trainer(strategy=ZeroPipelineStrategy(stage=1, pipeline_parallel_size=P, pipeline_microbatches=M))``.
    ZeroStrategy's arguments mean the same here; those a pipeline cannot honour are refused (stage 3,
    ``shard_group_size``, ``tensor_parallel_size``, ``checkpoint_format="full"``, ``memory_summary=True``,
    ``load_weights_from``)."""

    strategy_name = "zero_pipeline"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        knobs = bind("ZeroPipelineStrategy", PIPELINE_ARGS, args, kwargs)
        pipeline_parallel_size, pipeline_microbatches, pipeline_schedule, pipeline_max_imbalance, pipeline_chunks = (
            knobs[a.name] for a in PIPELINE_ONLY)
        self._init_strategy(knobs)
        ParallelDims.of(self.zero_config, pipeline=pipeline_parallel_size).check(self.zero_config.stage)
        _check_pipeline_knobs(self.zero_config, pipeline_max_imbalance)
        _check_inherited(knobs)
        if not isinstance(pipeline_schedule, str) or pipeline_schedule not in SCHEDULES:
            raise ValueError(f"Unknown pipeline_schedule {pipeline_schedule!r}. Allowed: {', '.join(SCHEDULES)}.")
        chunks = _check_int("pipeline_chunks", pipeline_chunks if pipeline_chunks is not None
                            else 2 if pipeline_schedule == "interleaved" else 1)
        if chunks > 1 and pipeline_schedule != "interleaved":
            raise ValueError(f"pipeline_chunks={chunks} (several stage chunks per rank) runs the interleaved "
                             f"schedule only; got pipeline_schedule={pipeline_schedule!r}. Allowed: "
                             f"pipeline_schedule='interleaved', or pipeline_chunks=1.")
        if self.checkpoint_format != "sharded":
            raise ValueError("checkpoint_format='full' is not available with pipeline_parallel_size: a checkpoint "
                             "is one file per stage. Allowed: checkpoint_format='sharded' (then `lightning-zero "
                             "consolidate` for one state dict).")
        self.pipeline_parallel_size = _check_int("pipeline_parallel_size", pipeline_parallel_size)
        self.pipeline_microbatches = _check_int("pipeline_microbatches", pipeline_microbatches)
        self.pipeline_schedule = pipeline_schedule
        self.pipeline_max_imbalance = pipeline_max_imbalance
        self.pipeline_chunks = chunks
        self.model_side = PipelineSide(self)  # ZeroStrategy's hooks run the pipeline (pipeline_side.py)

    # -- the (P, D) layout ----------------------------------------------------------------------------------
    @property
    def pipeline_dp_size(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    @property
    def pipeline_stage_index(self) -> int:
        """Which stage this rank builds in ``configure_model``."""
        return self.global_rank // self.pipeline_dp_size

    @property
    def pipeline_dp_rank(self) -> int:
        return self.global_rank % self.pipeline_dp_size

    @property
    def pipeline_virtual_stages(self) -> int:
        """P * V: the stages the model is cut into (V = ``pipeline_chunks`` per rank)."""
        return self.pipeline_parallel_size * self.pipeline_chunks

    @property
    def pipeline_stage_indices(self) -> list[int]:
        """The (virtual) stages this rank builds: ``p, p + P, ...`` (torch's interleaved layout)."""
        return virtual_stages(self.pipeline_stage_index, self.pipeline_parallel_size, self.pipeline_chunks)

    def _configure_launcher(self) -> None:
        # the world is known here (devices x nodes), before any process starts: one error, in the caller
        check_pipeline_size(self.pipeline_parallel_size, self.num_nodes * len(self.parallel_devices or [None]))
        super()._configure_launcher()
        if type(self._launcher) is MultiProcessingLauncher:  # fork / spawn: see PipelineLauncher
            self._launcher = PipelineLauncher(self, start_method=self._start_method)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return dict(num_replicas=self.pipeline_dp_size, rank=self.pipeline_dp_rank)

    # -- the model side's state, read by callbacks and tests -----------------------------------------------------
    @property
    def pipe(self) -> Optional[PipelineZero]:
        """The fit's pipeline (kept after it: ``save_checkpoint`` writes its state); None before a fit."""
        return self.model_side.pipe

    @property
    def last_loss(self) -> Optional[torch.Tensor]:
        """The last training batch's loss (the mean over the global batch), on every rank."""
        return self.model_side.last_loss


declare(ZeroPipelineStrategy, PIPELINE_ARGS)
