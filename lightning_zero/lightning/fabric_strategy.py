"""ZeroFabricStrategy: ZeRO stages 0-3 under Lightning Fabric, on the same engine as the Trainer's strategy.

Like :class:`~lightning_zero.ZeroStrategy` it is a (Fabric) ``DDPStrategy`` -- launchers, cluster
environments, process groups and distributed samplers are Lightning's -- with the model side replaced:
``fabric.setup(model, optimizer)`` builds a :class:`~lightning_zero.engine.ZeroEngine` (no DDP wrapper;
the optimizer is sharded in place), ``fabric.backward`` scales the loss (fp16) and the engine's hooks
reduce(-scatter) gradients during backward, ``fabric.no_backward_sync`` is the engine's ``no_sync``,
``fabric.clip_gradients`` clips by the global norm over all shards, ``optimizer.step()`` /
``optimizer.zero_grad()`` go to the engine, ``fabric.init_module(empty_init=True)`` builds a stage-3
model on the meta device (materialized unit by unit, already sharded) and ``fabric.save`` /
``fabric.load`` write and read the Trainer's sharded checkpoint directories (``fabric_checkpoint.py``).

Several models (a GAN's generator and discriminator, a student and its frozen teacher): each
``fabric.setup(model_i, opt_i, ...)`` (or ``setup_module`` + ``setup_optimizers``) gives that model its
own engine over its own optimizers; a model set up without an optimizer gets an evaluation engine at
stage 3 (partitioned; stages 0-2: none, its weights broadcast from rank 0). ``fabric.backward(loss)``
needs no routing: each engine's gradient hooks reduce its own buckets in whichever backward reaches them
(a generator loss through the discriminator reduces both), ``optimizer.step()`` goes to the engine that
shards that optimizer, ``model.zero_grad()`` / ``fabric.no_backward_sync(model)`` /
``fabric.clip_gradients(model, opt)`` to that model's engine; ``fabric.strategy.engine_of(model)`` is one
model's engine (``fabric.strategy.engine`` while there is one). Parameters may not be shared between
models (two engines would shard the same tensor). Teardown hands every model back whole.

``tensor_parallel_size=T`` (stages 0-2, one model): ``fabric.launch()`` builds the ("data_parallel",
"tensor_parallel") mesh, ``fabric.strategy.device_mesh``; the model is cut by ``parallelize_fn(module,
device_mesh)`` in ``fabric.setup_module`` (Fabric's ModelParallelStrategy convention: then create the
optimizer over the cut module and ``fabric.setup_optimizers`` it), or by the user before ``fabric.setup``.
``fabric.setup_dataloaders`` splits by the data-parallel rank; checkpoints take the TP path
(``checkpoint/tp_state.py``) and load with or without TP.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.io import CheckpointIO
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer

from ..engine.plan import ShardingPlan
from ..engine import ZeroEngine
from ..engine.comm import collectives
from ..engine.stage3.deferred_init import has_meta_params, meta_init
from .compat import (FabricSubprocessScriptLauncher, fabric_forward_module,
                     fabric_module_strategy, fabric_module_wrapper)
from .fabric_checkpoint import FabricCheckpoints
from .fabric_models import SetUpModel, ZeroBackwardSyncControl
from .fabric_precision import ZeroFabricPrecision
from .sequence_parallel import SequenceParallelLayout, check_layout_world, data_split, ShardedLoader
from .tensor_parallel import TensorParallelLayout
from .async_saves import finish_saves
from .strategy_args import FABRIC as FABRIC_ARGS, bind, declare
from .zero_setup import (as_zero_precision, build_engine, check_strategy_knobs, checkpoint_base_of,
                         external_launcher, setup_default_group, register_presets, zero_config)


class ZeroFabricStrategy(DDPStrategy):
    """ZeRO data parallelism for Fabric: ``Fabric(strategy=ZeroFabricStrategy(stage=3, ...))`` or a
    registered name (``"zero0"`` ... ``"zero3_offload"``, each also ``_spawn`` / ``_fork``). The arguments
    mean what they mean for :class:`~lightning_zero.ZeroStrategy` (``lightning/strategy_args.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # one TypeError for anything else: Fabric's DDPStrategy would forward it to DistributedDataParallel
        knobs = bind("ZeroFabricStrategy", FABRIC_ARGS, args, kwargs)
        tensor_parallel_size, parallelize_fn = knobs["tensor_parallel_size"], knobs["parallelize_fn"]
        self.zero_config = zero_config(knobs)  # the arguments named like ZeroConfig fields
        check_strategy_knobs("ZeroFabricStrategy", knobs, dict(  # and the strategy's own
            accelerator=Accelerator, cluster_environment=ClusterEnvironment, checkpoint_io=CheckpointIO))
        self.tensor_parallel = TensorParallelLayout.of(tensor_parallel_size, self.zero_config)  # None without TP
        self.sequence_parallel = SequenceParallelLayout.of(knobs["sequence_parallel_size"])  # None without SP
        if parallelize_fn is not None and self.tensor_parallel is None:
            raise ValueError("parallelize_fn needs tensor_parallel_size=T (it is called with the 2-D device mesh). "
                             "Allowed: ZeroFabricStrategy(tensor_parallel_size=T, parallelize_fn=...).")
        self._parallelize_fn = parallelize_fn
        self.checkpoints = FabricCheckpoints(self, bool(knobs["trust_checkpoint"]), knobs["async_save"],
                                             checkpoint_base_of(knobs))
        super().__init__(**{k: knobs[k] for k in ("accelerator", "parallel_devices", "cluster_environment",
                                                  "checkpoint_io", "precision", "process_group_backend", "timeout",
                                                  "start_method")})
        self._backward_sync_control = ZeroBackwardSyncControl(self)
        self._models: list[SetUpModel] = []  # in setup order, each with its own engine

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def plan(self) -> ShardingPlan:
        """What the stage means ([Note: sharding plan], engine/plan.py): read instead of ``stage == ...``."""
        return ShardingPlan.of(self.zero_config)

    # -- precision: any precision flag becomes a ZeroFabricPrecision ----------------------------------
    @property
    def precision(self) -> ZeroFabricPrecision:
        if self._precision is None:
            self._precision = ZeroFabricPrecision("32-true")
        return self._precision

    @precision.setter
    def precision(self, plugin: Optional[Precision]) -> None:
        self._precision = as_zero_precision(plugin, ZeroFabricPrecision, MixedPrecision, Precision,
                                            "ZeroFabricStrategy", knob="precision")

    # -- model construction ---------------------------------------------------------------------------
    def _configure_launcher(self) -> None:  # torchrun / SLURM made the processes: start none (zero_setup.py)
        check_layout_world(self)  # the layout's sizes refused before any process starts
        if not external_launcher(self, FabricSubprocessScriptLauncher, rank_zero_info):
            super()._configure_launcher()

    def _setup_distributed(self) -> None:
        setup_default_group(self, super()._setup_distributed)  # torchrun restarts, teardown at exit

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.tensor_parallel is not None:  # fabric.strategy.device_mesh from fabric.launch() on
            self.tensor_parallel.build(self.world_size, self.root_device)
        if self.sequence_parallel is not None:
            self.sequence_parallel.build()

    # -- tensor parallelism: the layout is a collaborator (lightning/tensor_parallel.py) ---------------------------
    @property
    def device_mesh(self) -> Any:
        """The ("data_parallel", "tensor_parallel") DeviceMesh (``tensor_parallel_size`` only)."""
        return TensorParallelLayout.device_mesh_of(self.tensor_parallel, type(self).__name__)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return data_split(self) or super().distributed_sampler_kwargs  # TP / SP ranks sharing a batch

    # -- sequence parallelism: each batch cut to this rank's slice (lightning/sequence_parallel.py) ---------------
    def process_dataloader(self, dataloader: Any) -> Any:
        return dataloader if self.sequence_parallel is None else ShardedLoader(dataloader, self.sequence_parallel)

    def shard_batch(self, batch: Any) -> Any:  # this rank's slice of a batch a loop made itself
        return SequenceParallelLayout.shard_of(self.sequence_parallel, batch, type(self).__name__)

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Stage 3 with ``empty_init=True``: the model is built on the meta device and materialized by the
        engine unit by unit, already sharded, with the values of an eager build from the same seed."""
        if self.plan.shards_params and empty_init:
            return meta_init()
        return super().module_init_context(empty_init)

    def module_to_device(self, module: Module) -> None:
        if self.plan.shards_params and has_meta_params(module):
            return  # the engine materializes it shard by shard on the root device
        module.to(self.root_device)

    # -- setup: one engine per model ------------------------------------------------------------------
    @property
    def engine(self) -> Optional[ZeroEngine]:
        """The engine of the one model set up (None before any); with several models: :meth:`engine_of`."""
        if len(self._models) > 1:
            raise RuntimeError(f"ZeroFabricStrategy has {len(self._models)} models set up, each with its own "
                               "engine. Allowed: fabric.strategy.engine_of(model).")
        return self._models[0].engine if self._models else None

    def engine_of(self, module: Module) -> Optional[ZeroEngine]:
        """The engine of ``module`` (or of its Fabric wrapper); None for a model set up without one."""
        model = self._model_of(module)
        if model is None:
            raise ValueError(f"{type(module).__name__} is not a model set up under this Fabric. Allowed: a model "
                             "returned by fabric.setup(...) / fabric.setup_module(...).")
        return model.engine

    def _model_of(self, module: Module) -> Optional["SetUpModel"]:
        module = fabric_forward_module(module)  # Fabric's wrapper -> the module itself
        return next((m for m in self._models if m.module is module), None)

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler=None):
        model = self._adopt(module)
        module = model.module
        if self._parallelize_fn is not None:  # its new (DTensor) parameters are in no optimizer made before
            mine = {id(p) for p in module.parameters()}
            if any(id(p) not in mine for opt in optimizers for g in opt.param_groups for p in g["params"]):
                raise RuntimeError("parallelize_fn replaced the model's parameters, so the optimizer passed to "
                                   "fabric.setup(model, optimizer) holds stale ones. Allowed: model = "
                                   "fabric.setup_module(model), then the optimizer over model.parameters() and "
                                   "fabric.setup_optimizers(optimizer); or cut the model yourself "
                                   "(fabric.strategy.device_mesh) before creating the optimizer.")
        self._build(model, optimizers)
        return module, optimizers, scheduler

    def setup_module(self, module: Module) -> Module:
        """No wrapper. The training engine is built once the optimizers are known (``setup_optimizers``). At
        stage 3 the model is partitioned now by an evaluation engine (a frozen teacher set up without an
        optimizer stays so; a meta model is materialized, sharded, for its optimizer needs real parameters)
        and handed back whole to the training engine when its optimizer comes."""
        model = self._adopt(module)
        module = model.module
        if self.plan.shards_params:  # (tensor parallelism is stages 0-2)
            self._build(model, None)
        elif self.tensor_parallel is not None:  # TP ranks hold different pieces: over the DP dim only
            self.tensor_parallel.sync_module_states(module)
        elif collectives.world_size() > 1:  # every rank starts from rank 0's weights, as DDP's wrap does
            with torch.no_grad():
                collectives.broadcast_flat([p.data for p in module.parameters()] + list(module.buffers()), None)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if not self._models:
            raise RuntimeError("Set up the model first: fabric.setup_module(model), then "
                               "fabric.setup_optimizers(optimizer); or fabric.setup(model, optimizer).")
        model = self._owner_of(optimizer)
        # fabric.setup_optimizers(muon, adamw) hands them over one by one: the engine is built again over all
        self._build(model, model.optimizers_with(optimizer))
        return optimizer

    def _owner_of(self, optimizer: Optimizer) -> "SetUpModel":
        """The model set up whose parameters ``optimizer`` holds (a stage-3 model's are still its own
        Parameter objects, partitioned)."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for model in self._models:
            if ids and ids <= {id(p) for p in model.module.parameters()}:
                return model
        raise ValueError(f"The {type(optimizer).__name__} passed to fabric.setup_optimizers holds parameters of no "
                         f"single model set up ({len(self._models)} so far). Allowed: an optimizer over the "
                         "parameters of one model set up with fabric.setup_module(model).")

    def _adopt(self, module: Module) -> "SetUpModel":
        model = self._model_of(module)
        if model is not None:
            if model.engine is not None and model.engine.sharded is not None:
                raise ValueError(f"This {type(module).__name__} is already set up with its optimizer(s). Allowed: "
                                 "one fabric.setup(model, opt1, opt2, ...) per model.")
            return model
        if self._models and (self.tensor_parallel or self.sequence_parallel) is not None:
            knob = "tensor_parallel_size=T" if self.tensor_parallel is not None else "sequence_parallel_size=S"
            raise ValueError(f"ZeroFabricStrategy({knob}) sets up one model. Allowed: several models without "
                             "tensor or sequence parallelism, or one nn.Module holding them.")
        new = {id(p): n for n, p in module.named_parameters()}
        for other in self._models:
            shared = [new[id(p)] for p in other.module.parameters() if id(p) in new]
            if shared:  # two engines would each shard, step and publish the same tensor
                raise ValueError(f"The {type(module).__name__} set up shares {len(shared)} parameter(s) "
                                 f"({', '.join(shared[:5])}) with a {type(other.module).__name__} set up before. "
                                 "Allowed: models with disjoint parameters (each gets its own engine), or one "
                                 "nn.Module holding both, set up once with one optimizer per part.")
        if self._parallelize_fn is not None:
            module = self._parallelize_fn(module, self.device_mesh)
            if not isinstance(module, Module):
                raise TypeError(f"parallelize_fn must return the nn.Module it cut; got {type(module).__name__}.")
        if self.sequence_parallel is not None:  # Ulysses attentions before the engine sees the model
            self.sequence_parallel.apply(module)
        model = SetUpModel(module)
        self._models.append(model)
        return model

    def _build(self, model: "SetUpModel", optimizers: Optional[list[Optimizer]]) -> None:
        if model.engine is not None:  # the evaluation engine of a stage-3 model: whole again, then rebuilt
            self._release(model)
        module = model.module
        try:
            engine = build_engine(module, optimizers, self.zero_config, self.precision, self.root_device,
                                  device_mesh=TensorParallelLayout.mesh_of(self.tensor_parallel))
        except BaseException:
            if model in self._models:  # a failed setup adopts nothing: a corrected model can be set up next
                self._models.remove(model)
            raise
        model.engine = engine
        # Fabric calls the module, not a training_step: rank 0's buffers and (stage 3) the root unit before
        # each forward, as the Trainer strategy does around its steps
        model.handles = [module.register_forward_pre_hook(lambda *_: engine.prepare_forward())]

    def _release(self, model: "SetUpModel", hand_back: bool = True) -> None:
        for h in model.handles:
            h.remove()
        model.handles = []
        if model.engine is not None:
            self.precision.detach(model.engine)
            model.engine.remove(hand_back=hand_back)
            model.engine = None

    def zero_grad_module(self, module: Module, set_to_none: bool = True) -> None:
        """``model.zero_grad()`` on Fabric's wrapper (see :func:`install`): the engine's gradient shards are
        cleared with the parameters' ``.grad`` -- a GAN's discriminator, whose gradients the generator's
        backward also fills, would otherwise step on them later."""
        Module.zero_grad(module, set_to_none)  # parameters no optimizer holds, as torch does
        model = self._model_of(module)
        if model is not None and model.engine is not None:
            model.engine.zero_grad(set_to_none=set_to_none)

    def _training_engine(self, what: str, module: Optional[Module] = None,
                         optimizer: Optional[Optimizer] = None) -> ZeroEngine:
        """The training engine of ``module`` (or of the one sharding ``optimizer``), with one clear error."""
        engine = (self.precision.engine_for(optimizer) if module is None
                  else getattr(self._model_of(module), "engine", None))
        if engine is None or engine.sharded is None:
            raise RuntimeError(f"{what} under ZeroFabricStrategy needs the model and optimizer set up: "
                               "fabric.setup(model, optimizer).")
        if optimizer is not None and all(s.optimizer is not optimizer for s in engine.shardeds):
            raise ValueError(f"{what}: the {type(optimizer).__name__} is not an optimizer of this model. Allowed: "
                             "the model and an optimizer returned by the same fabric.setup(model, optimizer).")
        return engine

    # -- gradients -------------------------------------------------------------------------------------
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the 2-norm over every rank's gradient shards (one all-reduce); returns that norm."""
        if float(norm_type) != 2.0:
            raise ValueError(f"ZeroFabricStrategy clips by the global 2-norm only; got norm_type={norm_type!r}. "
                             "Allowed: norm_type=2.")
        engine = self._training_engine("fabric.clip_gradients", module, optimizer)
        total = engine.clip_grad_norm_(max_norm, optimizer)
        # with a loss scaler an overflow is expected and the step is skipped on every rank instead
        if error_if_nonfinite and engine.loss_scaler is None and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({total}),"
                               " so it cannot be clipped. To disable this error, set `error_if_nonfinite=False`.")
        return total

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self._training_engine("fabric.clip_gradients", module, optimizer).clip_grad_value_(clip_val, optimizer)

    # -- checkpoints: Fabric's hooks, the work in FabricCheckpoints (fabric_checkpoint.py) ---------------------
    @property
    def trust_checkpoint(self) -> bool:
        return self.checkpoints.trust_checkpoint

    def save_checkpoint(self, path, state: dict, storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        self.checkpoints.save(path, state, storage_options, filter)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None) -> dict:
        return self.checkpoints.load(path, state, strict, weights_only)

    def wait_for_checkpoint(self) -> None:
        """``async_save=True``: wait for the save in flight and raise its failure (``fabric.backward`` raises a
        failed one too, and teardown waits for the last)."""
        if self.checkpoints.saver is not None:
            self.checkpoints.saver.wait()

    def backward(self, tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> Any:
        if self.checkpoints.saver is not None:  # a background save that failed stops the run here, on every rank
            self.checkpoints.saver.raise_if_failed()
        return super().backward(tensor, module, *args, **kwargs)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict:
        """``optimizer.state_dict()``: the full state, consolidated from the shards (collective)."""
        return self._training_engine("optimizer.state_dict()", None, optimizer).optimizer_state_dict(optimizer)

    @contextlib.contextmanager
    def gathered_params(self, module: Optional[Module] = None):
        """Full parameters for a block of code (stage 3; no-op below): ``generate()``, export, inspection.
        ``module``: that model's only (default: every model set up)."""
        chosen = self._models if module is None else [self._model_of(module)]
        with contextlib.ExitStack() as stack:
            for model in chosen:
                if model is not None and model.engine is not None:
                    stack.enter_context(model.engine.gathered_params())
            yield

    def teardown(self) -> None:
        try:
            for model in self._models:  # every model handed back whole (stage 3), in fp32
                self._release(model)
            self._models = []
            self.precision.attach(None)
            super().teardown()
        finally:
            finish_saves(self.checkpoints.saver, failed=False)  # the last background save, its failure raised

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register_presets(cls, strategy_registry, what="ZeRO (Fabric)")


declare(ZeroFabricStrategy, FABRIC_ARGS)


def install() -> None:
    """``model.zero_grad()`` on Fabric's module wrapper reaches the engine (the optimizer wrapper needs nothing:
    the engine routes the optimizer's own methods, engine/optim/optimizer_routes.py)."""
    _install_module_zero_grad()


def _install_module_zero_grad() -> None:
    """``model.zero_grad()`` on Fabric's module wrapper reaches the engine under ZeroFabricStrategy
    (:meth:`ZeroFabricStrategy.zero_grad_module`): torch's would clear ``param.grad`` only, not the reduced
    gradient shards a backward left in the engine. torch's own ``Module.zero_grad`` for every other strategy."""
    _FabricModule = fabric_module_wrapper()

    if "zero_grad" in _FabricModule.__dict__:
        return

    def zero_grad(self, set_to_none: bool = True) -> None:
        strategy = fabric_module_strategy(self)
        if isinstance(strategy, ZeroFabricStrategy):
            strategy.zero_grad_module(fabric_forward_module(self), set_to_none)
        else:
            Module.zero_grad(self, set_to_none)

    _FabricModule.zero_grad = zero_grad
