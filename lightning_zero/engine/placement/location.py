"""Where bytes can live (:class:`Location`) and the kinds of training state placed there (:class:`StateKind`):
the vocabulary of [Note: placement] (placement.py), in a module of its own so that every store can name it."""

from __future__ import annotations

import enum
from typing import Union


class Location(enum.Enum):
    """Where bytes are: the compute device, (pinned) host memory, or a scratch file on local disk."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @property
    def off_device(self) -> bool:
        return self is not Location.DEVICE

    @classmethod
    def of_knob(cls, value: Union[bool, str, None]) -> "Location":
        """An offload knob's normalized value (False / True / "nvme", see ``ZeroConfig``) as a location."""
        return {False: cls.DEVICE, None: cls.DEVICE, True: cls.HOST, "nvme": cls.NVME}[value]


class StateKind(enum.Enum):
    PARAM_SHARDS = "param_shards"
    OPTIMIZER_STATES = "optimizer_states"
    GRAD_SHARDS = "grad_shards"
    ACTIVATIONS = "activations"
