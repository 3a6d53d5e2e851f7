"""Stage-3 evaluation with rank-dependent work: announce every gather, let finished ranks serve.

[Note: evaluation join]
-----------------------
In training the unit order is recorded once, verified across ranks and then trusted (prefetch needs it).
Evaluation is different: ranks may run different *numbers* of forwards (Lightning's predict sampler
does not pad, ``use_distributed_sampler=False`` loaders have per-rank lengths), and a stage-3 gather is a
collective, so a rank that has run out of batches would leave the others blocked in their next
all-gather until the process-group timeout (30 minutes by default). DDP has no collective in forward
and completes the same run.

So in eval mode every gather is *announced*: one tiny all-gather of the unit index (an int64 per rank)
precedes the all-gather of the unit's shards. The announcement makes two things possible:

* A rank that has finished its batches calls :func:`serve_until_all_joined` (Lightning: after its last
  evaluation step). It announces ``JOINED`` and, as long as any rank still announces a unit, takes part
  in that unit's all-gather with its own shard (the gathered values are the same whatever the rank is
  doing, so serving is exact), releasing it right away. When every rank announces ``JOINED`` all stop
  together. This is torch's ``Join`` / HF's ``synced_gpus`` for parameter gathers.
* Ranks that announce *different* units have diverged (a data-dependent skipped block, generation of
  different lengths outside ``gathered_params()``): every rank sees the same announcements, so all of
  them raise :class:`RankDivergenceError` at once, instead of exchanging mismatched buffers.

Cost: one 8-byte-per-rank all-gather per unit gather in eval mode only; training keeps its verified,
announcement-free order. ``order_check="off"`` turns announcements (and so joining) off.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm import collectives as C

JOINED = -1  # the announcement of a rank with no more evaluation work


class RankDivergenceError(RuntimeError):
    """Ranks executed different ZeRO-3 units: their collectives would not match."""


def announce(index: int, world_size: int, group, device: torch.device) -> list[int]:
    """All-gather one unit index (or JOINED) per rank; returns them in rank order."""
    mine = torch.tensor([index], dtype=torch.int64, device=device)
    ids = torch.empty(world_size, dtype=torch.int64, device=device)
    C.all_gather(ids, mine, group=group)
    return ids.tolist()


def agreed_unit(ids: list[int], describe: Callable[[int], str]) -> Optional[int]:
    """The one unit every working rank announced (None if all joined); divergence raises on every rank."""
    active = {i for i in ids if i != JOINED}
    if not active:
        return None
    if len(active) > 1:
        seen = ", ".join(f"rank {r}: {'<finished>' if i == JOINED else describe(i)}" for r, i in enumerate(ids))
        raise RankDivergenceError(
            f"ZeRO-3 ranks diverged: they are gathering different units ({seen}). Every rank must run the "
            "same modules in the same order; make rank-dependent modules part of the root unit "
            "(leave them out of unit_classes) or gather everything with strategy.gathered_params()."
        )
    return active.pop()


def serve_until_all_joined(world_size: int, group, device: torch.device, describe: Callable[[int], str],
                           serve: Callable[[int], None]) -> int:
    """Announce JOINED and serve the other ranks' gathers until every rank has joined.

    ``serve(index)`` takes part in the all-gather of unit ``index`` and releases it. Returns how many
    gathers were served (0 when every rank finished together: then this costs one tiny all-gather).
    """
    served = 0
    while True:
        index = agreed_unit(announce(JOINED, world_size, group, device), describe)
        if index is None:
            return served
        serve(index)
        served += 1
