"""PartitionedParams: the stage-3 side of an engine -- units built, parameters partitioned, units released
as their backward ends, and the end of every backward (also one no gradient of this engine flows through).

The engine builds one when its plan shards parameters ([Note: sharding plan] in engine/plan.py) and hands
it what it needs (the module, groups, the bucket table); nothing here writes into the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.autograd import Variable

from ..comm import collectives as C
from ..config import ZeroConfig
from ..placement.param_stores import ParamShardStore, ParamStoreSetup
from ..placement.placement import Placement
from ..placement.param_store_registry import make_param_store
from ..plan import ShardingPlan
from .deferred_init import compute_device
from .lifecycle import OrderCheck
from .partition import ParamPartitioner
from .release import BackwardReleaser
from .units import build_units

_log = logging.getLogger("lightning_zero.engine")


def stage3_config(cfg: ZeroConfig, n_optimizers: int) -> ZeroConfig:
    """The config in force: with several optimizers each runs its own forward/backward, so a step holds
    several different forward sequences, which one recorded order cannot describe: check before every
    gather instead."""
    if n_optimizers > 1 and OrderCheck(cfg.order_check) is OrderCheck.STRICT:
        return dataclasses.replace(cfg, order_check=OrderCheck.ALWAYS.value)
    return cfg


def param_store(cfg: ZeroConfig, placement: Placement, units: list, compute_dtype: Optional[torch.dtype],
                device: torch.device, eval_only: bool, group: Any) -> ParamShardStore:
    """The parameter-shard store the plan's placement names, for these units: the shards end setup in the
    compute dtype of a training engine (an evaluation-only engine keeps them fp32, never cast)."""
    cast = not eval_only and compute_dtype not in (None, torch.float32)
    return make_param_store(placement.param_store, ParamStoreSetup(
        units, device, compute_dtype if cast else torch.float32, cfg, C.rank(), group))


class PartitionedParams:
    def __init__(self, module: nn.Module, cfg: ZeroConfig, world_size: int, rank: int,
                 compute_dtype: Optional[torch.dtype], device: Optional[torch.device], shard_group: Any,
                 init_group: Any, eval_only: bool, placement: Optional[Placement] = None) -> None:
        """Partition ``module`` into units over ``shard_group`` (``cfg``: :func:`stage3_config`'s), their shards
        in the store ``placement`` names (default: the config's plan's)."""
        placement = placement if placement is not None else ShardingPlan.of(cfg).placement
        self.units = build_units(module, world_size, rank, cfg.unit_classes, cfg.unit_bytes, cfg.persist_numel)
        device = torch.device(device) if device is not None else compute_device(module)
        if rank == 0:
            _log.info(self.units.describe())
        # the store checks the space for every shard before any is cut (NVMe: each is spilled as cut)
        store = param_store(cfg, placement, self.units, compute_dtype, device, eval_only,
                            init_group if init_group is not None else shard_group)
        self.partitioner = ParamPartitioner(module, self.units, compute_dtype, device, store,
                                            shard_group, cfg.prefetch_depth, cfg.order_check, init_group=init_group,
                                            quantize=cfg.quantize_weights,
                                            reshard_after_forward=cfg.reshard_after_forward)
        self.partitioner.guard.eval_only = self.partitioner.eval_only = eval_only
        self.partitioner.on_backward = self._backward_begins
        self.releaser: Optional[BackwardReleaser] = None
        self._in_reduction: Callable[[], bool] = lambda: False
        self._backward_ends = 0  # how many backwards have ended (_backward_begins)
        self._end_queued = False

    def release_by_buckets(self, table, in_reduction: Callable[[], bool]) -> None:
        """Release each unit as soon as its backward is over: its gradient buckets of ``table`` complete (see
        release.py for units with frozen parameters). ``in_reduction``: the reducer is inside a backward."""
        self.releaser = BackwardReleaser.for_units(self.units, table.buckets, [r.unit for r in table.rows],
                                                   self.partitioner.release)
        self._in_reduction = in_reduction

    def add_rows(self, rows) -> None:
        for r in rows:
            self.releaser.add_bucket(r.bucket, r.unit)

    def bucket_complete(self, bi: int) -> None:
        self.releaser.bucket_complete(bi)

    def end_of_backward(self) -> None:
        self._backward_ends += 1
        self._end_queued = False
        self.partitioner.end_of_backward()
        if self.releaser is not None:
            self.releaser.reset()

    def _backward_begins(self) -> None:
        """A unit's backward begins: when no parameter of this engine gets a gradient in it (all frozen for
        now: a GAN's discriminator under the generator's loss; an evaluation engine the loss flows through)
        the reducer's callback never comes, so this one ends it (units released, order reset)."""
        if not self._end_queued:
            self._end_queued, ends = True, self._backward_ends
            Variable._execution_engine.queue_callback(lambda: self._end_if_not_ended(ends))

    def _end_if_not_ended(self, ends: int) -> None:
        self._end_queued = False
        if self._backward_ends == ends and not self._in_reduction():
            self.end_of_backward()  # else the reducer ended it, or its callback (queued after this) will

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered for a block of code (no autograd: the gathered values are read, not trained)."""
        with torch.no_grad(), self.partitioner.gathered():
            yield

    def remove(self) -> None:
        """Hooks off (the caller un-partitions the module first when it hands it back)."""
        if self.releaser is not None:
            self.releaser.remove()
