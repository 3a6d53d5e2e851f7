"""Stores' I/O errors agreed on by every rank: one rank's failed read or write stops every rank with one error.

A store whose I/O can fail (``checks_io``: the NVMe scratch files) records its first failure in ``failure``
and goes on (its peers wait in collectives it takes part in); the engine's agreement after every step, the
setup's after the shards are spilled, an evaluation's at its end and a checkpoint save's before its first
collective raise it on every rank ([Note: verified scratch reads], nvme_checksums.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm import collectives as C
from .nvme_space import io_failure

STEP_LOST = "this step's update is lost, the checkpoints already saved are intact"


def agree_on_io(stores: list, group=None, device: Optional[torch.device] = None, lost: str = STEP_LOST) -> None:
    """After a step (or setup, or an evaluation): :func:`raise_if_any_rank_failed` over the stores whose I/O
    can fail (``checks_io``); no collective when none can (every rank's config chose the same stores)."""
    checked = [s for s in stores if s is not None and s.checks_io]
    if checked:
        raise_if_any_rank_failed(checked, group, device, lost)


def make_resident_on_every_rank(stores: list, group=None, device: Optional[torch.device] = None) -> None:
    """Before a whole view every rank takes (a checkpoint's save): every store read back into memory, and a
    read that failed or was damaged on one rank stops every rank with its error, through the step's one
    agreement, instead of that rank raising alone while its peers enter the save's collectives without it.
    ``stores``: state and parameter-shard stores (None skipped). Collective over ``group`` when a store's
    I/O can fail (``checks_io``); else no collective."""
    stores = [s for s in stores if s is not None]
    for s in stores:
        try:
            s.make_resident()
        except OSError as e:  # ScratchDamaged included
            if s.failure is None:
                s.failure = io_failure("read back for a whole view", s.file.path, e)
    agree_on_io(stores, group, device, lost="nothing was saved")


def raise_if_any_rank_failed(states: list, group=None, device: Optional[torch.device] = None,
                             lost: str = STEP_LOST) -> None:
    """After an NVMe step: one agreement over ``group`` (a 1-element all-reduce on ``device``, the compute
    device: NCCL reduces device tensors), so that a read or write that failed on one rank stops the run with
    one error on every rank, naming the rank, instead of the others hanging in their next collective. The
    step's update is not trusted anywhere then; checkpoints already saved are separate directories.
    ``states``: stores (anything with a ``failure`` and a ``knob``, None skipped);
    ``lost``: what is not to be trusted. The error is the failing rank's own (its knob, its words) on every rank."""
    failed_here = next((s for s in states if s is not None and s.failure is not None), None)
    mine = (failed_here.knob, failed_here.failure) if failed_here is not None else None
    rank = C.rank(group)
    failed = torch.tensor([rank + 1 if mine is not None else 0], dtype=torch.int64, device=device)
    if C.world_size(group) > 1:
        C.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=group)
    who = int(failed.item()) - 1
    if who < 0:
        return
    # a failure is the rare path: its words travel, so every rank raises the failing rank's error itself
    knob, what = C.all_gather_object(mine, group)[who]
    raise RuntimeError(f"{knob}='nvme': on rank {who}, {what}. The run stops on every rank; {lost}.")
