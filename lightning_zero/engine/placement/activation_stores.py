"""Activation stores: where the tensors autograd saves for backward live during a training step.

The plan's ``placement.activations`` ([Note: placement]) names the store: :class:`DeviceActivations` (autograd's
own, nothing moves) or :class:`HostActivations` (``offload_activations``: every saved tensor but parameters to
(pinned) host memory in forward, back for backward). ``ActivationMemory`` (engine/memory/activations.py)
enters the store's ``context`` around each training forward.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import nn

from .location import Location


def _is_param_storage(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors (not parameters, which stay where they are) go to host memory and come back for backward.

    On CUDA the host copies are pinned and both copies are asynchronous on the current stream (the caching
    allocators keep both buffers alive until their copy has run). ``offloaded_bytes`` counts what moved.
    """

    def __init__(self, owner: Any) -> None:
        # one host copy per tensor: a mask, a position bias or the encoder output that every block saves again
        # is copied once. Keyed by the tensor object, checked alive (a weak reference) and unmodified: a key
        # by storage address would hand a stale copy to a tensor allocated where a freed one was.
        self._copies: dict[int, tuple[weakref.ref, int, Any]] = {}

        def pack(t: torch.Tensor) -> Any:
            if _is_param_storage(t):
                return t
            hit = self._copies.get(id(t))
            if hit is not None and hit[0]() is t and hit[1] == t._version:
                return hit[2]
            pin = t.is_cuda
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            owner.offloaded_bytes += host.numel() * host.element_size()
            packed = (t.device, host)
            self._copies[id(t)] = (weakref.ref(t), t._version, packed)
            return packed

        def unpack(packed: Any) -> torch.Tensor:
            if torch.is_tensor(packed):
                return packed
            device, host = packed
            return host if device.type == "cpu" else host.to(device, non_blocking=True)

        super().__init__(pack, unpack)

    def __exit__(self, *exc: Any) -> None:
        self._copies.clear()  # the graph holds what it saved; the cache is only for this forward
        super().__exit__(*exc)


class DeviceActivations:
    """Saved tensors stay where autograd puts them."""

    moves_saved_tensors = False

    def context(self, owner: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class HostActivations:
    """Saved tensors to host memory (:class:`ActivationOffload`); ``owner.offloaded_bytes`` counts them."""

    moves_saved_tensors = True

    def context(self, owner: Any) -> contextlib.AbstractContextManager:
        return ActivationOffload(owner)


_STORES = {Location.DEVICE: DeviceActivations, Location.HOST: HostActivations}


def activation_store(where: Location):
    """The store of saved activations at ``where`` (DEVICE or HOST)."""
    return _STORES[where]()
