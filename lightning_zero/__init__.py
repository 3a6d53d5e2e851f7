"""lightning_zero: ZeRO (stages 0-3, CPU offload, fp16/bf16) for PyTorch Lightning in pure PyTorch.

Importing the package registers the strategy names zero0, zero1, zero1_offload, zero2, zero2_offload,
zero3, zero3_offload (each also with a ``_spawn`` and a ``_fork`` variant) in Lightning's StrategyRegistry,
and lets Lightning's own loaders read its checkpoint directories (``lightning/lightning_io.py``). The same
names go into Fabric's registry for :class:`ZeroFabricStrategy` (``Fabric(strategy="zero3")``).

Layout: ``engine/`` is ZeRO on plain torch.distributed (``engine/stage3/`` the parameter partitioning),
``checkpoint/`` the sharded DCP directories, ``lightning/`` the adapter (the only code importing
Lightning), ``tools/`` the ``lightning-zero`` command line (estimate, tune, from-deepspeed). See
docs/ARCHITECTURE.md.
"""

from .engine import (
    DynamicLossScaler,
    LossScalerError,
    StaticLossScaler,
    ZeroConfig,
    ZeroEngine,
    model_state_floor,
    register_shardable_optimizer,
)
from .engine.stage3.join import RankDivergenceError
from .engine.stage3.pretrained import load_pretrained
from .lightning import ZeroPrecision, ZeroStrategy
from .lightning.fabric_precision import ZeroFabricPrecision
from .lightning.fabric_strategy import ZeroFabricStrategy
from .tools.deepspeed_config import DeepSpeedConfigError, DeepSpeedWarmupLR, from_deepspeed_config
from .tools.estimate import estimate_model_states
from .tools.tuning import tune

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


def _register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from .lightning import fabric_strategy
    from .lightning._pl_compat import register_pytorch_lightning
    from .lightning.lightning_io import install
    from .lightning.model_summary import install as install_model_summary

    ZeroStrategy.register_strategies(StrategyRegistry)
    ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
    fabric_strategy.install()  # Fabric's optimizer wrapper: zero_grad / add_param_group through the engine
    install()  # plain-DDP loads of ZeRO directories, ckpt_path="last" after an interrupted save
    install_model_summary()  # ModelSummary's "Params per Device" column under stage 3
    register_pytorch_lightning()  # the separate pytorch_lightning registry, when installed


_register()

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedWarmupLR",
    "DynamicLossScaler",
    "LossScalerError",
    "RankDivergenceError",
    "StaticLossScaler",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "__version__",
    "estimate_model_states",
    "from_deepspeed_config",
    "load_pretrained",
    "model_state_floor",
    "register_shardable_optimizer",
    "tune",
]
