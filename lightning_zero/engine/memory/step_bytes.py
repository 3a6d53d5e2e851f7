"""The bytes one training step needs on CPU: the rule the tuner, the batch-size finder and the estimator share.

Design note
-----------
A CPU has no out-of-memory error to probe with, so "fits" is a stated rule, checked against a byte cap:

    step bytes = device-side model states held after backward (``engine.memory_report()``: params, grads,
                 gradient shards, masters, optimizer state, minus what lives on the host or on NVMe when offloaded)
               + at stage 3, the peak of gathered units above what is still gathered then
               + the optimizer state the step itself creates (the first step allocates it while the
                 gradients are still alive; read after the step)
               + the activations: every tensor autograd saves in the forward (``SavedBytes``: each storage
                 once, parameters excluded; offloaded activations are saved by the offload hook instead,
                 out of sight, so they count as host bytes) + with activation checkpointing the largest
                 recompute's saves in backward (``measure_recompute``).

Not counted: the allocator's slack and the transient peak inside one op (a matmul's output before the
previous is freed) -- nothing on CPU measures those honestly. A GPU measures everything instead
(``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

from .activations import SavedBytes, measure_recompute


def engine_memory(engine, finalize: bool = False) -> dict:
    """``engine.memory_report()`` as a dict, with stage 3's gathered-unit peak (``finalize``: complete the
    reductions first, as a bare-engine step does before its measurement)."""
    if finalize:
        engine.finalize_grads()
    mem = engine.memory_report().as_dict()
    if engine.partitions_params:
        mem["peak_gathered"] = engine.partitioner.peak_gathered_bytes
        mem["gathered_now"] = engine.partitioner.gathered_bytes()
    return mem


def step_device_bytes(mem: dict, activations: int, created_state: int = 0) -> int:
    """The rule of the module docstring from its measured parts: ``mem`` after backward
    (:func:`engine_memory`), ``activations`` (saved + recompute bytes), ``created_state`` (device bytes
    of optimizer state the step added)."""
    device = mem["model_states"] - mem.get("host", 0) - mem.get("nvme", 0)  # NVMe offload: on disk
    device += mem.get("peak_gathered", 0) - mem.get("gathered_now", 0)
    return int(device + created_state + activations)


class StepMeter:
    """Activations of one step: enter :meth:`forward` around the forward and loss, :meth:`backward` around
    backward (or call ``start_*`` / ``stop_*`` from hooks that bracket them)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.saved = SavedBytes(params)
        self.recompute_peak = 0
        self._fwd: Optional[contextlib.AbstractContextManager] = None
        self._bwd: Optional[contextlib.AbstractContextManager] = None
        self._rec = None

    @property
    def activations(self) -> int:
        return self.saved.bytes + self.recompute_peak

    def start_forward(self) -> None:
        self._fwd = self.saved.hooks()
        self._fwd.__enter__()

    def stop_forward(self) -> None:
        if self._fwd is not None:
            self._fwd.__exit__(None, None, None)
            self._fwd = None

    def start_backward(self) -> None:
        self._bwd = measure_recompute()
        self._rec = self._bwd.__enter__()

    def stop_backward(self) -> None:
        if self._bwd is not None:
            self._bwd.__exit__(None, None, None)
            self.recompute_peak = max(self.recompute_peak, self._rec.peak)
            self._bwd = self._rec = None

    def close(self) -> None:
        """Leave whatever is still open (a step that raised between the hooks)."""
        self.stop_forward()
        self.stop_backward()

    @contextlib.contextmanager
    def forward(self):
        self.start_forward()
        try:
            yield self
        finally:
            self.stop_forward()

    @contextlib.contextmanager
    def backward(self):
        self.start_backward()
        try:
            yield self
        finally:
            self.stop_backward()
