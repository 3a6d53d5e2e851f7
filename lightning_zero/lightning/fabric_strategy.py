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

``tensor_parallel_size=T`` (stages 0-2): ``fabric.launch()`` builds the ("data_parallel",
"tensor_parallel") mesh, ``fabric.strategy.device_mesh``; the model is cut by ``parallelize_fn(module,
device_mesh)`` in ``fabric.setup_module`` (Fabric's ModelParallelStrategy convention: then create the
optimizer over the cut module and ``fabric.setup_optimizers`` it), or by the user before ``fabric.setup``.
``fabric.setup_dataloaders`` splits by the data-parallel rank; checkpoints take the TP path
(``checkpoint/tp_state.py``) and load with or without TP.
"""

from __future__ import annotations

import contextlib
import inspect
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer

from ..engine import ZeroEngine, collectives
from ..engine.stage3.deferred_init import has_meta_params
from .fabric_checkpoint import ZeroFabricCheckpointMixin
from .fabric_precision import ZeroFabricPrecision
from .tensor_parallel import TensorParallelLayout, TensorParallelMixin, check_tensor_parallel_args
from .zero_setup import (as_zero_precision, build_engine, check_start_method, external_launcher,
                         register_presets, zero_config)


class ZeroFabricStrategy(ZeroFabricCheckpointMixin, TensorParallelMixin, DDPStrategy):
    """ZeRO data parallelism for Fabric: ``Fabric(strategy=ZeroFabricStrategy(stage=3, ...))`` or a
    registered name (``"zero0"`` ... ``"zero3_offload"``, each also ``_spawn`` / ``_fork``).

    Args: as :class:`~lightning_zero.ZeroStrategy` (stage, offload_optimizer, offload_params, bucket_mb,
    reduce_dtype, broadcast_buffers, the stage-3 unit options, start_method, process_group_backend,
    timeout, grad_reduce); ``precision``: a :class:`ZeroFabricPrecision` (else Fabric's ``precision=`` flag is mapped).
    ``tensor_parallel_size``: as the Trainer's (stages 0-2); ``parallelize_fn(module, device_mesh) -> module``
    cuts the model in ``fabric.setup_module`` (e.g. torch's ``parallelize_module`` over
    ``device_mesh["tensor_parallel"]``), as Lightning's Fabric ``ModelParallelStrategy`` does.
    """

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        bucket_mb: float = 25.0,
        reduce_dtype: Optional[Any] = None,
        broadcast_buffers: bool = True,
        unit_classes: Optional[Sequence[Any]] = None,
        unit_mb: Optional[float] = None,
        persist_numel: Optional[int] = None,
        prefetch: bool = True,
        order_check: str = "strict",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        shard_group_size: Optional[int] = None,
        activation_checkpointing: Optional[Any] = None,
        offload_activations: bool = False,
        grad_reduce: str = "auto",
        tensor_parallel_size: Optional[int] = None,
        overlap_publish: bool = False,
        quantize_weights: bool = False,
        quantize_grads: bool = False,
        parallelize_fn: Optional[Callable[[Module, Any], Module]] = None,
        trust_checkpoint: bool = False,
        **unknown: Any,
    ) -> None:
        if unknown:  # Fabric's DDPStrategy forwards extra kwargs to DistributedDataParallel; there is none here
            allowed = [n for n in inspect.signature(ZeroFabricStrategy.__init__).parameters
                       if n not in ("self", "unknown")]
            raise TypeError(f"ZeroFabricStrategy got unknown argument(s) {', '.join(sorted(unknown))}. "
                            f"Allowed: {', '.join(allowed)}.")
        self.zero_config = zero_config(locals())  # the arguments named like ZeroConfig fields
        check_tensor_parallel_args(dict(tensor_parallel_size=tensor_parallel_size, shard_group_size=shard_group_size))
        self.tensor_parallel = TensorParallelLayout.of(tensor_parallel_size, self.zero_config)  # None without TP
        if parallelize_fn is not None and self.tensor_parallel is None:
            raise ValueError("parallelize_fn needs tensor_parallel_size=T (it is called with the 2-D device mesh). "
                             "Allowed: ZeroFabricStrategy(tensor_parallel_size=T, parallelize_fn=...).")
        self._parallelize_fn = parallelize_fn
        self.trust_checkpoint = bool(trust_checkpoint)  # as ZeroStrategy's (docs/security.md)
        check_start_method(start_method)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self.engine: Optional[ZeroEngine] = None
        self._module: Optional[Module] = None  # the one model this strategy set up
        self._handles: list = []

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    # -- precision: any precision flag becomes a ZeroFabricPrecision ----------------------------------
    @property
    def precision(self) -> ZeroFabricPrecision:
        if self._precision is None:
            self._precision = ZeroFabricPrecision("32-true")
        return self._precision

    @precision.setter
    def precision(self, plugin: Optional[Precision]) -> None:
        self._precision = as_zero_precision(plugin, ZeroFabricPrecision, MixedPrecision, Precision,
                                            "ZeroFabricStrategy")

    # -- model construction ---------------------------------------------------------------------------
    def _configure_launcher(self) -> None:  # torchrun / SLURM made the processes: start none (zero_setup.py)
        if not external_launcher(self, _SubprocessScriptLauncher, rank_zero_info):
            super()._configure_launcher()

    def setup_environment(self) -> None:
        super().setup_environment()
        self._build_device_mesh()  # tensor_parallel_size: fabric.strategy.device_mesh from fabric.launch() on

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Stage 3 with ``empty_init=True``: the model is built on the meta device and materialized by the
        engine unit by unit, already sharded, with the values of an eager build from the same seed."""
        if self.stage == 3 and empty_init:
            return torch.device("meta")
        return super().module_init_context(empty_init)

    def module_to_device(self, module: Module) -> None:
        if self.stage == 3 and has_meta_params(module):
            return  # the engine materializes it shard by shard on the root device
        module.to(self.root_device)

    # -- setup -----------------------------------------------------------------------------------------
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler=None):
        module = self._adopt(module)
        if self._parallelize_fn is not None:  # its new (DTensor) parameters are in no optimizer made before
            mine = {id(p) for p in module.parameters()}
            if any(id(p) not in mine for opt in optimizers for g in opt.param_groups for p in g["params"]):
                raise RuntimeError("parallelize_fn replaced the model's parameters, so the optimizer passed to "
                                   "fabric.setup(model, optimizer) holds stale ones. Allowed: model = "
                                   "fabric.setup_module(model), then the optimizer over model.parameters() and "
                                   "fabric.setup_optimizers(optimizer); or cut the model yourself "
                                   "(fabric.strategy.device_mesh) before creating the optimizer.")
        self._build(optimizers)
        return module, optimizers, scheduler

    def setup_module(self, module: Module) -> Module:
        """No wrapper. The engine is built once the optimizers are known (``setup_optimizers``); a stage-3
        model on the meta device is materialized now, sharded (its optimizer needs real parameters)."""
        module = self._adopt(module)
        if self.stage == 3 and has_meta_params(module):
            self._build(None)
        elif self.tensor_parallel is not None:  # TP ranks hold different pieces: over the DP dim only
            self.tensor_parallel.sync_module_states(module)
        elif collectives.world_size() > 1:  # every rank starts from rank 0's weights, as DDP's wrap does
            with torch.no_grad():
                collectives.broadcast_flat([p.data for p in module.parameters()] + list(module.buffers()), None)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is None:
            raise RuntimeError("Set up the model first: fabric.setup_module(model), then "
                               "fabric.setup_optimizers(optimizer); or fabric.setup(model, optimizer).")
        if self.engine is not None and self.engine.sharded is not None:
            raise RuntimeError("ZeroFabricStrategy shards the optimizers of its model together, in one call. "
                               "Allowed: fabric.setup(model, opt1, opt2, ...) for several optimizers.")
        if self.engine is not None:  # the evaluation engine of a meta-built model: whole again, then sharded
            self._release()
            self.engine.remove(hand_back=True)
        self._build([optimizer])
        return optimizer

    def _adopt(self, module: Module) -> Module:
        if self._module is not None and self._module is not module:
            raise ValueError("ZeroFabricStrategy sets up one model (one engine shards it and its optimizers). "
                             "Allowed: one fabric.setup(model, ...) call; put several networks in one nn.Module.")
        if self._module is None and self._parallelize_fn is not None:
            module = self._parallelize_fn(module, self.device_mesh)
            if not isinstance(module, Module):
                raise TypeError(f"parallelize_fn must return the nn.Module it cut; got {type(module).__name__}.")
        self._module = module
        return module

    def _build(self, optimizers: Optional[list[Optimizer]]) -> None:
        module = self._module
        self.engine = engine = build_engine(module, optimizers, self.zero_config, self.precision, self.root_device,
                                            device_mesh=self._device_mesh)
        # Fabric calls the module, not a training_step: rank 0's buffers and (stage 3) the root unit before
        # each forward, as the Trainer strategy does around its steps
        self._handles = [module.register_forward_pre_hook(lambda *_: engine.prepare_forward())]

    def _release(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _training_engine(self, what: str) -> ZeroEngine:
        if self.engine is None or self.engine.sharded is None:
            raise RuntimeError(f"{what} under ZeroFabricStrategy needs the model and optimizer set up: "
                               "fabric.setup(model, optimizer).")
        return self.engine

    # -- gradients -------------------------------------------------------------------------------------
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the 2-norm over every rank's gradient shards (one all-reduce); returns that norm."""
        if float(norm_type) != 2.0:
            raise ValueError(f"ZeroFabricStrategy clips by the global 2-norm only; got norm_type={norm_type!r}. "
                             "Allowed: norm_type=2.")
        engine = self._training_engine("fabric.clip_gradients")
        total = engine.clip_grad_norm_(max_norm, optimizer)
        # with a loss scaler an overflow is expected and the step is skipped on every rank instead
        if error_if_nonfinite and engine.loss_scaler is None and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite ({total}),"
                               " so it cannot be clipped. To disable this error, set `error_if_nonfinite=False`.")
        return total

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self._training_engine("fabric.clip_gradients").clip_grad_value_(clip_val, optimizer)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict:
        """``optimizer.state_dict()``: the full state, consolidated from the shards (collective)."""
        return self._training_engine("optimizer.state_dict()").optimizer_state_dict(optimizer)

    @contextlib.contextmanager
    def gathered_params(self):
        """Full parameters for a block of code (stage 3; no-op below): ``generate()``, export, inspection."""
        with self.engine.gathered_params() if self.engine is not None else nullcontext():
            yield

    def teardown(self) -> None:
        self._release()
        if self.engine is not None:
            self.engine.remove(hand_back=True)
            self.engine = None
        self._module = None
        self.precision.attach(None)
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register_presets(cls, strategy_registry, what="ZeRO (Fabric)")


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: accumulate without reducing (no collective at stages 0-1;
    stage 2+ still reduces each micro-batch into its shard, as DeepSpeed does)."""

    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        engine = self._strategy.engine
        if engine is None or engine.reducer is None or engine.module is not module:
            raise TypeError("fabric.no_backward_sync(model) under ZeroFabricStrategy needs the model set up with "
                            "its optimizer: fabric.setup(model, optimizer).")
        return engine.no_sync()


def install() -> None:
    """``optimizer.zero_grad()`` / ``add_param_group`` on Fabric's optimizer wrapper go to the wrapped
    optimizer's own (the engine installs them on it): the wrapper subclasses the optimizer's class, so
    torch's methods would otherwise run on the master shards, past the engine's gradient shards. The same
    call for every other strategy: those optimizers' methods are torch's."""
    from lightning.fabric.wrappers import _FabricOptimizer

    for name in ("zero_grad", "add_param_group"):
        if name not in _FabricOptimizer.__dict__:
            setattr(_FabricOptimizer, name, _delegate(name))


def _delegate(name: str):
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._optimizer, name)(*args, **kwargs)

    method.__name__ = name
    return method
