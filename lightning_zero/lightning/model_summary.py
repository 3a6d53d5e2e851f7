"""``ModelSummary`` under stage 3: a "Params per Device" column beside "Params", as Lightning's DeepSpeed
summary has.

Design note
-----------
Lightning's ``ModelSummary`` callback picks its summary class in ``_summary`` by asking whether the strategy
is DeepSpeed's. A ZeroStrategy at stage 3 answers on the callback objects of its own Trainer, for one fit
(:func:`bind`: an instance attribute, removed at teardown), so they build :class:`ZeroStage3Summary`; no
class of Lightning is changed and every other Trainer keeps Lightning's own choice. The summary runs
at ``on_fit_start``, after the engine has partitioned the model: the stage-3 parameters keep their full
shapes (the "Params" column stays the whole count) and each one's per-rank length comes from its unit's
shard layout (``ShardSpec.shard_len``: what this rank stores, padding excluded).
"""

from __future__ import annotations

import functools
from typing import Callable

from .compat import summary_max_depth

_COLUMN = "Params per Device"  # Lightning's spelling: RichModelSummary lays out a column of this name


def per_device_numel(engine) -> dict[int, int]:
    """{id(parameter): elements this rank stores} for every partitioned parameter."""
    return {id(p): spec.shard_len for u in engine.partitioner.units if u.layout is not None  # a root without params
            for p, spec in zip(u.layout.params, u.layout.specs)}


def _summary_class(ModelSummary, get_human_readable_count, NOT_APPLICABLE):
    class ZeroStage3Summary(ModelSummary):
        """Lightning's summary plus the per-device parameter count of each layer (and of the leftovers)."""

        def __init__(self, model, engine, max_depth: int = 1) -> None:
            self._per_device = per_device_numel(engine)
            super().__init__(model, max_depth=max_depth)

        def _local(self, module) -> int:
            return sum(self._per_device.get(id(p), p.numel()) for p in module.parameters())

        def _get_summary_data(self):
            arrays = super()._get_summary_data()
            names = [n for n, _ in arrays]
            layers = [self._local(layer._module) for layer in self._layer_summary.values()]
            column = list(map(get_human_readable_count, layers))
            if len(dict(arrays)["Params"]) > len(column):  # Lightning's row of parameters outside every layer
                column.append(NOT_APPLICABLE)
            arrays.insert(names.index("Params") + 1, (_COLUMN, column))
            return arrays

    return ZeroStage3Summary


def bind(trainer, engine) -> Callable[[], None]:
    """The trainer's ``ModelSummary`` callbacks (Rich's too) summarize ``engine``'s partitioned module for this
    fit; returns the undo for teardown."""
    from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
    from lightning.pytorch.utilities.model_summary import model_summary as summary_module

    cls = _summary_class(summary_module.ModelSummary, summary_module.get_human_readable_count,
                         summary_module.NOT_APPLICABLE)
    bound = [cb for cb in trainer.callbacks if isinstance(cb, ModelSummaryCallback)]
    for cb in bound:  # through compat's canary: ModelSummary._summary(trainer, pl_module) is the seam
        cb._summary = functools.partial(_summary, cb, cls, engine)
    return lambda: [cb.__dict__.pop("_summary", None) for cb in bound]


def _summary(cb, cls, engine, trainer, pl_module):
    return cls(pl_module, engine, max_depth=summary_max_depth(cb))
