"""PipelineSide: ZeroPipelineStrategy's model side -- one :class:`~lightning_zero.engine.pipeline.pipeline_zero.PipelineZero` per
fit (and one evaluation-only pipeline outside fit), driven from Lightning's hooks.

It has the methods of ZeroStrategy's own model side (engine_side.py), each taking Lightning's implementation of
its hook, and answers them with the pipeline: ``setup`` builds the stage engines, ``training_step`` runs the
whole schedule (backward included, so ``backward`` passes the loss through), ``optimizer_step`` only marks the
accumulation boundary the schedule then steps at, evaluation runs the forward pipeline, checkpoints are the
pipeline's directory (pipeline_checkpoint_strategy.py). What the LightningModule must provide:
pipeline_strategy.py's module docstring.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Generator, Mapping, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn

from ..engine.pipeline.pipeline_zero import PipelineZero
from .pipeline_checkpoint_strategy import PipelineCheckpoints
from .pipeline_chunks import chunk_optimizers, sync_hyperparameters
from .pipeline_launcher import TRAINED_ELSEWHERE
from .precision import _cast_inputs_to_param_dtype
from .zero_setup import guard_scheduler


class PipelineSide:
    """The fit's pipeline (kept after it: ``save_checkpoint`` writes its state), the evaluation-only one of
    validate / test / predict, and Lightning's accumulation boundary imposed on the schedule."""

    engine = None  # no single engine: one per stage chunk, ``pipe.engines``

    def __init__(self, strategy) -> None:
        self.strategy = strategy  # the ZeroPipelineStrategy this is the model side of
        self.checkpoints = PipelineCheckpoints(strategy.trust_checkpoint)  # the checkpoint methods below use it
        self.pipe: Optional[PipelineZero] = None  # the fit's (kept after it: save_checkpoint writes its state)
        self._eval_pipe: Optional[PipelineZero] = None  # validate / test / predict outside fit
        self._live: list[PipelineZero] = []  # pipes whose engines still hold hooks (removed at teardown)
        self._chunk_opts: list = []  # several chunks: one optimizer per chunk (pipeline_chunks.py)
        self._stale = False  # evaluating a module whose training happened in other processes (see PipelineLauncher)
        self.last_loss: Optional[torch.Tensor] = None  # the last batch's loss (global batch mean), every rank
        self._boundary = False  # Lightning's loop is inside optimizer_step: this batch ends with a step
        self._unguard: Optional[Callable[[], None]] = None  # undoes the LR-scheduler guard of this setup

    # -- setup ----------------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        s = self.strategy
        assert s.accelerator is not None and s.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and trainer.gradient_clip_val is not None and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} with pipeline stages. "
                             f"Allowed: 'norm' (clipped by the norm over all stages).")
        module = s.lightning_module
        loss_fn = getattr(module, "pipeline_loss", None)
        if trainer.state.fn != TrainerFn.PREDICTING and not callable(loss_fn):
            raise TypeError(f"{type(module).__name__} has no pipeline_loss(output, target): the last pipeline stage "
                            f"needs it to turn its output into the micro-batch's loss.")
        s.accelerator.setup(trainer)
        s.model_to_device()
        stages = self._stage_modules(module)
        if getattr(module, "source_prefixes", None) is None and len(stages) == 1:
            module.source_prefixes = _child_prefixes(module)  # checkpoints consolidate to the model's names
        prec, common = s.precision_plugin, dict(
            schedule=s.pipeline_schedule, config=s.zero_config, max_imbalance=s.pipeline_max_imbalance,
            device=s.root_device)
        stage_arg = stages if len(stages) > 1 else module
        if not fitting:  # evaluation only: fp32 weights, mixed precision under autocast (as ZeroStrategy)
            self._stale = getattr(module, TRAINED_ELSEWHERE, False)  # until a checkpoint loads
            self._eval_pipe = PipelineZero(stage_arg, s.pipeline_parallel_size, loss_fn, None,
                                           s.pipeline_microbatches, **common)
            self._live.append(self._eval_pipe)
            prec.attach(None, s.root_device.type)
            s.setup_precision_plugin()
            return
        s.setup_optimizers(trainer)
        if len(s.optimizers) != 1:
            raise ValueError(f"configure_optimizers returned {len(s.optimizers)} optimizers. Allowed with "
                             f"pipeline_parallel_size: one optimizer over the stage's parameters.")
        self._chunk_opts = chunk_optimizers(s.optimizers[0], stages) if len(stages) > 1 else []
        clip = trainer.gradient_clip_val
        for engine in self.pipe.engines if self.pipe is not None else ():
            engine.release_states()  # the previous fit's NVMe files: gone now, not when collected
        self.pipe = PipelineZero(stage_arg, s.pipeline_parallel_size, loss_fn,
                                 self._chunk_opts or s.optimizers[0], s.pipeline_microbatches,
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
        s.setup_precision_plugin()

    def _stage_modules(self, module) -> list:
        """This rank's stage modules: the LightningModule itself, or its ``pipeline_stages`` (several chunks)."""
        chunks = self.strategy.pipeline_chunks
        if chunks == 1:
            return [module]
        stages = list(getattr(module, "pipeline_stages", None) or ())
        if len(stages) != chunks:
            raise ValueError(f"pipeline_chunks={chunks}: configure_model must set self.pipeline_stages to the "
                             f"{chunks} chunk modules of trainer.strategy.pipeline_stage_indices (of "
                             f"pipeline_virtual_stages); got {len(stages)}.")
        return stages

    def _attach_precision(self) -> None:
        """The plugin's input casts and skip counter on every chunk's engine (it attaches to one engine)."""
        s = self.strategy
        prec = s.precision_plugin
        prec.attach(self.pipe.engine, s.root_device.type)
        for engine in self.pipe.engines[1:]:
            engine.counters = prec.counters
            if prec.mixed:
                prec._cast_hooks += _cast_inputs_to_param_dtype(engine.module)

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
    def training_step(self, lightning: Callable, args: tuple, kwargs: dict) -> Any:
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = _split_batch(batch)
        pipe, s = self.pipe, self.strategy
        # Lightning decides the boundary (its accumulation count, or an epoch's last batch); PipelineZero's
        # reduction (no_sync on the other micro-batches) and its optimizer step follow that decision
        pipe._calls = pipe.accumulate - 1 if self._boundary else 0
        if self._boundary and self._chunk_opts:
            sync_hyperparameters(s.optimizers[0], self._chunk_opts)  # the LR the scheduler set
        prec, module = s.precision_plugin, s.lightning_module
        with prec.forward_context():
            self.last_loss = loss = pipe.step(inputs, targets)
        module.log("train_loss", loss, prog_bar=True, batch_size=_rows(inputs))
        if self._boundary and prec.mixed:
            if prec.loss_scaler is not None:
                module.log("loss_scale", prec.loss_scale, prog_bar=True)
            module.log("skipped_steps", float(prec.skipped_steps), prog_bar=prec.loss_scaler is not None)
        return loss

    def backward(self, lightning: Callable, closure_loss: torch.Tensor, optimizer: Any, args: tuple,
                 kwargs: dict) -> torch.Tensor:
        return closure_loss  # the schedule ran backward per micro-batch already

    def optimizer_step(self, lightning: Callable, optimizer: Any, closure: Any, model: Any, kwargs: dict) -> Any:
        # the closure runs training_step, whose last backward reduces and whose PipelineZero steps (and
        # clips) every stage's engine; nothing is left to step here
        self._boundary = True
        try:
            return closure()
        finally:
            self._boundary = False

    @contextlib.contextmanager
    def no_sync(self) -> Generator:
        yield None  # the pipeline's own no_sync covers the non-boundary micro-batches

    # -- evaluation: the forward pipeline -------------------------------------------------------------------
    def _evaluate(self, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
        """The forward pipeline over the batch's micro-batches: ``name`` logged, the mean over the global
        batch (every rank holds the same value)."""
        inputs, targets = _split_batch(args[0] if args else kwargs["batch"])
        s = self.strategy
        with s.precision_plugin.forward_context():
            loss = self._forward_pipe().evaluate(inputs, targets)
        s.lightning_module.log(name, loss, prog_bar=True, batch_size=_rows(inputs))
        return loss

    def validation_step(self, lightning: Callable, args: tuple, kwargs: dict) -> Any:
        return self._evaluate("val_loss", args, kwargs)

    def test_step(self, lightning: Callable, args: tuple, kwargs: dict) -> Any:
        return self._evaluate("test_loss", args, kwargs)

    def predict_step(self, lightning: Callable, args: tuple, kwargs: dict) -> Any:
        """The last stage's outputs for the batch's inputs, on every rank of this replica."""
        batch = args[0] if args else kwargs["batch"]
        inputs = _split_batch(batch)[0]
        prec = self.strategy.precision_plugin
        with prec.forward_context():
            out = self._forward_pipe().predict(inputs)
        return prec.convert_output(out)

    # -- the end of a fit ---------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        if self.pipe is not None:  # bf16/fp16: the module back in fp32 with the master values
            for engine in self.pipe.engines:
                engine.restore_fp32_module()

    def teardown(self, failed: bool) -> None:
        for pipe in self._live:  # self.pipe stays: save_checkpoint after fit still writes its state
            keep = pipe is self.pipe and not failed  # [Note: NVMe states outlive teardown]
            for engine in pipe.engines:
                engine.remove(hand_back=not failed, keep_states=keep)
        self._live, self._eval_pipe = [], None
        module = self.strategy.lightning_module
        if module is not None:
            module.__dict__.pop("optimizer_zero_grad", None)
        if self._unguard is not None:
            self._unguard()
            self._unguard = None

    # -- checkpoints: the pipeline's directory (pipeline_checkpoint_strategy.py) ----------------------------
    def lightning_module_state_dict(self, lightning: Callable) -> dict[str, Any]:
        return {}  # the stage directories hold the weights

    def optimizer_state(self, lightning: Callable, optimizer: Any) -> dict[str, Any]:
        return {}  # ... and the optimizer state

    def save_checkpoint(self, lightning: Callable, checkpoint: dict[str, Any], filepath,
                        storage_options: Optional[Any]) -> None:
        saver = self.strategy.checkpoints.saver  # async_save=True: in a fit, written in the background
        if saver is not None and (self.pipe is None or self.pipe not in self._live):
            saver.wait()  # outside a fit: now, after any save in flight
            saver = None
        self.checkpoints.save(self.pipe, checkpoint, Path(self.strategy.broadcast(str(filepath))), storage_options,
                              saver)
        if self.pipe is not None and self.pipe not in self._live:  # after fit: no step streams them out again
            for engine in self.pipe.engines:
                engine.spill_states()

    def restore_checkpoint_after_setup(self, lightning: bool) -> bool:
        return True  # into the stage engines' masters, which exist after setup

    def load_checkpoint(self, lightning: Callable, checkpoint_path, weights_only: Optional[bool]) -> dict[str, Any]:
        return self.checkpoints.read(self.strategy.broadcast(str(checkpoint_path)), weights_only)

    def load_model_state_dict(self, lightning: Callable, checkpoint: Mapping[str, Any], strict: bool) -> None:
        self._stale = False
        self.checkpoints.load(self._forward_pipe(), checkpoint)  # the fit's pipe or the evaluation one

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded with the model above


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, torch.Tensor):
        return batch, batch
    raise TypeError(f"a pipeline batch is (inputs, targets) or one tensor used as both; got {type(batch).__name__}.")


def _rows(inputs: Any) -> int:
    return inputs.shape[0] if isinstance(inputs, torch.Tensor) else 1


def _child_prefixes(module: torch.nn.Module) -> dict[str, str]:
    """A stage held as a submodule (``self.stage_module = split_gpt2(...)``): its ``source_prefixes`` under its name."""
    out: dict[str, str] = {}
    for name, child in module.named_modules():
        for local, source in (getattr(child, "source_prefixes", None) or {}).items() if child is not module else ():
            out[f"{name}.{local}"] = source
    return out
