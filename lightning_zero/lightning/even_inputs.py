"""Training with a different number of batches per rank: one clear error on every rank, at the epoch's start.

[Note: uneven training inputs]
Every training step issues collectives (stage 0: the gradient all-reduce; 1-2: reduce-scatters and the
parameter all-gather; 3: a gather per unit), so a rank that runs out of batches first leaves the others
blocked in their next collective until the process-group timeout (30 minutes), or pairs its own
end-of-fit collectives with their step's and exchanges mismatched buffers. Lightning's ``ddp`` does the
same. Lightning's DistributedSampler pads every rank to the same count; uneven lengths come from a
user's own sampler, ``use_distributed_sampler=False`` or per-rank datasets.

Training does not join (unlike evaluation, ``engine/stage3/join.py``): a finished rank would have to
mirror every collective of the others' steps (the reduce-scatters of zero gradients, the norm and
overflow all-reduces, the parameter all-gathers, stage 3's gathers in the recorded unit order) and every
rank would pay a per-step "still training?" all-reduce to know when to stop. So the lengths are
compared instead: at the first batch of every epoch each rank contributes the batches it will run this
epoch -- its loader's length (``trainer.num_training_batches``, after ``limit_train_batches``) less the
batches already done, capped by what ``max_steps`` still needs (``accumulate_grad_batches`` batches per
step) -- and that length, in one all-gather of two floats per rank (the strategy's Lightning collective, like
Lightning's own ``has_len_all_ranks``; not counted in the engine's ``comm_report``: no part of a step).
Different counts raise :class:`UnevenInputsError` on every rank, naming each rank's count.

Unknown lengths (an IterableDataset without ``__len__``: ``inf``, capped by ``max_steps`` like any other)
cannot be compared before they end: a stream that ends early on one rank hangs as under DDP, and keeping
the streams even is the user's part (``max_steps`` at most the shortest stream). A sized loader on some
ranks beside a stream on others never gets here: Lightning's own ``has_len_all_ranks`` (``fit_loop.
setup_data``) issues its collective only on the ranks whose loader has a length.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class UnevenInputsError(RuntimeError):
    """Ranks would run different numbers of training batches: their collectives would not match."""


def batches_this_epoch(trainer: Any, batch_idx: int) -> float:
    """The training batches this rank runs from ``batch_idx`` to the epoch's end (``inf``: unknown)."""
    left = float(trainer.num_training_batches) - batch_idx
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        left = min(left, float((trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches))
    return left


def check_even_inputs(strategy: Any, batch_idx: int) -> None:
    """Collective over the strategy's world: every rank raises the same error if the counts differ."""
    if strategy.world_size == 1:
        return
    trainer = strategy.lightning_module.trainer
    mine = [batches_this_epoch(trainer, batch_idx), float(trainer.num_training_batches)]
    counts = strategy.all_gather(torch.tensor(mine, dtype=torch.float64, device=strategy.root_device))
    counts = counts.reshape(-1, 2).cpu().tolist()
    if all(c[0] == counts[0][0] for c in counts):
        return

    def n(c: float) -> str:
        return "unknown (no __len__)" if math.isinf(c) else str(int(c))

    shown = ", ".join(f"rank {r}: {n(run)}" + (f" (of {n(total)})" if run != total else "")
                      for r, (run, total) in enumerate(counts))
    cap = f", max_steps={trainer.max_steps} capping each at what it still needs" if trainer.max_steps >= 0 else ""
    raise UnevenInputsError(
        f"The ranks would run different numbers of training batches in epoch {trainer.current_epoch} (from "
        f"batch {batch_idx}{cap}): {shown}. Every step is a collective, so a rank that runs out would leave the "
        f"others waiting in their next one. Allowed: the same number of batches on every rank (Lightning's "
        f"DistributedSampler pads them: use_distributed_sampler=True, the default), or limit_train_batches / "
        f"max_steps at most the shortest rank's count.")
