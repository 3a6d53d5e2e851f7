"""The whole sequence's loss on every rank of a sequence-parallel group ([Note: every rank computes the whole
loss] in gather_reduce.py).

A causal LM's rank sees the logits of its own positions only. Its share of the loss is the sum of its
positions' token losses over ``n_total``, the valid targets of the group's whole batch (known before the
batch was sliced), and the sum of the S shares is the mean token loss of the whole batch, which one process
on the whole sequence computes.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_zero.sequence_parallel.gather_reduce import all_reduce_sum
from lightning_zero.sequence_parallel.group_ref import SequenceGroup


def process_group(group: Any) -> Any:
    """A process group from what the public functions take: a process group, a ``SequenceGroup``, anything
    with a ``sequence_group`` (a ``SequenceSharding``), or None (the default group)."""
    group = getattr(group, "sequence_group", group)
    return group.group if isinstance(group, SequenceGroup) else group


def whole_sequence_loss(local_sum: torch.Tensor, n_total: torch.Tensor | int, group: Any = None) -> torch.Tensor:
    """The whole sequence's mean loss from this rank's ``local_sum`` (the sum of its positions' losses) and
    ``n_total`` (the valid targets of the sequence-parallel group's whole batch), the same on every rank of
    ``group``; its backward gives each rank's positions the gradient of the whole loss times S, which the
    engine's average over the S ranks turns into the whole loss's gradient."""
    return all_reduce_sum(local_sum / n_total, process_group(group))


class WholeSequenceLoss:
    """An HF model's ``loss_function`` under sequence parallelism: the model's own loss over this rank's
    positions, divided by the whole batch's target count (``num_items_in_batch``, from
    ``SequenceSharding.shard_batch``), summed over the group. Picklable: the group travels as a reference
    ([Note: a group that survives pickling])."""

    def __init__(self, inner: Callable, group: SequenceGroup):
        self.inner = inner
        self.group = group

    def __call__(self, logits, labels, vocab_size, **kwargs):
        missing = [k for k in ("shift_labels", "num_items_in_batch") if kwargs.get(k) is None]
        if missing and self.group.size > 1:
            raise ValueError(f"sequence parallelism's loss needs {' and '.join(missing)} in the model's "
                             "arguments: pass each batch through SequenceSharding.shard_batch (the labels are "
                             "shifted on the whole sequence and the loss is divided by the whole batch's valid "
                             "targets, before the batch is sliced).")
        local = self.inner(logits, labels, vocab_size, **kwargs)
        return all_reduce_sum(local, self.group.group) if not missing else local
