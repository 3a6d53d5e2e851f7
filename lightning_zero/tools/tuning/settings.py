"""Which presets a tuning search measures: the user's stages (labels) and ``offload`` choice, read as where
the optimizer's states live ([Note: placement]).

The NVMe presets are never measured: they hold on the device what their host-offload twins hold, so a
search of device memory learns nothing more from them.
"""

from __future__ import annotations

from typing import Sequence

from ...engine.placement.placement import Location
from ..estimate_states import SETTING_PLANS

# the ``offload`` choice -> where the searched presets keep their optimizer states
SEARCHED: dict[str, tuple[Location, ...]] = {"both": (Location.DEVICE, Location.HOST), "no": (Location.DEVICE,),
                                             "only": (Location.HOST,)}


def _presets_of_stage() -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, plan in SETTING_PLANS.items():
        out.setdefault(plan.stage, []).append(name)
    return out


# stage label -> its presets, in the preset table's order (keyed by the numbers the user passes as --stages)
PRESETS_OF_STAGE = _presets_of_stage()


def searched_locations(offload: str) -> tuple[Location, ...]:
    """The locations of optimizer states an ``offload`` choice searches; an unknown choice is one error."""
    try:
        return SEARCHED[offload]
    except (KeyError, TypeError):
        raise ValueError(f"offload must be 'both', 'no' or 'only'; got {offload!r}.") from None


def chosen_settings(stages: Sequence[int] | str = (0, 1, 2, 3), offload: str = "both") -> list[str]:
    """The presets of ``stages`` (a list or "0,1,2") whose optimizer states live where ``offload`` searches,
    in the preset table's order."""
    if isinstance(stages, str):
        stages = [int(s) for s in stages.split(",") if s.strip()]
    where = searched_locations(offload)
    wanted = {name for label in stages for name in PRESETS_OF_STAGE.get(label, ())}
    return [name for name, plan in SETTING_PLANS.items()
            if name in wanted and plan.placement.optimizer_states in where]
