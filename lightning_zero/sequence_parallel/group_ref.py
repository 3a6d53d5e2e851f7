"""``SequenceGroup``: the sequence-parallel group as the model's modules hold it, picklable.

[Note: a group that survives pickling] A process group cannot be pickled or deep-copied, yet a model that
sequence parallelism changed must be (a spawn launcher pickles it, callbacks deep-copy it). The modules hold
this small reference instead: the group's global ranks, its size and this rank's place in it. The group
object itself lives in a per-process registry that ``apply_sequence_parallel`` fills; a reference unpickled
in another process finds it there once ``apply_sequence_parallel(model, group)`` ran in that process, and
says so in one error when it did not.
"""
from __future__ import annotations

from typing import Any

from lightning_zero.engine.comm import collectives

# global ranks -> the process group over them, this process's own
_GROUPS: dict[tuple[int, ...], Any] = {}  # None: the default group
_MISSING = object()


class SequenceGroup:
    """The ``S`` ranks that split one sequence: ``size``, ``rank`` (0 .. S-1, this rank's slice), ``ranks``
    (their global ranks) and ``group`` (the process group, resolved in this process)."""

    def __init__(self, group: Any = None):
        self.size = collectives.world_size(group)
        self.rank = collectives.rank(group)
        self.ranks = collectives.group_ranks(group) if self.size > 1 else (collectives.rank(),)
        if self.size > 1:
            _GROUPS[self.ranks] = group

    @property
    def group(self) -> Any:
        """The process group (None for one rank: every exchange is then the identity)."""
        if self.size == 1:
            return None
        group = _GROUPS.get(self.ranks, _MISSING)
        if group is _MISSING:
            raise RuntimeError(f"this model was split for sequence parallelism over ranks {list(self.ranks)} in "
                               "another process: call apply_sequence_parallel(model, group) in this one (the "
                               "process group cannot travel with the model).")
        return group

    def __getstate__(self) -> dict:
        return {"size": self.size, "rank": self.rank, "ranks": self.ranks}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"SequenceGroup(size={self.size}, rank={self.rank}, ranks={list(self.ranks)})"
