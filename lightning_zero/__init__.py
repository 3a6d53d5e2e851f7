"""lightning_zero: ZeRO (stages 0-3, CPU offload, fp16/bf16) for PyTorch Lightning in pure PyTorch.

Importing the package registers the strategy names zero0, zero1, zero1_offload, zero2, zero2_offload,
zero3, zero3_offload (each also with a ``_spawn`` and a ``_fork`` variant) in Lightning's StrategyRegistry,
and lets ``LightningModule.load_from_checkpoint`` read its checkpoint directories (``lightning/lightning_io.py``;
other strategies read them through ``plugins=[ZeroCheckpointIO()]``). The same
names go into Fabric's registry for :class:`ZeroFabricStrategy` (``Fabric(strategy="zero3")``).

Layout: ``engine/`` is ZeRO on plain torch.distributed (``engine/stage3/`` the parameter partitioning),
``checkpoint/`` the sharded DCP directories, ``lightning/`` the adapter (the only code importing
Lightning), ``tools/`` the ``lightning-zero`` command line (estimate, tune, from-deepspeed). See
docs/ARCHITECTURE.md.
"""

import importlib
import importlib.abc
import sys
from typing import Any

# public name -> the module that defines it; resolved on first use (PEP 562), so ``import lightning_zero.engine``
# and ``lightning-zero --help`` load neither Lightning nor, for the CLI, torch
_PUBLIC = {
    "DeepSpeedConfigError": ".tools.deepspeed_auto",
    "DeepSpeedWarmupLR": ".tools.deepspeed_schedule",
    "DynamicLossScaler": ".engine.optim.loss_scaler",
    "LossScalerError": ".engine.optim.loss_scaler",
    "RankDivergenceError": ".engine.stage3.join",
    "StaticLossScaler": ".engine.optim.loss_scaler",
    "ZeroBatchSizeFinder": ".lightning.batch_size_finder",
    "ZeroCheckpointIO": ".lightning.checkpoint_io",
    "ZeroConfig": ".engine.config",
    "ZeroEngine": ".engine.engine",
    "ZeroFabricPrecision": ".lightning.fabric_precision",
    "ZeroFabricStrategy": ".lightning.fabric_strategy",
    "ZeroPipelineStrategy": ".lightning.pipeline_strategy",
    "ZeroPrecision": ".lightning.precision",
    "ZeroStrategy": ".lightning.strategy",
    "estimate_model_states": ".tools.estimate",
    "from_deepspeed_config": ".tools.deepspeed_config",
    "load_pretrained": ".engine.stage3.pretrained",
    "model_state_floor": ".engine.memory.floors",
    "muon_split": ".engine.optim.muon_split",
    "register_shardable_optimizer": ".engine.optim.kinds",
    "register_whole_tensor_optimizer": ".engine.optim.kinds",
    "register_param_store": ".engine.placement.param_store_registry",
    "ParamShardStore": ".engine.placement.param_stores",
    "ParamStoreSetup": ".engine.placement.param_stores",
    "OneBitAdam": ".engine.optim.onebit",
    "ZeroOneAdam": ".engine.optim.onebit",
    "tune": ".tools.tuning.tune",
}
_OLD_PATHS = ("strategy", "precision")  # lightning_zero.strategy / .precision: aliases of lightning/*


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    if name in _OLD_PATHS:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_PUBLIC))


__version__ = "0.1.0"


def _configure_logging() -> None:
    """The engine's setup lines (stage-3 units) at INFO, shown the way Lightning shows its own."""
    import logging

    logger = logging.getLogger(__name__)
    logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers():
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False


_configure_logging()


def _register_lightning() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from .lightning import batch_size_finder, fabric_strategy
    from .lightning.fabric_strategy import ZeroFabricStrategy
    from .lightning.lightning_io import install
    from .lightning.strategy import ZeroStrategy

    ZeroStrategy.register_strategies(StrategyRegistry)
    ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
    fabric_strategy.install()  # Fabric's module wrapper: model.zero_grad() through the engine
    install()  # LightningModule.load_from_checkpoint(DIR)
    batch_size_finder.install()  # Tuner.scale_batch_size under ZeroStrategy: the error names ZeroBatchSizeFinder


# [Note: names registered when Lightning is there]
# Lightning has no entry points for strategies: the names must be in its registry before a Trainer or Fabric
# resolves ``strategy="zero3"``. Importing Lightning here would make every import of the engine, the checkpoint
# reader or the CLI pay for Lightning (and through it transformers). So the names are registered now if
# ``lightning`` is already imported, else right after it is (a finder that runs the registration once the
# distribution's own ``__init__`` has finished) -- either import order works. Only the ``lightning`` distribution
# is supported: ``pytorch_lightning`` (a second copy of the same code with its own classes and registry) gets no
# names; use ``import lightning.pytorch as pl``.
_DISTRIBUTIONS = {"lightning": _register_lightning}


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _DISTRIBUTIONS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRegister(spec.loader, _DISTRIBUTIONS[fullname])
                return spec
        return None


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader, register) -> None:
        self.loader, self.register = loader, register

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.register()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self.loader, name)


def _register() -> None:
    # the finder first: the registration may import what triggers it
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
    for name, register in _DISTRIBUTIONS.items():
        if name in sys.modules:
            register()


_register()

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedWarmupLR",
    "DynamicLossScaler",
    "LossScalerError",
    "RankDivergenceError",
    "StaticLossScaler",
    "ZeroBatchSizeFinder",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroPipelineStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "__version__",
    "estimate_model_states",
    "from_deepspeed_config",
    "load_pretrained",
    "model_state_floor",
    "muon_split",
    "register_shardable_optimizer",
    "register_whole_tensor_optimizer",
    "register_param_store",
    "ParamShardStore",
    "ParamStoreSetup",
    "OneBitAdam",
    "ZeroOneAdam",
    "tune",
]
