"""The ranks' own models between 0/1 Adam's synchronizations: which tensors differ by rank, the one model they
stand for (their mean), and where that mean is used instead of this rank's values.

[Note: the ranks' own models]
From its variance freeze on, :class:`~.zoadam.ZeroOneAdam` takes *local steps*: each rank moves its parameters,
its momentum ``exp_avg`` and its accumulated update ``momentum_accumulator`` by its own gradient, and only every
``local_step_interval`` steps the accumulated updates are averaged (1-bit) and applied. Between two
synchronizations the ranks therefore hold N different models; after one they agree only up to rounding (the
local steps are undone by subtracting their sum, which does not restore the last synchronized weights bit for
bit), so once the variance is frozen these tensors are per rank for good (``rank_local_state()``).

Two questions follow, answered here once:

* **Exact resume.** A checkpoint writes each rank's own masters and those optimizer entries as per-rank rows
  (checkpoint/rank_local.py), beside its error buffers; a resume at the same world size reads its own row
  back, so the run continues bit for bit at any local step.
* **What the model is.** The mean of the ranks' parameters: the last synchronized weights plus the average
  of the ranks' accumulated updates -- what the next synchronization would apply, without its compression.
  A model that is one rank's would throw away the other ranks' work since the last synchronization. So the
  one-value-per-tensor entries of every checkpoint (what ``lightning-zero consolidate`` / ``export``,
  ``load_from_checkpoint``, ``trainer.validate(ckpt_path=...)`` and a load at another world size read) hold
  the mean, of ``exp_avg`` and ``momentum_accumulator`` too, which is itself a consistent state (parameters
  minus accumulated update is still the last synchronized point); when a fit ends the engine replaces
  every rank's parameters and these entries by the mean (:func:`average_rank_models`), so the module the
  Trainer hands back and evaluation after fit see that model; and validation inside fit evaluates the mean,
  swapped in for the loop and swapped out after it (:class:`MeanSwap`), so training continues from each
  rank's own parameters untouched.

The mean is one fp32 all-reduce of the tensors concerned (a sum, then divided by N), paid only where it is
used: a checkpoint, the end of fit, a validation loop.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ...comm import collectives as C
from ..kinds import kind_of


def rank_local_keys(optimizer: Any) -> tuple[str, ...]:
    """The state entries of ``optimizer`` that differ by rank now (with its parameters), or ``()``."""
    return tuple(kind_of(optimizer).rank_local_state(optimizer))


def diverged(engine: Any) -> list[tuple[Any, tuple[str, ...]]]:
    """(ShardedOptimizer, its rank-local state keys) of each optimizer whose ranks hold different models."""
    if engine is None or not getattr(engine, "shardeds", None):
        return []
    return [(s, keys) for s in engine.shardeds if (keys := rank_local_keys(s.optimizer))]


def rank_mean(tensors: list[torch.Tensor], group: Optional[Any]) -> list[torch.Tensor]:
    """The fp32 mean over the ranks of ``group`` of each tensor (new tensors, their shapes). One all-reduce."""
    if not tensors:
        return []
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    C.all_reduce(flat, group=group)
    flat.div_(C.world_size(group))
    return [f.view(t.shape) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _masters(s: Any) -> list[torch.Tensor]:
    return [m for row in s.masters for m in row]


def _entries(s: Any, keys: tuple[str, ...]) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """(master, key, state tensor) of every rank-local entry of ShardedOptimizer ``s``."""
    return [(m, k, s.optimizer.state[m][k]) for m in _masters(s) for k in keys if k in s.optimizer.state.get(m, {})]


def mean_masters(engine: Any) -> dict[int, torch.Tensor]:
    """``{id(master): mean over ranks}`` for every master of a diverged optimizer (collective; ``{}`` if none).
    During a :class:`MeanSwap` the masters hold it already."""
    out: dict[int, torch.Tensor] = {}
    for s, _ in diverged(engine):
        masters = _masters(s)
        if engine.mean_swap.active:
            out.update((id(m), m) for m in masters)
            continue
        out.update(zip(map(id, masters), rank_mean(masters, s.optimizer.process_group)))
    return out


def mean_state(s: Any) -> dict[tuple[int, str], torch.Tensor]:
    """``{(id(master), key): mean over ranks}`` of the rank-local state of ShardedOptimizer ``s`` (collective)."""
    keys = rank_local_keys(s.optimizer)
    entries = _entries(s, keys)
    means = rank_mean([t for _, _, t in entries], s.optimizer.process_group)
    return {(id(m), k): v for (m, k, _), v in zip(entries, means)}


@torch.no_grad()
def average_rank_models(engine: Any) -> bool:
    """Every rank's parameters and rank-local state replaced by their mean, then published (the end of fit;
    see the note). False (nothing done, no collective) when the ranks hold one model."""
    found = diverged(engine)
    if not found:
        return False
    for s, keys in found:
        entries = _entries(s, keys)
        masters = _masters(s)
        values = [*masters, *(t for _, _, t in entries)]
        for t, mean in zip(values, rank_mean(values, s.optimizer.process_group)):
            t.copy_(mean)
    engine.publish_params()
    return True


class MeanSwap:
    """The mean model swapped into the masters (and module) for an evaluation loop inside fit, this rank's own
    values kept and put back after it, so training continues exactly where it was (see the note)."""

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)  # the engine holds this object: no reference cycle keeping it alive
        self._kept: Optional[dict[int, tuple[torch.Tensor, torch.Tensor]]] = None  # id(master): (master, own)

    @property
    def active(self) -> bool:
        return self._kept is not None

    def own(self, master: torch.Tensor) -> torch.Tensor:
        """This rank's own value of ``master`` (a checkpoint saved while the mean is swapped in, e.g. by a
        ModelCheckpoint at a validation's end, writes it as the rank's row)."""
        if self._kept is None or id(master) not in self._kept:
            return master
        return self._kept[id(master)][1]

    @torch.no_grad()
    def swap_in(self) -> None:
        """The mean into the masters and module (collective; nothing when the ranks hold one model)."""
        engine = self._engine()
        found = diverged(engine)
        if self._kept is not None or not found:
            return
        means = mean_masters(engine)
        kept = {}
        for s, _ in found:
            for m in _masters(s):
                kept[id(m)] = (m, m.detach().clone())
                m.copy_(means[id(m)])
        self._kept = kept
        engine.publish_params()

    @torch.no_grad()
    def swap_out(self) -> None:
        """This rank's own masters back, published (no collective beyond the publish)."""
        if self._kept is None:
            return
        kept, self._kept = self._kept, None
        for m, own in kept.values():
            m.copy_(own)
        self._engine().publish_params()
