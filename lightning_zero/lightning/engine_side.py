"""EngineSide: ZeroStrategy's model side -- one :class:`~lightning_zero.engine.ZeroEngine` over the LightningModule.

Design note
-----------
``ZeroStrategy`` keeps what it inherits from Lightning's ``DDPStrategy`` (launchers, process groups, samplers,
collectives) and hands everything about *what is trained and how a step runs* to one collaborator, its
``model_side``: what ``setup`` builds, the training / evaluation steps, ``backward``, ``optimizer_step``, the
accumulation window's ``no_sync``, the end of a fit, teardown, and what the checkpoint hooks save and load.
This class is ZeroStrategy's own; ``ZeroPipelineStrategy`` installs
:class:`~lightning_zero.lightning.pipeline_side.PipelineSide` instead (why a collaborator: the module
docstring of pipeline_strategy.py). Both have the same methods (``tests/test_strategy_shape.py``); each hook
method takes Lightning's own implementation of that hook (``lightning``) for what ZeRO leaves to Lightning.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Generator, Mapping, Optional

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..checkpoint.format import resolve_checkpoint_dir
from ..checkpoint.local_copies import fetch_checkpoint
from ..engine import ZeroEngine
from ..engine.engine_state import EngineMode
from ..engine.stage3.pretrained import load_pretrained, outermost_hf_model
from .callback_checks import check_callbacks, weight_readers
from .compat import sync_module_states
from .model_summary import bind as bind_summary
from .optimizers import bind as bind_optimizers
from .tensor_parallel import TensorParallelLayout
from .zero_setup import build_engine, guard_scheduler


class EngineSide:
    """One engine per fit (and one evaluation-only engine for validate / test / predict at stage 3), kept
    after the fit for ``save_checkpoint`` ([Note: the trained state outlives fit])."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy  # the ZeroStrategy this is the model side of
        self.engine: Optional[ZeroEngine] = None
        self.trained_engine: Optional[ZeroEngine] = None  # see [Note: the trained state outlives fit]
        self._weights_loaded = False
        self._unguard: Optional[Callable[[], None]] = None  # undoes the LR-scheduler guard of this setup
        self._unbind_optimizers: Optional[Callable[[], None]] = None  # undoes optimizers.bind (+ model_summary.bind)

    # -- setup ----------------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        s = self.strategy
        assert s.accelerator is not None and s.model is not None
        s.accelerator.setup(trainer)
        s.model_to_device()
        if s.load_weights_from is not None and not self._weights_loaded:  # once: a later fit keeps training
            load_pretrained(outermost_hf_model(s.lightning_module), s.load_weights_from)
            self._weights_loaded = True
        precision = s.precision_plugin
        if trainer.state.fn == TrainerFn.FITTING:
            check_callbacks(trainer.callbacks, s.plan, precision.compute_dtype, s.checkpoint_format)
            if self.trained_engine is not None:  # the previous fit's state gives way before the new one is built
                self.trained_engine.release_states()  # NVMe: its scratch files removed now, not when collected
            self.trained_engine = None
            s.setup_optimizers(trainer)
            # several optimizers: each sharded on its own (disjoint parameters; see optimizers.py)
            self.engine = build_engine(s.lightning_module, s.optimizers, s.zero_config, precision, s.root_device,
                                       device_mesh=TensorParallelLayout.mesh_of(s.tensor_parallel))
            self._publish_before_hooks(trainer)
            engine = self.engine  # a step skipped for overflow does not advance the LR schedule (as DeepSpeed)
            self._unguard = guard_scheduler(s.lightning_module, lambda: engine.last_step_skipped)
            self._unbind_optimizers = bind_optimizers(s, trainer)
            if s.plan.shards_params:  # ModelSummary's "Params per Device" column, as DeepSpeed stage 3's
                unbind_summary, unbind_opts = bind_summary(trainer, self.engine), self._unbind_optimizers
                self._unbind_optimizers = lambda: (unbind_opts(), unbind_summary())
        else:
            # evaluation only: no optimizer. Weights stay fp32 (mixed precision runs under autocast, see
            # ZeroPrecision.forward_context), so validate/test/predict never round the user's model.
            if s.plan.shards_params:  # parameters still partitioned
                self.engine = build_engine(s.lightning_module, None, s.zero_config, precision, s.root_device)
            elif s.tensor_parallel is not None:  # TP ranks hold different pieces: over the DP dim only
                s.tensor_parallel.sync_module_states(s.model)
            else:  # every rank starts from rank 0's weights
                sync_module_states(s.model)
                precision.attach(self.engine, s.root_device.type)
        s.setup_precision_plugin()

    def _publish_before_hooks(self, trainer) -> None:
        """overlap_publish with a callback or module hook that may read the weights between a step and the
        next forward (EMAWeightAveraging, a user's on_train_batch_end): the step completes its all-gathers
        before returning, so they see every rank's update. Lightning's own bookkeeping callbacks keep the
        overlap (engine/optim/publish.py)."""
        s = self.strategy
        readers = weight_readers(trainer.callbacks, s.lightning_module) if self.engine.publisher is not None else []
        s.precision_plugin.ensure_published_after_step = bool(readers)
        if readers:
            rank_zero_info(f"overlap_publish: {', '.join(readers)} may read the weights between steps, so each "
                           "optimizer step completes its parameter all-gather before the hooks run.")

    # -- steps ----------------------------------------------------------------------------------------------
    def _prepared(self, step: Callable, args: tuple, kwargs: dict) -> Any:
        if self.engine is not None:  # rank 0's buffers; stage 3: the root unit
            self.engine.prepare_forward()
        return step(*args, **kwargs)

    def training_step(self, lightning: Callable, args: tuple, kwargs: dict) -> Any:
        if self.engine is None:
            return self._prepared(lightning, args, kwargs)
        with self.engine.activation_context():  # offload_activations: the loss's saved tensors too
            return self._prepared(lightning, args, kwargs)

    def validation_step(self, lightning: Callable, args: tuple, kwargs: dict) -> Any:
        return self._prepared(lightning, args, kwargs)

    test_step = predict_step = validation_step

    def backward(self, lightning: Callable, closure_loss: Any, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        return lightning(closure_loss, optimizer, *args, **kwargs)  # ZeroPrecision.backward scales the loss

    def optimizer_step(self, lightning: Callable, optimizer: Any, closure: Any, model: Any, kwargs: dict) -> Any:
        return lightning(optimizer, closure, model, **kwargs)  # ZeroPrecision.optimizer_step -> engine.step()

    @contextlib.contextmanager
    def no_sync(self) -> Generator:
        if self.engine is None:
            yield None
            return
        with self.engine.no_sync():
            yield None

    # -- the end of a fit ---------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        if self.engine is not None:
            self.engine.average_rank_models()
            self.engine.restore_fp32_module()

    def teardown(self, failed: bool) -> None:
        """``failed``: an exception stopped the run (teardown must start no collective dead ranks never join)."""
        if self._unguard is not None:
            self._unguard()
            self._unguard = None
        if self._unbind_optimizers is not None:
            self._unbind_optimizers()
            self._unbind_optimizers = None
        if self.engine is not None:
            keep = self.engine.mode is EngineMode.TRAIN and not failed
            self.engine.remove(hand_back=not failed, keep_states=keep)  # [Note: NVMe states outlive teardown]
            if keep:
                # [Note: the trained state outlives fit] As DDP keeps its optimizer, a finished fit keeps
                # its engine, detached (no hooks, module whole), so save_checkpoint after fit (or after a
                # later validate/test) writes the optimizer state, loss scale and stage; released when
                # the next fit sets up. Memory: the masters and optimizer shards DDP would also hold.
                self.trained_engine = self.engine
            self.engine = None

    # -- checkpoints: what the strategy's hooks save and load, the ZeRO work in TrainerCheckpoints -------------
    def _engine_to_save(self) -> Optional[ZeroEngine]:
        """The engine whose state a save writes: the live one, else the detached one a finished fit left
        ([Note: the trained state outlives fit]), which first adopts the module's values (a method, not a
        property: it writes the masters): once fit is over the whole module is what the user holds."""
        if self.engine is not None:
            return self.engine
        trained = self.trained_engine
        if trained is not None:
            trained.load_masters_from_module()
        return trained

    def _optimizer_engine(self) -> Optional[ZeroEngine]:
        """The engine holding the optimizers' shards: the live training engine, else a finished fit's."""
        engine = self.engine
        return engine if engine is not None and engine.mode is EngineMode.TRAIN else self.trained_engine

    def lightning_module_state_dict(self, lightning: Callable) -> dict[str, Any]:
        s = self.strategy
        return s.checkpoints.module_state(s.lightning_module, self._engine_to_save(), lightning)

    def optimizer_state(self, lightning: Callable, optimizer: Any) -> dict[str, Any]:
        engine = self._optimizer_engine()
        return lightning(optimizer) if engine is None else self.strategy.checkpoints.optimizer_state(engine, optimizer)

    def save_checkpoint(self, lightning: Callable, checkpoint: dict[str, Any], filepath,
                        storage_options: Optional[Any]) -> None:
        s = self.strategy
        if not s.checkpoints.sharded:
            lightning(checkpoint, filepath, storage_options=storage_options)
        elif storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint(..., storage_options=...) is not supported for sharded "
                            "checkpoints (they do not go through CheckpointIO).")
        else:
            s.checkpoints.save(Path(s.broadcast(str(filepath))), checkpoint, s.lightning_module,
                               self._engine_to_save(), self._optimizer_engine(), s.barrier,
                               in_background=self.engine is not None)  # in a run: a later step reports failure
        if self.engine is None and self.trained_engine is not None:  # no step will stream them out again
            self.trained_engine.spill_states()

    def restore_checkpoint_after_setup(self, lightning: bool) -> bool:
        # sharded: load into the engine's masters, which exist only after setup (as FSDPStrategy does)
        return self.strategy.checkpoints.sharded or lightning

    def load_checkpoint(self, lightning: Callable, checkpoint_path, weights_only: Optional[bool]) -> dict[str, Any]:
        s = self.strategy
        # a URL: a local copy, one download per host ([Note: checkpoints at fsspec locations])
        path = resolve_checkpoint_dir(fetch_checkpoint(s.broadcast(str(checkpoint_path)), collective=True))
        if not path.is_dir():
            return lightning(path, weights_only=weights_only)
        return s.checkpoints.read(path, weights_only)

    def load_model_state_dict(self, lightning: Callable, checkpoint: Mapping[str, Any], strict: bool) -> None:
        s = self.strategy
        if not s.checkpoints.load_model(checkpoint, s.lightning_module, self.engine, strict):
            lightning(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        s = self.strategy
        s.checkpoints.load_optimizers(checkpoint, s.lightning_module, self.engine)
