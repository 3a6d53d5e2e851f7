"""The ZeRO engine: sharding, buckets, gradient reduction, master shards. Imports nothing from Lightning."""

from .comm import collectives
from .config import STAGES, ZeroConfig, parse_dtype
from .engine import ZeroEngine
from .engine_state import EngineMode, StepCounters
from .optim.loss_scaler import DynamicLossScaler, LossScalerError, StaticLossScaler
from .memory.floors import model_state_floor
from .memory.report import MemoryReport
from .optim.kinds import check_shardable, register_shardable_optimizer, register_whole_tensor_optimizer
from .placement.param_store_registry import register_param_store
from .placement.param_stores import ParamShardStore, ParamStoreSetup
from .layout.sharding import ShardSpec

__all__ = [
    "STAGES",
    "DynamicLossScaler",
    "EngineMode",
    "LossScalerError",
    "MemoryReport",
    "ParamShardStore",
    "ParamStoreSetup",
    "ShardSpec",
    "StaticLossScaler",
    "StepCounters",
    "ZeroConfig",
    "ZeroEngine",
    "check_shardable",
    "collectives",
    "model_state_floor",
    "parse_dtype",
    "register_param_store",
    "register_shardable_optimizer",
    "register_whole_tensor_optimizer",
]
