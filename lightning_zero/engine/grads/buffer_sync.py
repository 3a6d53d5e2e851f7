"""BufferBroadcast: rank 0's buffers copied to every rank exactly when torch's DDP would copy them.

[Note: buffer broadcast] torch's DDP broadcasts rank 0's buffers in a forward only if the previous forward
ran with grad enabled outside ``no_sync`` (its ``require_forward_param_sync``, set in ``_post_forward``; True
before the first), in train and eval mode alike. So under accumulation the boundary micro-batch keeps the
running statistics its rank's previous micro-batch wrote, and the first evaluation forward after a synced
step takes rank 0's. The same rule here, decided at the step's start (``ZeroEngine.prepare_forward``), which
sees the same grad mode and ``no_sync`` state as that step's forwards. An evaluation-only engine broadcasts
nothing: outside fit there is no DDP wrapper (and ranks may run uneven batches).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..comm import collectives as C


class BufferBroadcast:
    def __init__(self, module: nn.Module, group: Optional[Any], enabled: bool, eval_only: bool) -> None:
        self.module, self.group, self.enabled, self.eval_only = module, group, enabled, eval_only
        self._next = True  # DDP's require_forward_param_sync

    def due(self, reducer: Any) -> bool:
        """Whether this step's forwards broadcast (and what the next step's will see)."""
        if self.eval_only:
            return False
        due, self._next = self._next, torch.is_grad_enabled() and reducer.sync_enabled
        return due

    def sync(self) -> None:
        if C.world_size(self.group) > 1 and self.enabled:
            with torch.no_grad():
                C.broadcast_flat(list(self.module.buffers()), self.group)
