"""The engine's own state, named: what it was built for, and the count of skipped steps.

Design note
-----------
``EngineMode`` replaces the question "is ``engine.sharded`` None?": an engine built with ``optimizer=None``
is EVAL_ONLY -- no masters, no reducer, nothing to step; stage 3 still partitions the parameters, whose
unit shards then hold the values -- and one built with optimizers is TRAIN. Whether the parameters are
partitioned right now is a separate question (``ZeroEngine.partitions_params``): stage 3 until the module
is handed back whole.

``StepCounters`` is the one record of optimizer steps skipped for non-finite gradients. Whoever decides a
skip records it: the fp16 loss scaler (its ``update``; the count is part of its ``state_dict``) or, without
a scaler, the engine (``check_finite``, e.g. bf16). The engine uses its scaler's counters; the Lightning
precision plugin holds one object for its whole life (a count must outlive the engine of one ``fit``:
a checkpoint saved after ``fit``, the next ``fit`` carrying on) and hands it to each training engine it is
attached to. Checkpoints read and write the count through the engine. Nothing copies it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineMode(enum.Enum):
    TRAIN = "train"  # optimizer(s): masters, gradient reduction, step
    EVAL_ONLY = "eval_only"  # optimizer=None: forward only (stage 3 gathers units from their shards)


@dataclass
class StepCounters:
    """Steps skipped because some rank saw a non-finite gradient (every rank skips the same ones)."""

    skipped_steps: int = 0

    @classmethod
    def of(cls, loss_scaler) -> "StepCounters":
        """The counters an engine uses: its loss scaler's (the scaler records the skips it decides), else
        its own."""
        if loss_scaler is None:
            return cls()
        counters = getattr(loss_scaler, "counters", None)
        if not isinstance(counters, cls):
            raise TypeError(f"loss_scaler must be a DynamicLossScaler or a StaticLossScaler (or provide update(), "
                            f"scale and StepCounters as .counters); got {type(loss_scaler).__name__}.")
        return counters

    def record(self, skipped: bool) -> bool:
        self.skipped_steps += int(skipped)
        return skipped
