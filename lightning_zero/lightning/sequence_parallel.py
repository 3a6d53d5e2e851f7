"""``ZeroStrategy(sequence_parallel_size=S)`` / ``ZeroFabricStrategy(...)``: the groups, the data split, the model.

The strategies hold one :class:`SequenceParallelLayout` as ``self.sequence_parallel`` (None without the dim), as
they hold the tensor-parallel layout. What it does for them, and nothing else ([Note: sequence parallelism over
ZeRO], engine/layout/dims.py: the engine is unchanged):

* the groups of S consecutive ranks, made once per process when the processes exist (``setup_environment``);
* the sampler splits the data by the group's index, ``rank // S``: the S ranks of a group share each batch;
* the model's attentions become Ulysses ones over the group before the engine is built
  (``lightning_zero.sequence_parallel.apply_sequence_parallel``: it checks every attention's heads);
* every batch is cut to this rank's slice of the sequence -- by the Trainer's ``batch_to_device`` (training,
  validation, test, predict), by the dataloaders Fabric sets up (:class:`ShardedLoader`), or by
  ``strategy.shard_batch(batch)`` for batches a Fabric loop makes itself.

Imports nothing from Lightning.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from ..engine.layout.dims import ParallelDims
from ..engine.layout.groups import sequence_group


class SequenceParallelLayout:
    """The groups of ``sequence_parallel_size=S`` consecutive ranks, the data split, the model's attentions."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.group: Optional[Any] = None
        self.sharding: Optional[Any] = None  # the model's SequenceSharding once applied

    @classmethod
    def of(cls, size: Optional[int]) -> Optional["SequenceParallelLayout"]:
        """None without the dim, or with S = 1: nothing to cut (its type, stages and combinations: ZeroConfig,
        engine/layout/dims.py)."""
        return None if size is None or size == 1 else cls(size)

    def build(self) -> Any:
        """This rank's group (collective over the world the first time; made once per process)."""
        self.group = sequence_group(self.size)
        return self.group

    def sampler_kwargs(self, rank: int, world_size: int) -> dict:
        """The S ranks of a group read the same batches: split by the group's index."""
        return {"num_replicas": world_size // self.size, "rank": rank // self.size}

    def apply(self, module: Any) -> None:
        """Ulysses attentions over the group in ``module``. Each entry point of a Trainer calls it: applying again
        re-binds the model to the group and wraps nothing twice, so a later fit's module -- new, or the same one --
        is always the one split (no identity kept: a freed module's id can be a new one's)."""
        from ..sequence_parallel import apply_sequence_parallel

        self.sharding = apply_sequence_parallel(hf_model_in(module), self.group)

    @staticmethod
    def shard_of(layout: Optional["SequenceParallelLayout"], batch: Any, owner: str) -> Any:
        """A strategy's ``shard_batch``: the layout's cut, or one error naming the knob."""
        if layout is None:
            raise RuntimeError(f"{owner}.shard_batch cuts batches for sequence_parallel_size=S only.")
        return layout.shard(batch)

    def shard(self, batch: Any) -> Any:
        """This rank's slice of ``batch``'s sequences (the whole batch before the model was applied: S == 1)."""
        if self.sharding is None:
            raise RuntimeError("sequence_parallel_size: the batch is cut by the model's sequence sharding, which "
                               "exists once the model is set up (Trainer: setup; Fabric: fabric.setup(model)).")
        return self.sharding.shard_batch(batch)


def hf_model_in(module: Any) -> Any:
    """The outermost HF model in ``module`` (a LightningModule holding one as an attribute), else ``module``
    itself, whose refusal then names what sequence parallelism splits."""
    return next((m for m in module.modules() if hasattr(m, "config") and hasattr(m, "base_model_prefix")), module)


def check_layout_world(strategy: Any) -> None:
    """The tensor and sequence dims against the world the launcher will start (N = nodes x processes): one clear
    error naming the allowed sizes before any process starts (each is asked again once the groups are made)."""
    world = strategy.num_nodes * strategy.num_processes
    if strategy.tensor_parallel is not None:
        strategy.tensor_parallel.check_world(world)
    if strategy.sequence_parallel is not None:
        ParallelDims(sequence=strategy.sequence_parallel.size).check_world(world, ("sequence",))


def data_split(strategy: Any) -> Optional[dict]:
    """The sampler's split of a strategy with a tensor or sequence dim (None without): the T ranks of a tensor-
    parallel group, or the S ranks of a sequence-parallel one, read the same batches."""
    if strategy.tensor_parallel is not None:
        return strategy.tensor_parallel.sampler_kwargs()
    if strategy.sequence_parallel is not None:
        return strategy.sequence_parallel.sampler_kwargs(strategy.global_rank, strategy.world_size)
    return None


class ShardedLoader:
    """A dataloader whose batches come out as this rank's slice (Fabric's ``setup_dataloaders``); its sampler,
    batch sampler, dataset and length are the loader's own, so Fabric still sets the sampler's epoch."""

    def __init__(self, loader: Any, layout: SequenceParallelLayout) -> None:
        self.loader, self.layout = loader, layout

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "layout"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield self.layout.shard(batch)
