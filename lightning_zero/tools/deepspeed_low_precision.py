"""DeepSpeed's low-precision master and optimizer-state options as our ``master_dtype`` / ``optimizer_state_dtype``.

DeepSpeed keeps them in its ``bf16`` block (PR #7700): ``bf16_master_weights_and_grads`` (master parameters and
gradients in bf16) and ``bf16_optimizer_states`` (Adam's moments in bf16; DeepSpeed asks for bf16 masters with it).
Here they become ``master_dtype="bf16"`` and ``optimizer_state_dtype="bf16"``, with what the run does differently
listed in ``differs``: gradients stay fp32, and our bf16 master carries a bf16 compensation term
([Note: low-precision optimizer states], ``engine/optim/low_precision.py``).
"""

from __future__ import annotations

from typing import Optional

from .deepspeed_auto import DeepSpeedConfigError

MASTER_KEY = "bf16_master_weights_and_grads"
STATES_KEY = "bf16_optimizer_states"
KEYS = {MASTER_KEY, STATES_KEY}

MASTER_DIFFERS = (
    "master_dtype='bf16': the gradients stay fp32 (the masters' .grad is the fp32 reduced shard; DeepSpeed keeps "
    "them in bf16), and the bf16 master carries a bf16 Kahan compensation term -- 2 bytes per element more than "
    "DeepSpeed's plain bf16 master, which can lose updates smaller than half a bf16 ulp; with the states on the "
    "device the bf16 master is the bf16 parameter itself (no second copy)")
STATES_ALONE_DIFFERS = (
    "optimizer_state_dtype='bf16' beside fp32 masters: DeepSpeed refuses bf16_optimizer_states without "
    "bf16_master_weights_and_grads; here bf16 moments run with fp32 masters")


def low_precision_knobs(bf16: dict, precision: Optional[str], differs: dict) -> dict:
    """The ``ZeroStrategy`` knobs of DeepSpeed's ``bf16`` block's low-precision keys (none set: nothing), what
    differs recorded in ``differs``. ``precision``: the translated one (None: left to the Trainer's flag)."""
    on = {}
    for key in sorted(KEYS & set(bf16)):
        value = bf16[key]
        if not isinstance(value, bool):
            raise DeepSpeedConfigError(f"DeepSpeed config bf16.{key}={value!r}: allowed true or false.")
        on[key] = value
    knobs = {}
    if on.get(MASTER_KEY):
        if precision is not None and not precision.startswith("bf16"):
            raise DeepSpeedConfigError(
                f"DeepSpeed config bf16.{MASTER_KEY}=true with precision {precision!r}: a bf16 master needs bf16 "
                f"compute. Allowed: bf16.{MASTER_KEY} with bf16.enabled=true (precision 'bf16-mixed').")
        knobs["master_dtype"] = "bf16"
        differs[f"bf16.{MASTER_KEY}"] = MASTER_DIFFERS
    if on.get(STATES_KEY):
        knobs["optimizer_state_dtype"] = "bf16"
        if not on.get(MASTER_KEY):
            differs[f"bf16.{STATES_KEY}"] = STATES_ALONE_DIFFERS
    return knobs
