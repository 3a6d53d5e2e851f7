"""The ZeRO engine: sharding, buckets, gradient reduction, master shards. Imports nothing from Lightning."""

from . import collectives
from .config import STAGES, ZeroConfig, parse_dtype
from .engine import ZeroEngine
from .engine_state import EngineMode, StepCounters
from .loss_scaler import DynamicLossScaler, LossScalerError, StaticLossScaler
from .memory import model_state_floor
from .memory_report import MemoryReport
from .optimizer import check_shardable, register_shardable_optimizer
from .sharding import ShardSpec

__all__ = [
    "STAGES",
    "DynamicLossScaler",
    "EngineMode",
    "LossScalerError",
    "MemoryReport",
    "ShardSpec",
    "StaticLossScaler",
    "StepCounters",
    "ZeroConfig",
    "ZeroEngine",
    "check_shardable",
    "collectives",
    "model_state_floor",
    "parse_dtype",
    "register_shardable_optimizer",
]
