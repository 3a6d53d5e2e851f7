"""Placement: where each kind of training state lives, decided once from the config.

[Note: placement]
Offload knobs are user-facing spellings (``offload_optimizer=True`` / ``"cpu"`` / ``"nvme"``,
``offload_params=...``, ``offload_activations``); the engine's parts need one answer per kind of state. As
FSDP2 turns ``CPUOffloadPolicy`` into a flag on each parameter once (``_fsdp_api.py``), ``Placement.of(config)``
turns the knobs into a :class:`Location` per :class:`StateKind` in one place, and ``ShardingPlan.placement``
carries it. The kinds:

    kind               what                                         where it can live
    PARAM_SHARDS       stage 3's unit shards between uses            DEVICE, HOST, NVME (or a registered store's)
    OPTIMIZER_STATES   fp32 masters + the optimizer's state          DEVICE, HOST, NVME
    GRAD_SHARDS        the reduced gradient shards the step reads    DEVICE, or HOST beside host optimizer states
    ACTIVATIONS        tensors autograd saves for backward           DEVICE, HOST

Bytes are booked by asking the placement where a kind lives (:meth:`Placement.book`), never by testing a knob,
so a model of memory (the estimator) and a measurement of it (``memory_report``) need no branch per target.
Which object serves a kind's bytes is a store, built from the placement: parameter shards by the store
named ``param_store`` ([Note: parameter-shard stores], param_stores.py; any registered one,
``register_param_store``), masters + optimizer state by ``state_store`` ([Note: optimizer-state stores],
state_stores.py), saved activations by ``activation_store`` (activation_stores.py). Code outside the stores
asks the store, never the knob or the location.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from .location import Location, StateKind
from .param_store_registry import param_store_location, param_store_name


@dataclass(frozen=True)
class Placement:
    """One :class:`Location` per :class:`StateKind` ([Note: placement])."""

    param_shards: Location = Location.DEVICE
    param_store: str = "none"  # the registered parameter-shard store that serves PARAM_SHARDS (param_store_registry.py)
    optimizer_states: Location = Location.DEVICE
    grad_shards: Location = Location.DEVICE
    activations: Location = Location.DEVICE

    @classmethod
    def of(cls, config: Any, shards_params: bool) -> "Placement":
        """The placement of a validated ``ZeroConfig`` (``shards_params``: the plan's; parameter shards exist
        only at stage 3)."""
        return cls.from_knobs(config.offload_optimizer, config.offload_params if shards_params else False,
                              getattr(config, "offload_activations", False))

    @classmethod
    def from_knobs(cls, offload_optimizer: Union[bool, str] = False, offload_params: Union[bool, str] = False,
                   offload_activations: bool = False) -> "Placement":
        """Also the estimator's what-if rows (knob values as ``ZeroConfig`` normalizes them)."""
        states = Location.of_knob(offload_optimizer)
        store = param_store_name(offload_params)
        return cls(param_shards=param_store_location(store), param_store=store, optimizer_states=states,
                   # the step reads the reduced shards where it runs: host memory for host or disk states
                   grad_shards=Location.HOST if states.off_device else Location.DEVICE,
                   activations=Location.HOST if offload_activations else Location.DEVICE)

    def where(self, kind: StateKind) -> Location:
        return getattr(self, kind.value)

    @property
    def steps_on_host(self) -> bool:
        """The optimizer step runs on the host (its states are not on the compute device)."""
        return self.optimizer_states.off_device

    def book(self, **bytes_by_kind: float) -> dict[Location, float]:
        """Bytes per location of ``kind=bytes`` pairs (``param_shards=..., optimizer_states=...``); every
        location is present (0 where nothing lives)."""
        out = {loc: 0.0 for loc in Location}
        for name, nbytes in bytes_by_kind.items():
            out[self.where(StateKind(name))] += nbytes
        return out
