"""ZeroStrategy: the thin Lightning adapter around :class:`~lightning_zero.engine.ZeroEngine`.

It reuses everything process-related from Lightning's DDP strategy -- launchers (popen script, spawn,
fork), cluster environments (torchrun, SLURM, ...), process-group init (NCCL on CUDA, gloo on CPU),
DistributedSampler arguments, reduce/all_gather/broadcast/barrier -- and replaces only the model side:
no DistributedDataParallel wrapper; after ``configure_optimizers`` the optimizer is sharded in place by
the engine; ``block_backward_sync`` becomes the engine's ``no_sync``; optimizer checkpoints are
consolidated (and re-sliced on load), so a run saved on N ranks at one stage resumes on M at another.

The model side is a collaborator, ``self.model_side`` (engine_side.py): the hooks that decide what is
trained and how a step runs hand it the call with Lightning's own implementation; the pipeline strategy
installs its own (pipeline_side.py) and keeps everything else here.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Generator, Mapping, Optional, Union

from ..engine.plan import ShardingPlan
from ..engine import ZeroEngine
from ..engine.stage3.deferred_init import has_meta_params, meta_init
from ..engine.engine_state import EngineMode
from .compat import (SubprocessScriptLauncher, is_last_batch, module_trainer, set_module_device_mesh,
                     wrap_rank_zero_results)
from .callback_checks import check_no_lightning_finder
from .engine_side import EngineSide
from .even_inputs import check_even_inputs
from .checkpoint_strategy import TrainerCheckpoints
from .memory_summary import report as memory_report
from .sequence_parallel import SequenceParallelLayout, check_layout_world, data_split
from .tensor_parallel import TensorParallelLayout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .precision import ZeroPrecision
from .async_saves import finish_saves
from .strategy_args import TRAINER as TRAINER_ARGS, bind, declare
from .zero_setup import (as_zero_precision, check_strategy_knobs, checkpoint_base_of, checked_weights_path,
                         external_launcher, is_whole, setup_default_group, register_presets, zero_config)

if TYPE_CHECKING:
    from .pipeline_side import PipelineSide

_LIGHTNING_TYPES = dict(accelerator=Accelerator, cluster_environment=ClusterEnvironment,  # the knob -> its class
                        checkpoint_io=CheckpointIO)
_DDP_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
             "process_group_backend", "timeout", "start_method")  # Lightning's DDPStrategy takes these


class ZeroStrategy(DDPStrategy):
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
        self.checkpoints = TrainerCheckpoints(checkpoint_format, bool(knobs["trust_checkpoint"]),  # the hooks use it
                                              knobs["async_save"], checkpoint_base_of(knobs))
        self.tensor_parallel = TensorParallelLayout.of(tensor_parallel_size, self.zero_config,  # None without TP
                                                       checkpoint_format)
        self.sequence_parallel = SequenceParallelLayout.of(knobs["sequence_parallel_size"])  # None without SP
        super().__init__(**{k: knobs[k] for k in _DDP_ARGS})
        # what is trained and how a step runs (engine_side.py; ZeroPipelineStrategy installs its own)
        self.model_side: Union[EngineSide, PipelineSide] = EngineSide(self)
        self._failed = False
        self.memory_summary = knobs["memory_summary"]
        self.load_weights_from = checked_weights_path(knobs["load_weights_from"])
        self._memory_reported = False
        self.memory_table: Optional[str] = None  # global rank 0: the table printed by this fit
        self._even_checked: Optional[tuple] = None  # (trainer, epoch) whose batch counts were compared

    @property
    def engine(self) -> Optional[ZeroEngine]:
        """The engine of this fit (or of this stage-3 evaluation); None outside one, and under pipeline
        parallelism (one engine per stage chunk: ``ZeroPipelineStrategy.pipe.engines``)."""
        return self.model_side.engine

    @engine.setter
    def engine(self, engine: Optional[ZeroEngine]) -> None:
        self.model_side.engine = engine

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def checkpoint_format(self) -> str:
        return self.checkpoints.checkpoint_format

    @checkpoint_format.setter
    def checkpoint_format(self, value: str) -> None:
        self.checkpoints.checkpoint_format = value

    @property
    def trust_checkpoint(self) -> bool:
        return self.checkpoints.trust_checkpoint

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
        if trainer.state.fn == TrainerFn.FITTING:
            self._memory_reported = not self.memory_summary  # the table is printed once per fit
        if self.sequence_parallel is not None:  # Ulysses attentions before the engine sees the model
            self.sequence_parallel.apply(self.lightning_module)
        self.model_side.setup(trainer)

    def setup_distributed(self) -> None:
        setup_default_group(self, super().setup_distributed)  # torchrun restarts, teardown at exit

    # -- tensor parallelism: the layout is a collaborator (lightning/tensor_parallel.py) ---------------------------
    @property
    def device_mesh(self) -> Any:
        """The ("data_parallel", "tensor_parallel") DeviceMesh (``tensor_parallel_size`` only)."""
        return TensorParallelLayout.device_mesh_of(self.tensor_parallel, type(self).__name__)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return data_split(self) or super().distributed_sampler_kwargs  # TP / SP ranks sharing a batch

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.sequence_parallel is not None:  # every loop's batch comes through here: this rank's slice
            batch = self.sequence_parallel.shard(batch)
        return batch

    def setup_environment(self) -> None:
        trainer = module_trainer(self.lightning_module)
        if trainer is not None:  # before Lightning's BatchSizeFinder.setup refuses with no way out
            check_no_lightning_finder(trainer.callbacks)
        super().setup_environment()
        if self.tensor_parallel is not None:  # LightningModule.device_mesh in configure_model, as Lightning's
            set_module_device_mesh(self.lightning_module, self.tensor_parallel.build(self.world_size,
                                                                                    self.root_device))
        if self.sequence_parallel is not None:
            self.sequence_parallel.build()

    def _configure_launcher(self) -> None:
        check_layout_world(self)  # the layout's sizes refused before any process starts
        if not external_launcher(self, SubprocessScriptLauncher, rank_zero_info):
            super()._configure_launcher()
        if self.tensor_parallel is not None:  # fork/spawn: the weights sent back to the parent are whole
            wrap_rank_zero_results(self._launcher, self.tensor_parallel.whole_results)

    def _setup_model(self, model):  # no DDP wrapper: the engine's hooks do the reductions
        return model

    def configure_ddp(self) -> None:
        pass

    # -- what is trained and how a step runs: the model side (engine_side.py; the pipeline's: pipeline_side.py) ----
    def block_backward_sync(self) -> ContextManager:
        return self.model_side.no_sync()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.checkpoints.saver is not None:  # a background save that failed stops the run here, on every rank
            self.checkpoints.saver.raise_if_failed()
        return self.model_side.training_step(super().training_step, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._joined(self.model_side.validation_step(super().validation_step, args, kwargs))

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._joined(self.model_side.test_step(super().test_step, args, kwargs))

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._joined(self.model_side.predict_step(super().predict_step, args, kwargs))

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return self.model_side.backward(super().backward, closure_loss, optimizer, args, kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return self.model_side.optimizer_step(super().optimizer_step, optimizer, closure, model, kwargs)

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

    # 0/1 Adam between synchronizations: validation inside fit and the model fit ends with are the ranks' mean
    # ([Note: the ranks' own models], engine/optim/onebit/local_models.py)
    def on_validation_start(self) -> None:
        if self.engine is not None and self.engine.mode is EngineMode.TRAIN:
            self.engine.mean_swap.swap_in()
        super().on_validation_start()

    def on_validation_end(self) -> None:
        if self.engine is not None:
            self.engine.mean_swap.swap_out()
        super().on_validation_end()

    def on_train_end(self) -> None:
        self._report_memory()  # a fit too short to reach a second batch
        self.model_side.on_train_end()

    def teardown(self) -> None:
        failed, self._failed = self._failed, False
        try:
            self._teardown(failed)
        finally:
            finish_saves(self.checkpoints.saver, failed)  # the last background save: waited for, its failure raised

    def _teardown(self, failed: bool) -> None:
        self.model_side.teardown(failed)
        self.precision_plugin.attach(None)
        module = self.lightning_module
        if module is not None and (has_meta_params(module) or (failed and not is_whole(module))):
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

    # -- checkpoints: what is saved is the model side's; the directory work its collaborator's
    # (TrainerCheckpoints, checkpoint_strategy.py; the pipeline's: pipeline_checkpoint_strategy.py) ---------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.model_side.lightning_module_state_dict(super().lightning_module_state_dict)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self.model_side.optimizer_state(super().optimizer_state, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        self.model_side.save_checkpoint(super().save_checkpoint, checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            self.checkpoints.remove(filepath)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return self.model_side.restore_checkpoint_after_setup(super().restore_checkpoint_after_setup)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self.model_side.load_checkpoint(super().load_checkpoint, checkpoint_path, weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.model_side.load_model_state_dict(super().load_model_state_dict, checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self.model_side.load_optimizer_state_dict(checkpoint)

    # -- names ------------------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register_presets(cls, strategy_registry)


declare(ZeroStrategy, TRAINER_ARGS)
