"""``estimate``'s low-precision rows: each setting's model states with fp32 optimizer states, with bf16 moments
(``optimizer_state_dtype="bf16"``) and with bf16 moments + bf16 masters (``master_dtype="bf16"`` too).

Each row is the setting's plan with the two dtypes replaced, through the engine's one model
(``engine/memory/floors.py`` ``rank_model_states``, [Note: low-precision states in the memory model]) with the
engine's padding, as the main table's rows; bytes per parameter are a rank's bytes over the model's Psi. The step's
transient is one bucket's slice widened to fp32 (``floors.low_precision_step_bytes``), on the device or the host,
where the step runs. A bf16 master needs bf16 compute; a whole-tensor optimizer (owner-rank step) takes neither knob.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine.memory.floors import low_precision_step_bytes
from ..engine.placement.placement import Location
from ..engine.plan import ShardingPlan
from .estimate_states import plan_state_bytes, step_slice_numel
from .model_sizes import ModelInfo, gib

# label -> (optimizer_state_dtype, master_dtype)
VARIANTS: dict[str, tuple[str, str]] = {"fp32": ("fp32", "fp32"), "bf16 moments": ("bf16", "fp32"),
                                        "bf16 moments+masters": ("bf16", "bf16")}


@dataclass
class StateDtypeRow:
    setting: str
    variant: str  # a VARIANTS label
    plan: ShardingPlan  # the setting's plan with the variant's dtypes
    states: dict  # plan_state_bytes: params, grads, master, optimizer_state, model_states, host, nvme, device
    transient: float  # bytes of the step's fp32 slice (0 with fp32 states and master)

    @property
    def transient_at(self) -> Location:
        return Location.HOST if self.plan.placement.steps_on_host else Location.DEVICE


def state_dtype_rows(info: ModelInfo, plans: dict[str, ShardingPlan], world_size: int, mixed: bool,
                     bf16_compute: bool, state_bytes: int, accumulating: bool,
                     bucket_mb: float) -> list[StateDtypeRow]:
    """Every setting of ``plans`` (name -> plan) under every variant the precision allows (bf16 masters: bf16
    compute only), ``world_size`` ranks sharding the states."""
    rows = []
    for name, plan in plans.items():
        for variant, (states, master) in VARIANTS.items():
            if master == "bf16" and not bf16_compute:
                continue
            p = dataclasses.replace(plan, optimizer_state_dtype=states, master_dtype=master)
            slice_numel = step_slice_numel(info, p, world_size, bucket_mb)
            rows.append(StateDtypeRow(name, variant, p, plan_state_bytes(info, p, world_size, mixed, state_bytes,
                                                                         accumulating),
                                      low_precision_step_bytes(p, slice_numel, state_bytes)))
    return rows


def state_dtype_lines(rows: list[StateDtypeRow], info: ModelInfo, bf16_compute: bool,
                      whole_tensor: str = "") -> list[str]:
    """The rows as a table: bytes per parameter and GiB per rank on the device, the host and NVMe, the step's
    fp32 slice and where it lives."""
    if whole_tensor:
        return [f"optimizer_state_dtype / master_dtype: {whole_tensor} steps whole fp32 tensors on owner ranks; the "
                f"run refuses bf16 states or masters with it (no rows)."]
    lines = ["model states by optimizer_state_dtype / master_dtype (B/param: this rank's bytes per model parameter, "
             f"Psi = {info.numel:,}; GiB per rank; the step widens one bucket's slice to fp32 at a time):"]
    w = max([7] + [len(r.setting) for r in rows])
    head = (f"| {'setting':<{w}} | {'states':<20} | B/param device | B/param host | B/param NVMe | device states "
            "| host states | NVMe states | step's fp32 slice |")
    lines += [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    psi = max(info.numel, 1)
    for r in rows:
        st = r.states
        where = "device" if r.transient_at is Location.DEVICE else "host"
        slice_s = f"{gib(r.transient)} {where}" if r.transient else "-"
        lines.append(f"| {r.setting:<{w}} | {r.variant:<20} | {st['device'] / psi:>14.2f} | {st['host'] / psi:>12.2f} "
                     f"| {st['nvme'] / psi:>12.2f} | {gib(st['device']):>13} | {gib(st['host']):>11} "
                     f"| {gib(st['nvme']):>11} | {slice_s:>17} |")
    if not bf16_compute:
        lines.append("bf16 moments+masters: needs bf16 compute (--precision bf16-mixed); not shown.")
    return lines
