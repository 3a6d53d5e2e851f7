"""BucketRow: one gradient bucket and everything kept about it, in one object.

What the bucket is -- its parameters' flat layout, the optimizer that owns it, at stage 3 its unit and the
unit-shard slices its masters come from -- and what the reducer has made of it since the last clear: this
rank's reduced shard, its host copy, how many ranks had each parameter's gradient, hybrid sharding's
unreplicated sum, whether this backward reduces it and how many of its gradients are ready. The reducer fills
rows; the optimizer reads the rows of its buckets; a bucket added after setup (``add_param_group``) is one
row appended, so no per-bucket list can fall out of step with another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .buckets import Bucket


@dataclass(eq=False)
class BucketRow:
    bucket: Bucket
    optimizer: int  # index into the engine's optimizers: the one that steps this bucket's masters
    sources: Optional[list[torch.Tensor]] = None  # stage 3: this rank's unit-shard slice per parameter
    unit: Optional[Any] = None  # stage 3: the unit whose backward completes this bucket
    # -- what the reducer made of it (reducer.py) ------------------------------------------------------
    shard: Optional[torch.Tensor] = None  # this rank's reduced slice (stages 1-3), summed over micro-batches
    host: Optional[torch.Tensor] = None  # its host copy for an offloaded step (host_copy.py); may be ``shard``
    used: Optional[torch.Tensor] = None  # per parameter, how many ranks had a gradient (fp32, on the device)
    unreplicated: Optional[torch.Tensor] = None  # hybrid: shard + counts not yet summed over the replicas
    active: bool = True  # reduced in this backward (False: every parameter has requires_grad=False)
    ready: int = 0  # gradients complete in this backward
    dirty: bool = False  # local gradients that no collective has seen yet (stages 0-1 under no_sync)

    @property
    def index(self) -> int:
        return self.bucket.index

    @property
    def complete(self) -> bool:
        return self.ready == len(self.bucket.params)

    def step_grads(self) -> Optional[torch.Tensor]:
        """The flat reduced gradients the step reads: the host copy when there is one, else the shard."""
        return self.host if self.host is not None else self.shard

    def add_reduced(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (this micro-batch's reduced slice) summed into the shard; the shard returned."""
        if self.shard is None:
            self.shard = out
        else:
            self.shard.add_(out)
        return self.shard

    def count_users(self, counts: torch.Tensor) -> None:
        self.used = counts if self.used is None else self.used + counts

    def take_used(self) -> torch.Tensor:
        """The counts of users so far (zeros if nothing was reduced), handed over: the next step counts anew."""
        used, self.used = self.used, None
        return used if used is not None else torch.zeros(len(self.bucket.params))

    def drop(self) -> None:
        """Every reduced gradient of the bucket gone (``zero_grad(set_to_none=True)`` of all its parameters)."""
        self.shard = self.host = self.unreplicated = self.used = None
        self.dirty = False
        for p in self.bucket.params:
            p.grad = None
