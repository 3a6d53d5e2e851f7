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

Checkpoints are :meth:`PipelineZero.save`'s directory (checkpoint/pipeline_dir.py): per stage a sharded DCP
directory written by its data-parallel group (any data-parallel size and ZeRO stage resumes), Lightning's
``meta.pt`` beside them, written as ``X.zero-tmp`` and renamed into place. ``lightning-zero consolidate X
out.pt`` (or ``consolidate_pipeline_checkpoint(X)``) gives the uncut model's own state dict.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from pathlib import Path
from typing import Any, Generator, Mapping, Optional

import torch

from ..engine.layout.dims import ParallelDims
from ..engine.pipeline.pipeline_zero import SCHEDULES, PipelineZero, check_pipeline_size, virtual_stages
from .compat import MultiProcessingLauncher
from .pipeline_launcher import TRAINED_ELSEWHERE, PipelineLauncher
from .pipeline_checkpoint_strategy import PipelineCheckpoints
from .pipeline_chunks import chunk_optimizers, sync_hyperparameters
from .strategy import TrainerFn, ZeroStrategy
from .zero_setup import guard_scheduler
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
        self.pipeline_checkpoints = PipelineCheckpoints(self.trust_checkpoint)  # the checkpoint hooks below use it
        self.pipe: Optional[PipelineZero] = None  # the fit's (kept after it: save_checkpoint writes its state)
        self._eval_pipe: Optional[PipelineZero] = None  # validate / test / predict outside fit
        self._live: list[PipelineZero] = []  # pipes whose engines still hold hooks (removed at teardown)
        self._chunk_opts: list = []  # several chunks: one optimizer per chunk (pipeline_chunks.py)
        self._stale = False  # evaluating a module whose training happened in other processes (see PipelineLauncher)
        self.last_loss: Optional[torch.Tensor] = None  # the last batch's loss (global batch mean), every rank
        self._boundary = False  # Lightning's loop is inside optimizer_step: this batch ends with a step

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

    # -- setup ----------------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and trainer.gradient_clip_val is not None and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} with pipeline stages. "
                             f"Allowed: 'norm' (clipped by the norm over all stages).")
        module = self.lightning_module
        loss_fn = getattr(module, "pipeline_loss", None)
        if trainer.state.fn != TrainerFn.PREDICTING and not callable(loss_fn):
            raise TypeError(f"{type(module).__name__} has no pipeline_loss(output, target): the last pipeline stage "
                            f"needs it to turn its output into the micro-batch's loss.")
        self.accelerator.setup(trainer)
        self.model_to_device()
        stages = self._stage_modules(module)
        if getattr(module, "source_prefixes", None) is None and len(stages) == 1:
            module.source_prefixes = _child_prefixes(module)  # checkpoints consolidate to the model's names
        prec, common = self.precision_plugin, dict(
            schedule=self.pipeline_schedule, config=self.zero_config, max_imbalance=self.pipeline_max_imbalance,
            device=self.root_device)
        stage_arg = stages if len(stages) > 1 else module
        if not fitting:  # evaluation only: fp32 weights, mixed precision under autocast (as ZeroStrategy)
            self._stale = getattr(module, TRAINED_ELSEWHERE, False)  # until a checkpoint loads
            self._eval_pipe = PipelineZero(stage_arg, self.pipeline_parallel_size, loss_fn, None,
                                           self.pipeline_microbatches, **common)
            self._live.append(self._eval_pipe)
            prec.attach(None, self.root_device.type)
            self.setup_precision_plugin()
            return
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"configure_optimizers returned {len(self.optimizers)} optimizers. Allowed with "
                             f"pipeline_parallel_size: one optimizer over the stage's parameters.")
        self._chunk_opts = chunk_optimizers(self.optimizers[0], stages) if len(stages) > 1 else []
        clip = trainer.gradient_clip_val
        for engine in self.pipe.engines if self.pipe is not None else ():
            engine.release_states()  # the previous fit's NVMe files: gone now, not when collected
        self.pipe = PipelineZero(stage_arg, self.pipeline_parallel_size, loss_fn,
                                 self._chunk_opts or self.optimizers[0], self.pipeline_microbatches,
                                 accumulate_grad_batches=trainer.accumulate_grad_batches,
                                 gradient_clip_val=float(clip) if clip is not None else None,
                                 compute_dtype=prec.compute_dtype, loss_scaler=prec.loss_scaler,
                                 check_finite=prec.check_finite, **common)
        self._live.append(self.pipe)
        self._attach_precision()
        # a step skipped for overflow (on any stage: on all of them) does not advance the LR schedule
        self._unguard = guard_scheduler(module, lambda: self.pipe.last_step_skipped)
        # Lightning zeroes gradients after the first training_step of an accumulation window, assuming its
        # backward comes next; here that step's backward has already run inside the schedule. The engines
        # clear their gradients after each optimizer step themselves.
        module.optimizer_zero_grad = lambda *a, **k: None  # instance attribute; removed at teardown
        self.setup_precision_plugin()

    def _stage_modules(self, module) -> list:
        """This rank's stage modules: the LightningModule itself, or its ``pipeline_stages`` (several chunks)."""
        if self.pipeline_chunks == 1:
            return [module]
        stages = list(getattr(module, "pipeline_stages", None) or ())
        if len(stages) != self.pipeline_chunks:
            raise ValueError(f"pipeline_chunks={self.pipeline_chunks}: configure_model must set "
                             f"self.pipeline_stages to the {self.pipeline_chunks} chunk modules of "
                             f"trainer.strategy.pipeline_stage_indices (of pipeline_virtual_stages); got "
                             f"{len(stages)}.")
        return stages

    def _attach_precision(self) -> None:
        """The plugin's input casts and skip counter on every chunk's engine (it attaches to one engine)."""
        from .precision import _cast_inputs_to_param_dtype

        prec = self.precision_plugin
        prec.attach(self.pipe.engine, self.root_device.type)
        for engine in self.pipe.engines[1:]:
            engine.counters = prec.counters
            if prec.mixed:
                prec._cast_hooks += _cast_inputs_to_param_dtype(engine.module)

    @property
    def _forward_pipe(self) -> PipelineZero:
        pipe = self._eval_pipe if self._eval_pipe is not None else self.pipe
        if pipe is None:
            raise RuntimeError("no pipeline is set up: evaluation runs inside trainer.fit / validate / test / predict.")
        if pipe is self._eval_pipe and self._stale:
            raise RuntimeError("this LightningModule was trained by trainer.fit in worker processes (fork/spawn "
                               "launcher), which held its pipeline stages; this process's copy has none of the "
                               "trained weights. Allowed: pass ckpt_path= (a checkpoint that fit saved) to "
                               "validate / test / predict, or run under torchrun, where fit and evaluation share "
                               "the processes.")
        return pipe

    # -- the training step: the whole schedule, inside Lightning's closure --------------------------------
    def _split_batch(self, batch: Any) -> tuple[Any, Any]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        if isinstance(batch, torch.Tensor):
            return batch, batch
        raise TypeError(f"a pipeline batch is (inputs, targets) or one tensor used as both; got "
                        f"{type(batch).__name__}.")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = self._split_batch(batch)
        pipe = self.pipe
        # Lightning decides the boundary (its accumulation count, or an epoch's last batch); PipelineZero's
        # reduction (no_sync on the other micro-batches) and its optimizer step follow that decision
        pipe._calls = pipe.accumulate - 1 if self._boundary else 0
        if self._boundary and self._chunk_opts:
            sync_hyperparameters(self.optimizers[0], self._chunk_opts)  # the LR the scheduler set
        prec, module = self.precision_plugin, self.lightning_module
        with prec.forward_context():
            self.last_loss = loss = pipe.step(inputs, targets)
        module.log("train_loss", loss, prog_bar=True, batch_size=self._rows(inputs))
        if self._boundary and prec.mixed:
            if prec.loss_scaler is not None:
                module.log("loss_scale", prec.loss_scale, prog_bar=True)
            module.log("skipped_steps", float(prec.skipped_steps), prog_bar=prec.loss_scaler is not None)
        return loss

    @staticmethod
    def _rows(inputs: Any) -> int:
        return inputs.shape[0] if isinstance(inputs, torch.Tensor) else 1

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # the schedule ran backward per micro-batch already

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # the closure runs training_step, whose last backward reduces and whose PipelineZero steps (and
        # clips) every stage's engine; nothing is left to step here
        self._boundary = True
        try:
            return closure()
        finally:
            self._boundary = False

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator:
        yield None  # the pipeline's own no_sync covers the non-boundary micro-batches

    def _evaluate(self, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
        """The forward pipeline over the batch's micro-batches: ``name`` logged, the mean over the global
        batch (every rank holds the same value)."""
        inputs, targets = self._split_batch(args[0] if args else kwargs["batch"])
        with self.precision_plugin.forward_context():
            loss = self._forward_pipe.evaluate(inputs, targets)
        self.lightning_module.log(name, loss, prog_bar=True, batch_size=self._rows(inputs))
        return loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("val_loss", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_loss", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The last stage's outputs for the batch's inputs, on every rank of this replica."""
        batch = args[0] if args else kwargs["batch"]
        inputs = self._split_batch(batch)[0]
        with self.precision_plugin.forward_context():
            out = self._forward_pipe.predict(inputs)
        return self.precision_plugin.convert_output(out)

    # -- checkpoints: the pipeline's directory (pipeline_checkpoint_strategy.py), not ZeroStrategy's -------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the stage directories hold the weights

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # ... and the optimizer state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        self.pipeline_checkpoints.save(self.pipe, checkpoint, Path(self.broadcast(str(filepath))), storage_options)
        if self.pipe is not None and self.pipe not in self._live:  # after fit: no step streams them out again
            for engine in self.pipe.engines:
                engine.spill_states()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the stage engines' masters, which exist after setup

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self.pipeline_checkpoints.read(self.broadcast(str(checkpoint_path)), weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._stale = False
        self.pipeline_checkpoints.load(self._forward_pipe, checkpoint)  # the fit's pipe or the evaluation one

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded with the model above

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.pipe is not None:  # bf16/fp16: the module back in fp32 with the master values
            for engine in self.pipe.engines:
                engine.restore_fp32_module()

    def teardown(self) -> None:
        for pipe in self._live:  # self.pipe stays: save_checkpoint after fit still writes its state
            keep = pipe is self.pipe and not self._failed  # [Note: NVMe states outlive teardown]
            for engine in pipe.engines:
                engine.remove(hand_back=not self._failed, keep_states=keep)
        self._live, self._eval_pipe = [], None
        if self.lightning_module is not None:
            self.lightning_module.__dict__.pop("optimizer_zero_grad", None)
        super().teardown()


declare(ZeroPipelineStrategy, PIPELINE_ARGS)


def _child_prefixes(module: torch.nn.Module) -> dict[str, str]:
    """A stage held as a submodule (``self.stage_module = split_gpt2(...)``): its ``source_prefixes`` under its name."""
    out: dict[str, str] = {}
    for name, child in module.named_modules():
        for local, source in (getattr(child, "source_prefixes", None) or {}).items() if child is not module else ():
            out[f"{name}.{local}"] = source
    return out
