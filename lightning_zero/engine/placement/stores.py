"""The state stores a plan's placement names, built for one engine ([Note: placement]).

Parameter shards: the registered store of ``placement.param_store`` (param_store_registry.py). Masters +
optimizer state: one :class:`~.state_stores.StateStore` per ShardedOptimizer, by ``placement.optimizer_states``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..comm import collectives as C
from .location import Location
from .nvme_states import NvmeStates
from .state_stores import DeviceStates, HostStates, StateStore


def _nvme_states(config: Any, group: Any) -> StateStore:
    """One scratch file per rank and optimizer; ``group``: the ranks that agree on the files' space at setup
    ([Note: scratch space for the node])."""
    return NvmeStates(config.nvme_path, C.rank(), config.nvme_buffer_count, config.nvme_direct, group)


_STATE_STORES: dict[Location, Callable[[Any, Any], StateStore]] = {
    Location.DEVICE: lambda config, group: DeviceStates(),
    Location.HOST: lambda config, group: HostStates(),
    Location.NVME: _nvme_states,
}


def make_state_store(location: Location, config: Any, group: Any = None) -> StateStore:
    """A fresh store for one optimizer's masters and state at ``location`` (the plan's ``optimizer_states``)."""
    return _STATE_STORES[location](config, group)


def state_store_streams(location: Location) -> bool:
    """Whether the state store at ``location`` steps bucket by bucket through a ring (NVMe) rather than all at
    once: an optimizer kind that must see whole tensors asks before anything is sharded."""
    return {Location.DEVICE: DeviceStates, Location.HOST: HostStates, Location.NVME: NvmeStates}[location].streams
