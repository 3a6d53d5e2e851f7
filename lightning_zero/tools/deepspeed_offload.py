"""DeepSpeed's ``offload_optimizer`` / ``offload_param`` sections as our offload knobs, and back to a preset's name.

ZeRO-Infinity's ``offload_optimizer.device: "nvme"`` becomes ``offload_optimizer="nvme"`` with its ``nvme_path``
and ``buffer_count`` (``nvme_buffer_count``), ``offload_param.device: "nvme"`` becomes ``offload_params="nvme"``
(one ``nvme_path`` for both); ``"cpu"`` becomes ``True``; the keys that tune DeepSpeed's own offload machinery
are listed as ignored with the reason. Every test of a device string lives here, in the translation of the
JSON keys; what the knobs then mean is the run's placement ([Note: placement], ``engine/placement/placement.py``).
"""

from __future__ import annotations


from ..engine.placement.placement import Location, Placement
from .deepspeed_auto import DeepSpeedConfigError, check_keys, positive_int, unset

_OFFLOAD_KEYS = {"device", "pin_memory", "buffer_count", "buffer_size", "fast_init", "ratio", "max_in_cpu",
                 "nvme_path", "pipeline", "pipeline_read", "pipeline_write"}

_OFFLOAD_NOTES = {
    "pin_memory": "host buffers are always pinned when a CUDA device is used",
    "fast_init": "offloaded state is built shard by shard", "ratio": "the whole optimizer state is offloaded",
    "buffer_size": "each NVMe ring buffer holds one gradient bucket's masters + state (bucket_mb sets it)",
    "max_in_cpu": "NVMe offload keeps nothing in host memory beyond the ring",
    "pipeline": "the NVMe step always overlaps reads, the CPU step and writes",
    "pipeline_read": "the NVMe step always overlaps reads, the CPU step and writes",
    "pipeline_write": "the NVMe step always overlaps reads, the CPU step and writes",
}


def _offload(block, key: str, ignored: dict, nvme: dict):
    """True for device 'cpu', False for 'none'/absent, "nvme" (ZeRO-Infinity; ``nvme_path`` and, for the
    optimizer, ``buffer_count`` into ``nvme``); unknown devices are refused."""
    if unset(block):
        return False
    check_keys(block, _OFFLOAD_KEYS, f"zero_optimization.{key}")
    device = str(block.get("device", "none")).lower()
    allowed = ("cpu", "none", "nvme")
    if device not in allowed:
        raise DeepSpeedConfigError(f"zero_optimization.{key}.device={device!r} is not supported. "
                                   f"Allowed: {', '.join(map(repr, allowed))}.")
    notes = dict(_OFFLOAD_NOTES)
    if device == "nvme":
        if not unset(block.get("nvme_path")):
            path = str(block["nvme_path"])
            if nvme.get("nvme_path", path) != path:
                raise DeepSpeedConfigError(f"zero_optimization.{key}.nvme_path={path!r} differs from the optimizer's "
                                           f"{nvme['nvme_path']!r}. Allowed: one nvme_path for both (each rank's "
                                           f"scratch files are named apart in it).")
            nvme["nvme_path"] = path
        if key == "offload_param":  # the parameter ring: prefetch + nvme_buffer_count slots of the largest unit
            notes["buffer_count"] = ("the parameter ring has prefetch + nvme_buffer_count slots "
                                     "(offload_optimizer.buffer_count sets nvme_buffer_count)")
            notes["buffer_size"] = "each parameter ring slot holds the largest unit's shard"
            notes["max_in_cpu"] = "parameter shards in host memory are the ring's slots only"
        elif not unset(block.get("buffer_count")):
            nvme["nvme_buffer_count"] = positive_int(block["buffer_count"], f"zero_optimization.{key}.buffer_count")
    else:
        notes.update({k: "NVMe offload tuning (device is not 'nvme')" for k in ("buffer_count", "nvme_path")})
    ignored.update({f"zero_optimization.{key}.{k}": why for k, why in notes.items() if k in block})
    return "nvme" if device == "nvme" else device == "cpu"


def offload_knobs(zero: dict, ignored: dict) -> dict:
    """``offload_optimizer`` / ``offload_params`` (and the NVMe knobs) of a ``zero_optimization`` block,
    DeepSpeed's legacy ``cpu_offload`` / ``cpu_offload_params`` flags included; ignored keys into ``ignored``."""
    nvme: dict = {}
    offload_opt = (_offload(zero.get("offload_optimizer"), "offload_optimizer", ignored, nvme)
                   or zero.get("cpu_offload") is True)
    offload_par = (_offload(zero.get("offload_param"), "offload_param", ignored, nvme)
                   or zero.get("cpu_offload_params") is True)
    return {"offload_optimizer": offload_opt, "offload_params": offload_par, **nvme}


# the furthest place any state goes -> the suffix of the recipe's preset name
_PRESET_SUFFIX = {Location.DEVICE: "", Location.HOST: "_offload", Location.NVME: "_offload_nvme"}


def preset_label(strategy: dict) -> str:
    """The recipe's ``strategy.name`` for translated knobs (a label: the ``strategy.*`` overrides beside it
    set every knob): ``zero{stage}``, ``_offload`` when any state is in host memory, ``_offload_nvme`` on disk."""
    placement = Placement.from_knobs(strategy.get("offload_optimizer", False), strategy.get("offload_params", False))
    furthest = max((placement.optimizer_states, placement.param_shards), key=list(Location).index)
    return f"zero{strategy.get('stage', 0)}{_PRESET_SUFFIX[furthest]}"
