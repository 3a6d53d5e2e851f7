"""Exact resume for the recipes' ``ckpt_path=`` in ``mode=fit``: where in the epoch the checkpoint was taken and
the random state at that moment.

Design note
-----------
Lightning restores the weights, optimizer, schedulers and loop counters, but a plain ``DataLoader`` restarts its
epoch from the first batch and the global RNG (dropout masks) is not saved, so a run resumed mid-epoch would see
other batches and other masks than the uninterrupted run. ``TrainPosition`` is a callback whose state (saved
with the checkpoint) is the number of batches this epoch has consumed and the RNG states; on load it tells the
datamodule to skip that many batches (``ResumableDataLoader`` discards them on its next iteration, so the
``DistributedSampler`` order of the epoch is the uninterrupted run's), and it puts the RNG states back once the
training loop has built its iterators (each draws a seed from the global RNG, as they did in the first run),
just before the first resumed batch. The recipes' strategies are ``DDPStrategy``s, so the train loader always
gets Lightning's ``DistributedSampler`` (order from seed and epoch, never from the global RNG), one device too. Ranks are seeded alike by the recipes (``seed_everything`` before the ranks start) and consume the same
random numbers, so rank 0's state, the one a checkpoint keeps, is every rank's.
"""
from __future__ import annotations

import random
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose next iteration starts ``skip_batches`` batches into the epoch (then 0 again).

    ``skip_batches`` is an ``__init__`` argument so that it survives Lightning re-creating the loader with a
    ``DistributedSampler``."""

    def __init__(self, *args: Any, skip_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_batches = int(skip_batches)

    def __iter__(self):
        it = super().__iter__()
        skip, self.skip_batches = self.skip_batches, 0
        if skip < len(self):  # a checkpoint taken at the end of an epoch resumes at the next one's start
            for _ in range(skip):
                next(it)
        yield from it


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()  # as plain values: weights_only loads them
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


class TrainPosition(L.Callback):
    """The checkpointed position in the epoch and RNG states (see the module note). ``datamodule`` must build
    its train loader as ``ResumableDataLoader(..., skip_batches=datamodule.skip_train_batches)``."""

    def __init__(self, datamodule: Any) -> None:
        self.datamodule = datamodule
        self.batches = 0
        self._rng: Optional[dict] = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._rng is None:  # not the epoch a checkpoint resumed into
            self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._rng is not None:  # after the loop built its iterators (each draws a seed), as the first run had
            _set_rng_state(self._rng)
            self._rng = None
        self.batches = batch_idx + 1  # consumed by the time any checkpoint of this batch is written

    def state_dict(self) -> dict:
        return {"batches": self.batches, "rng": _rng_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches = int(state_dict["batches"])
        self.datamodule.skip_train_batches = self.batches
        self._rng = state_dict["rng"]
