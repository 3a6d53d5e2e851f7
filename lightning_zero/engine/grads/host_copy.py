"""Where the step reads the reduced gradient shards: chosen once from the placement ([Note: placement]).

With the optimizer states off the device (``plan.placement.grad_shards`` is HOST) each bucket's final shard
also goes to host memory as the bucket completes, in the reduce dtype (half the PCIe bytes of fp32), on the
reducer's side stream so device->host traffic overlaps the rest of backward; the optimizer reads it after one
synchronize. On a CPU-only run the shard already is in host memory and is read where it is. Otherwise the
step reads the shard itself. The reducer holds one of these and calls it on every boundary shard, with no
test of a knob on the way.
"""

from __future__ import annotations

import torch

from ..placement.placement import Location
from .bucket_rows import BucketRow


class OnDevice:
    """The step runs where the gradients were reduced: nothing to copy."""

    copies = False

    def keep(self, row: BucketRow) -> None:
        pass


class SameMemory:
    """A CPU-only run with host states: the reduced shard is the host copy."""

    copies = True

    def keep(self, row: BucketRow) -> None:
        row.host = row.shard


class PinnedCopy:
    """States in host memory, gradients on an accelerator: one pinned buffer per bucket, filled as it completes."""

    copies = True

    def keep(self, row: BucketRow) -> None:
        shard = row.shard
        if row.host is None:
            row.host = torch.empty(shard.shape, dtype=shard.dtype, device="cpu", pin_memory=shard.is_cuda)
        row.host.copy_(shard, non_blocking=True)  # CUDA: on the side stream, overlapping the rest of backward


def host_copy_for(where: Location, device: torch.device):
    """The host copy of a reducer whose shards live on ``device`` and are read by a step at ``where``."""
    if not where.off_device:
        return OnDevice()
    return SameMemory() if device.type == "cpu" else PinnedCopy()
