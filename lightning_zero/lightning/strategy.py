"""ZeroStrategy: the thin Lightning adapter around :class:`~lightning_zero.engine.ZeroEngine`.

It reuses everything process-related from Lightning's DDP strategy -- launchers (popen script, spawn,
fork), cluster environments (torchrun, SLURM, ...), process-group init (NCCL on CUDA, gloo on CPU),
DistributedSampler arguments, reduce/all_gather/broadcast/barrier -- and replaces only the model side:
no DistributedDataParallel wrapper; after ``configure_optimizers`` the optimizer is sharded in place by
the engine; ``block_backward_sync`` becomes the engine's ``no_sync``; optimizer checkpoints are
consolidated (and re-sliced on load), so a run saved on N ranks at one stage resumes on M at another.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, Optional

import torch

from ..engine.plan import ShardingPlan
from ..engine import ZeroEngine
from ..engine.stage3.deferred_init import has_meta_params, meta_init
from ..engine.stage3.pretrained import load_pretrained, outermost_hf_model
from ..engine.engine_state import EngineMode
from .compat import (SubprocessScriptLauncher, is_last_batch, module_trainer, set_module_device_mesh,
                     sync_module_states, wrap_rank_zero_results)
from .callback_checks import check_callbacks, check_no_lightning_finder, weight_readers
from .even_inputs import check_even_inputs
from .checkpoint_strategy import ZeroCheckpointMixin
from .memory_summary import report as memory_report
from .tensor_parallel import TensorParallelLayout, TensorParallelMixin
from .optimizers import bind as bind_optimizers
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .precision import ZeroPrecision
from .strategy_args import TRAINER as TRAINER_ARGS, bind, declare
from .zero_setup import (as_zero_precision, build_engine, check_strategy_knobs, external_launcher,
                         setup_default_group, register_presets, zero_config)

_LIGHTNING_TYPES = dict(accelerator=Accelerator, cluster_environment=ClusterEnvironment,  # the knob -> its class
                        checkpoint_io=CheckpointIO)
_DDP_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
             "process_group_backend", "timeout", "start_method")  # Lightning's DDPStrategy takes these


def _whole(module: torch.nn.Module) -> bool:
    """Every parameter has its full storage (a stage-3 engine that did not hand the module back has not)."""
    return all(p.untyped_storage().nbytes() >= p.numel() * p.element_size() for p in module.parameters())


def _checked_weights_path(path: Any) -> Optional[str]:
    """``load_weights_from``: None, or a path that exists (a save_pretrained directory or a state-dict file)."""
    import os

    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)) or not os.path.exists(path):
        raise ValueError(f"load_weights_from={path!r}: no such directory or file. Allowed: None, a save_pretrained "
                         "directory (safetensors, sharded or not; pytorch_model.bin) or a state-dict file.")
    return os.fspath(path)


class ZeroStrategy(ZeroCheckpointMixin, TensorParallelMixin, DDPStrategy):
    """ZeRO data parallelism for Lightning: ``Trainer(strategy=ZeroStrategy(stage=3, ...))`` or a registered name
    (``"zero0"`` ... ``"zero3_offload"``, each also ``_spawn`` / ``_fork``). Pipeline parallelism is
    :class:`~lightning_zero.lightning.pipeline_strategy.ZeroPipelineStrategy` (the same arguments, plus
    ``pipeline_*``)."""

    strategy_name = "zero"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._init_strategy(bind("ZeroStrategy", TRAINER_ARGS, args, kwargs))

    def _init_strategy(self, knobs: dict[str, Any]) -> None:
        """The shared body of ZeroStrategy's and ZeroPipelineStrategy's constructors: ``knobs`` is the bound call."""
        checkpoint_format, tensor_parallel_size = knobs["checkpoint_format"], knobs["tensor_parallel_size"]
        self.zero_config = zero_config(knobs)  # the arguments named like ZeroConfig fields
        check_strategy_knobs(type(self).__name__, knobs, _LIGHTNING_TYPES)  # and the strategy's own
        self.checkpoint_format = checkpoint_format
        self.trust_checkpoint = bool(knobs["trust_checkpoint"])
        self.tensor_parallel = TensorParallelLayout.of(tensor_parallel_size, self.zero_config,  # None without TP
                                                       checkpoint_format)
        super().__init__(**{k: knobs[k] for k in _DDP_ARGS})
        self.engine: Optional[ZeroEngine] = None
        self._trained_engine: Optional[ZeroEngine] = None  # see [Note: the trained state outlives fit]
        self._failed = False
        self.memory_summary = knobs["memory_summary"]
        self.load_weights_from = _checked_weights_path(knobs["load_weights_from"])
        self._weights_loaded = False
        self._memory_reported = False
        self.memory_table: Optional[str] = None  # global rank 0: the table printed by this fit
        self._even_checked: Optional[tuple] = None  # (trainer, epoch) whose batch counts were compared
        self._unguard: Optional[Callable[[], None]] = None  # undoes the LR-scheduler guard of this setup
        self._unbind_optimizers: Optional[Callable[[], None]] = None  # undoes optimizers.bind

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def plan(self) -> ShardingPlan:
        """What the stage means ([Note: sharding plan], engine/plan.py): read instead of ``stage == ...``."""
        return ShardingPlan.of(self.zero_config)

    # -- precision: any precision flag becomes a ZeroPrecision -------------------------------------
    @property
    def precision_plugin(self) -> ZeroPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = as_zero_precision(plugin, ZeroPrecision, MixedPrecision, Precision, "ZeroStrategy")

    # -- setup ----------------------------------------------------------------------------------
    def model_to_device(self) -> None:
        if self.plan.shards_params and has_meta_params(self.model):
            return  # the engine materializes it shard by shard on the root device
        super().model_to_device()

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        if self.load_weights_from is not None and not self._weights_loaded:  # once: a later fit keeps training
            load_pretrained(outermost_hf_model(self.lightning_module), self.load_weights_from)
            self._weights_loaded = True
        precision = self.precision_plugin
        if trainer.state.fn == TrainerFn.FITTING:
            check_callbacks(trainer.callbacks, self.stage, precision.compute_dtype, self.checkpoint_format)
            self._trained_engine = None  # the previous fit's state gives way before the new one is built
            self.setup_optimizers(trainer)
            # several optimizers: each sharded on its own (disjoint parameters; see optimizers.py)
            self.engine = build_engine(self.lightning_module, self.optimizers, self.zero_config, precision,
                                       self.root_device, device_mesh=self._device_mesh)
            self._memory_reported = not self.memory_summary
            self._publish_before_hooks(trainer)
            self._guard_scheduler_on_skipped_steps()
            self._unbind_optimizers = bind_optimizers(self, trainer)
        else:
            # evaluation only: no optimizer. Weights stay fp32 (mixed precision runs under autocast, see
            # ZeroPrecision.forward_context), so validate/test/predict never round the user's model.
            if self.plan.shards_params:  # parameters still partitioned
                self.engine = build_engine(self.lightning_module, None, self.zero_config, precision, self.root_device)
            elif self.tensor_parallel is not None:  # TP ranks hold different pieces: over the DP dim only
                self.tensor_parallel.sync_module_states(self.model)
            else:  # every rank starts from rank 0's weights
                sync_module_states(self.model)
                precision.attach(self.engine, self.root_device.type)
        self.setup_precision_plugin()

    def _publish_before_hooks(self, trainer) -> None:
        """overlap_publish with a callback or module hook that may read the weights between a step and the
        next forward (EMAWeightAveraging, a user's on_train_batch_end): the step completes its all-gathers
        before returning, so they see every rank's update. Lightning's own bookkeeping callbacks keep the
        overlap (engine/publish.py)."""
        readers = weight_readers(trainer.callbacks, self.lightning_module) if self.engine.publisher is not None else []
        self.precision_plugin.ensure_published_after_step = bool(readers)
        if readers:
            rank_zero_info(f"overlap_publish: {', '.join(readers)} may read the weights between steps, so each "
                           "optimizer step completes its parameter all-gather before the hooks run.")

    def _guard_scheduler_on_skipped_steps(self) -> None:
        """A step skipped for overflow must not advance the LR schedule (as in DeepSpeed)."""
        module, engine = self.lightning_module, self.engine
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler, metric=None):
            if engine.last_step_skipped:
                return None
            return original(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # instance attribute; removed at teardown
        self._unguard = lambda: module.__dict__.pop("lr_scheduler_step", None)

    def setup_distributed(self) -> None:
        setup_default_group(self, super().setup_distributed)  # torchrun restarts, teardown at exit

    # -- tensor parallelism: device_mesh and the sampler split in TensorParallelMixin ------------------
    def setup_environment(self) -> None:
        trainer = module_trainer(self.lightning_module)
        if trainer is not None:  # before Lightning's BatchSizeFinder.setup refuses with no way out
            check_no_lightning_finder(trainer.callbacks)
        super().setup_environment()
        if self.tensor_parallel is not None:  # LightningModule.device_mesh in configure_model, as Lightning's
            set_module_device_mesh(self.lightning_module, self._build_device_mesh())

    def _configure_launcher(self) -> None:
        if not external_launcher(self, SubprocessScriptLauncher, rank_zero_info):
            super()._configure_launcher()
        if self.tensor_parallel is not None:  # fork/spawn: the weights sent back to the parent are whole
            wrap_rank_zero_results(self._launcher, self.tensor_parallel.whole_results)

    def _setup_model(self, model):  # no DDP wrapper: the engine's hooks do the reductions
        return model

    def configure_ddp(self) -> None:
        pass

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator:
        if self.engine is None:
            yield None
            return
        with self.engine.no_sync():
            yield None

    def _prepared(self, step, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:  # rank 0's buffers; stage 3: the root unit
            self.engine.prepare_forward()
        return step(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            return self._prepared(super().training_step, *args, **kwargs)
        with self.engine.activation_context():  # offload_activations: the loss's saved tensors too
            return self._prepared(super().training_step, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._joined(self._prepared(super().validation_step, *args, **kwargs))

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._joined(self._prepared(super().test_step, *args, **kwargs))

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._joined(self._prepared(super().predict_step, *args, **kwargs))

    def _joined(self, output: Any) -> Any:
        """After a rank's last evaluation batch, serve the stage-3 gathers of ranks that still have batches
        (uneven per-rank lengths: the predict sampler does not pad), so no rank blocks in a gather."""
        # through compat: a renamed loop attribute must fail, not silently drop the join (ranks would hang)
        if self.engine is not None and is_last_batch(module_trainer(self.lightning_module)):
            self.engine.join()
        return output

    @contextlib.contextmanager
    def gathered_params(self) -> Generator:
        """Full parameters for a block of code (stage 3; no-op below): ``generate()``, export.

        No collective runs inside, so ranks may run different numbers of forwards (unequal lengths).
        """
        if self.engine is None:
            yield
            return
        with self.engine.gathered_params():
            yield

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator:
        """``Trainer.init_module(empty_init=True)`` under stage 3 builds on the meta device (as FSDP does):
        the engine then materializes the model unit by unit, already sharded, with the same values as an
        eager build from the same seed (``reset_parameters`` in registration order)."""
        if self.plan.shards_params and empty_init:
            with meta_init():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator:
        """Stage 3: modules built in ``configure_model`` go to the meta device and are materialized
        unit by unit, already sharded, when the engine is created (no rank ever holds the whole model)."""
        if self.plan.shards_params:
            with meta_init():
                yield
        else:
            yield

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._check_even_inputs(batch_idx)
        if self.lightning_module.trainer.global_step >= 1:  # gradients and optimizer state exist now
            self._report_memory()

    def _check_even_inputs(self, batch_idx: int) -> None:
        """Different batch counts per rank: one clear error on every rank at the epoch's first batch instead of
        a hang ([Note: uneven training inputs], even_inputs.py)."""
        trainer = self.lightning_module.trainer
        key = (id(trainer), trainer.current_epoch)
        if self._even_checked != key:
            self._even_checked = key
            check_even_inputs(self, batch_idx)

    def _report_memory(self) -> None:
        """The model-state table (ZeRO beside DDP) on global rank 0 and the ``zero/*`` metrics, once per fit."""
        if not self._memory_reported and self.engine is not None and self.engine.sharded is not None:
            self._memory_reported = True
            self.memory_table = memory_report(self, self.lightning_module.trainer)

    def on_train_end(self) -> None:
        self._report_memory()  # a fit too short to reach a second batch
        if self.engine is not None:
            self.engine.restore_fp32_module()

    def teardown(self) -> None:
        if self._unguard is not None:
            self._unguard()
            self._unguard = None
        if self._unbind_optimizers is not None:
            self._unbind_optimizers()
            self._unbind_optimizers = None
        if self.engine is not None:
            self.engine.remove(hand_back=not self._failed)
            if self.engine.mode is EngineMode.TRAIN and not self._failed:
                # [Note: the trained state outlives fit] As DDP keeps its optimizer, a finished fit keeps
                # its engine, detached (no hooks, module whole), so save_checkpoint after fit (or after a
                # later validate/test) writes the optimizer state, loss scale and stage; released when
                # the next fit sets up. Memory: the masters and optimizer shards DDP would also hold.
                self._trained_engine = self.engine
            self.engine = None
        failed, self._failed = self._failed, False
        self.precision_plugin.attach(None)
        module = self.lightning_module
        if module is not None and (has_meta_params(module) or (failed and not _whole(module))):
            # a stage-3 setup that stopped before every unit had its values (or a failed run whose engine
            # kept its shards): nothing to move to the CPU -- meta tensors cannot be copied -- and the error
            # that stopped the run must stay the one the user sees
            module.__dict__["cpu"] = lambda: module
            try:
                super().teardown()
            finally:
                module.__dict__.pop("cpu", None)
            return
        super().teardown()

    def on_exception(self, exception: BaseException) -> None:
        # teardown must not start collectives (handing a stage-3 module back) that dead ranks never join
        self._failed = True
        super().on_exception(exception)

    # -- names ------------------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register_presets(cls, strategy_registry)


declare(ZeroStrategy, TRAINER_ARGS)
