"""The two states a backward is in, as the reducer sees them: where it is (``BackwardPhase``) and what its
gradients are for (``GradSync``, set by ``no_sync``)."""

from __future__ import annotations

import enum


class BackwardPhase(enum.Enum):
    """Where the reducer is in a backward: IDLE between backwards (an un-synced backward -- stages 0-1
    under ``no_sync`` -- stays IDLE: its gradients only accumulate, noted in the rows' ``dirty``), REDUCING from
    the first synced gradient hook to the end-of-backward callback, which completes every bucket."""

    IDLE = "idle"
    REDUCING = "reducing"

    def check(self, to: "BackwardPhase") -> "BackwardPhase":
        if to is self:
            raise RuntimeError(f"GradReducer: already {self.name} (a backward inside a backward?).")
        return to


class GradSync(enum.Enum):
    """What a micro-batch's backward does with its gradients, set for the whole backward by ``no_sync``:
    BOUNDARY (the default: the last micro-batch of a step, whose reductions give the step's gradients) or
    ACCUMULATE (an earlier one: stages 0-1 issue no collective and only note the buckets touched in
    ``dirty`` rows, reduced by the next ``finalize``; stages 2-3 still reduce into the gradient shard, but an
    offloaded shard is copied to the host only at the boundary)."""

    BOUNDARY = "boundary"
    ACCUMULATE = "accumulate"
