"""Parameter-shard stores: where stage 3's unit shards live between uses, behind one interface.

[Note: parameter-shard stores]
The partitioner cuts each unit's flat fp32 shard (this rank's slices, rank-major) and from then on never asks
where it lives: it asks the store the plan chose ([Note: placement], placement.py). A store answers, per unit:

    install(u, chunk)      take the just-cut fp32 shard (set ``u.shard``): on the device, in host memory, a file
    cast(u, dtype)         drop it to the compute dtype once the masters were taken from it
    readable(u)            a block in which ``u.shard`` holds its values (setup takes the masters from it)
    send_of(u)             the tensor the unit's all-gather sends (on the compute device's side of the copy)
    read_ahead(u)          a hint: ``u`` is gathered soon (``read_ahead_depth`` units beyond the prefetch)
    gather_done(u)         the all-gather no longer reads what ``send_of`` returned
    write_slices(u, pairs) the step's updated masters into their places in ``u``'s shard (the publish)

and for all its units: ``drop_reads`` (end of backward), ``spill`` (after every step: the shards back where
they live between uses), ``make_resident`` (whole views: checkpoints, loading), ``bytes_by_location``
(the memory report), ``ring_bytes`` (host buffers it streams through), ``failure`` / ``checks_io`` (its I/O
errors agreed on by every rank, placement/io_agreement.py) and ``close``. Two capabilities the optimizer and
the gathers read: ``masters_may_alias`` (an fp32 shard in memory may be the optimizer's master: the optimizer
then steps the shard itself) and ``gathers_one_at_a_time`` (a whole-model gather must complete unit by unit:
the store lends one buffer per gather).

The base class is a shard held in memory on ``keep_on`` (the compute device, or the host); its subclasses
are today's three cases: :class:`DeviceShards`, :class:`HostShards` and the NVMe file
(``nvme_params.NvmeParams``). A new store subclasses :class:`ParamShardStore` and is registered by name
(``lightning_zero.register_param_store``, param_store_registry.py); ``ZeroConfig(offload_params=<name>)`` picks it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .location import Location


@dataclass(frozen=True)
class ParamStoreSetup:
    """What a store's factory is given: ``units`` (stage 3's, every one; a unit without parameters has no
    shard), ``device`` (the compute device the gathers run on), ``shard_dtype`` (the dtype the shards hold
    after setup: the compute dtype of a training engine), the validated ``config`` (ZeroConfig), the global
    ``rank`` (file names) and ``group`` (the ranks that agree on anything at setup)."""

    units: list
    device: torch.device
    shard_dtype: torch.dtype
    config: Any
    rank: int
    group: Any = None


class ParamShardStore:
    """Unit shards in memory on :attr:`keep_on` ([Note: parameter-shard stores]). Subclass to keep them elsewhere."""

    location: Location = Location.HOST  # where the bytes are counted (the memory report)
    knob = "offload_params"  # what an I/O error names
    masters_may_alias = True
    gathers_one_at_a_time = False
    read_ahead_depth = 0
    checks_io = False  # whether failure can be set: then every rank agrees on it (placement/io_agreement.py)

    def __init__(self, device: torch.device, keep_on: Optional[torch.device] = None) -> None:
        self.device = device
        self.keep_on = keep_on if keep_on is not None else device
        self.pin = False  # pinned host memory: host<->device copies overlap
        self.units: dict[int, Any] = {}
        self.failure: Optional[str] = None

    # -- per unit --------------------------------------------------------------------------------
    def install(self, u, chunk: torch.Tensor) -> None:
        self.units[u.index] = u
        u.shard = self._placed(chunk)

    def _placed(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.keep_on)
        return t.pin_memory() if self.pin else t

    def cast(self, u, dtype: torch.dtype) -> None:
        u.shard = self._placed(u.shard.to(dtype))

    def readable(self, u) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def send_of(self, u) -> torch.Tensor:
        return u.shard.to(self.device, non_blocking=True)

    def read_ahead(self, u) -> None:
        pass

    def gather_done(self, u) -> None:
        pass

    @torch.no_grad()
    def write_slices(self, u, pairs, non_blocking: bool = True) -> None:
        """``pairs``: (source, master), each source a slice of ``u.shard`` (the bucket table's)."""
        for src, m in pairs:
            src.copy_(m, non_blocking=non_blocking)

    # -- all units --------------------------------------------------------------------------------
    def drop_reads(self) -> None:
        pass

    def spill(self) -> None:
        pass

    def make_resident(self) -> None:
        pass

    def shard_bytes(self) -> int:
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units.values() if u.shard is not None)

    def bytes_by_location(self) -> dict[Location, int]:
        return {self.location: self.shard_bytes()}

    @property
    def ring_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class DeviceShards(ParamShardStore):
    """The shards on the compute device (``offload_params=False``): a gather sends the shard itself."""

    location = Location.DEVICE

    def __init__(self, setup: ParamStoreSetup) -> None:
        super().__init__(setup.device)

    def _placed(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def send_of(self, u) -> torch.Tensor:
        return u.shard


class HostShards(ParamShardStore):
    """The shards in host memory, pinned on CUDA machines (``offload_params=True`` / ``"cpu"``); copied to
    the device by each gather. An fp32 shard is the optimizer's master itself (no second host copy)."""

    def __init__(self, setup: ParamStoreSetup) -> None:
        super().__init__(setup.device, torch.device("cpu"))
        self.pin = torch.cuda.is_available()
