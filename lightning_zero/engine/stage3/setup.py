"""How an engine becomes a stage-3 engine: units built, parameters partitioned, gradient buckets per unit.

One function so that ``ZeroEngine.__init__`` reads as the list of its parts; everything it makes is an
engine attribute that the rest of the engine reads (``partitioner``, ``buckets``, ``releaser``, ...).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from .. import param_groups as PG
from ..config import ZeroConfig
from ..engine_state import EngineMode
from .deferred_init import compute_device
from .lifecycle import OrderCheck
from .partition import ParamPartitioner
from .release import BackwardReleaser
from .units import build_units

if TYPE_CHECKING:
    from ..engine import ZeroEngine

_log = logging.getLogger("lightning_zero.engine")


def setup_stage3(engine: "ZeroEngine", per_opt: list[list[nn.Parameter]],
                 device: Optional[torch.device]) -> ZeroConfig:
    """Partition ``engine.module`` into units over ``engine.shard_group``; returns the config in force."""
    cfg = engine.config
    if len(engine.optimizers) > 1 and OrderCheck(cfg.order_check) is OrderCheck.STRICT:
        # each optimizer runs its own forward/backward: a step holds several different forward sequences,
        # which one recorded order cannot describe. Check before every gather instead.
        cfg = dataclasses.replace(cfg, order_check=OrderCheck.ALWAYS.value)
    module = engine.module
    units = build_units(module, engine.world_size, engine.rank, cfg.unit_classes, cfg.unit_bytes, cfg.persist_numel)
    device = torch.device(device) if device is not None else compute_device(module)
    if engine.rank == 0:
        _log.info(units.describe())
    engine.partitioner = ParamPartitioner(module, units, engine.compute_dtype, device, cfg.offload_params,
                                          engine.shard_group, cfg.prefetch, cfg.order_check, init_group=engine.group,
                                          quantize=cfg.quantize_weights)
    engine.partitioner.guard.eval_only = engine.mode is EngineMode.EVAL_ONLY
    engine.buckets, engine._bucket_opt, engine._sources, engine._bucket_unit = PG.build_optimizer_buckets(
        engine, per_opt, units)
    # releases each unit as soon as its backward is over (see release.py for units with frozen params)
    engine.releaser = BackwardReleaser.for_units(units, engine.buckets, engine._bucket_unit, engine.partitioner.release)
    # The caller gives reduce-scatters their own group: they interleave with gathers differently per rank.
    # Made once per process and shared by later engines (see [Note: why a group is never re-created] in
    # groups.py); an evaluation-only engine reduces nothing and needs none.
    return cfg
