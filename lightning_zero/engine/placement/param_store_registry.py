"""The parameter-shard stores by name: today's three and any a user registers (``register_param_store``).

``ZeroConfig(offload_params=...)`` names one: False / ``"none"`` (:class:`~.param_stores.DeviceShards`), True /
``"cpu"`` (:class:`~.param_stores.HostShards`), ``"nvme"`` (:class:`~.nvme_params.NvmeParams`), or a name
registered here. Adding a store adds no branch anywhere: the placement records the name and its location
([Note: placement]), the stage-3 setup builds it from a :class:`~.param_stores.ParamStoreSetup`, and every
part asks it ([Note: parameter-shard stores]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from .location import Location
from .nvme_params import NvmeParams
from .param_stores import DeviceShards, HostShards, ParamShardStore, ParamStoreSetup

_KNOB_NAMES = {False: "none", True: "cpu"}  # the boolean spellings of offload_params


@dataclass(frozen=True)
class _Entry:
    factory: Callable[[ParamStoreSetup], ParamShardStore]
    location: Location


def _nvme_shards(setup: ParamStoreSetup) -> NvmeParams:
    """The ring: one slot per unit gathered ahead, one for the unit being gathered and ``nvme_buffer_count - 1``
    for reads ahead of those."""
    cfg = setup.config
    return NvmeParams(setup.units, setup.shard_dtype, cfg.nvme_path, setup.rank,
                      cfg.prefetch_depth + cfg.nvme_buffer_count,
                      pin=torch.cuda.is_available() and setup.device.type == "cuda", group=setup.group,
                      device=setup.device)


_BUILTIN = {"none": _Entry(DeviceShards, Location.DEVICE), "cpu": _Entry(HostShards, Location.HOST),
            "nvme": _Entry(_nvme_shards, Location.NVME)}
_PARAM_STORES: dict[str, _Entry] = dict(_BUILTIN)


def register_param_store(name: str, factory: Callable[[ParamStoreSetup], ParamShardStore],
                         location: Union[Location, str] = Location.HOST) -> None:
    """Make ``ZeroConfig(offload_params=name)`` keep stage 3's parameter shards in the store ``factory(setup)``
    returns (a :class:`~.param_stores.ParamShardStore`; ``setup``: a :class:`~.param_stores.ParamStoreSetup`).
    ``location``: where its bytes are counted ("device", "host" or "nvme"; the memory report, the floors).
    Registering a name again replaces its factory; the built-in names cannot be replaced."""
    if not isinstance(name, str) or not name.strip() or name.lower() != name:
        raise ValueError(f"register_param_store: the name must be a non-empty lower-case string (what "
                         f"offload_params takes); got {name!r}.")
    if name in _BUILTIN:
        raise ValueError(f"register_param_store: {name!r} is a built-in store. Allowed: a name other than "
                         f"{', '.join(map(repr, _BUILTIN))}.")
    if not callable(factory):
        raise TypeError(f"register_param_store: factory must be callable (setup -> ParamShardStore); got {factory!r}.")
    where = {v.value: v for v in Location}.get(location, location) if isinstance(location, str) else location
    if not isinstance(where, Location):
        raise ValueError(f"register_param_store: location must be one of "
                         f"{', '.join(repr(v.value) for v in Location)}; got {location!r}.")
    _PARAM_STORES[name] = _Entry(factory, where)


def param_store_knob(value, knob: str = "offload_params") -> Union[bool, str]:
    """``offload_params`` normalized: False, True, ``"nvme"`` or a registered name; else one error naming
    every allowed value (the built-in spellings and the registered stores)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _PARAM_STORES:
        name = value.lower()
        return {v: k for k, v in _KNOB_NAMES.items()}.get(name, name)
    names = ", ".join(map(repr, _PARAM_STORES))
    raise ValueError(f"{knob} must be True or False, or one of {names} (True = 'cpu'); got {value!r}.")


def param_store_name(knob_value) -> str:
    """The registered name behind a normalized ``offload_params`` (False -> "none", True -> "cpu")."""
    return {None: "none", **_KNOB_NAMES}.get(knob_value, knob_value)


def param_store_location(name: str) -> Location:
    return _entry(name).location


def make_param_store(name: str, setup: ParamStoreSetup) -> ParamShardStore:
    store = _entry(name).factory(setup)
    if not isinstance(store, ParamShardStore):
        raise TypeError(f"offload_params={name!r}: the registered factory returned {type(store).__name__}, "
                        f"not a ParamShardStore.")
    return store


def _entry(name: str) -> _Entry:
    try:
        return _PARAM_STORES[name]
    except KeyError:
        raise ValueError(f"offload_params={name!r} names no parameter-shard store. Allowed: "
                         f"{', '.join(map(repr, _PARAM_STORES))} (register more with "
                         f"lightning_zero.register_param_store).") from None
