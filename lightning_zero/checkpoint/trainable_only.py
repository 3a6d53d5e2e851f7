"""Trainable-only checkpoints: the trained part written, the frozen base recorded by reference.

[Note: trainable-only checkpoints]
A LoRA / peft fine-tune trains a few MB on top of a base of many GB; writing the base at every save is
most of the bytes and of the time. With ``checkpoint_trainable_only`` a save leaves the model tensors of
frozen parameters (``requires_grad=False``) out of the DCP files and records instead, in
``zero_checkpoint.json`` under ``"trainable_only"``:

- ``base``: where the frozen values come from -- a ``save_pretrained`` directory (safetensors or .bin,
  sharded or not; a state-dict file) or an earlier lightning_zero checkpoint directory (itself possibly
  trainable-only: its own base is then read first);
- ``hash``: SHA-256 over the frozen tensors, in sorted name order, each as its name, dtype, shape and raw
  bytes in the dtype the run held it. A hash of *values* rather than of files: a base saved as safetensors
  or as .bin, sharded into any number of files, or gathered from stage-3 shards of any world size hashes
  the same, while one changed element does not. The names are the live module's (a source's names are
  mapped onto them first), so renaming files or wrappers cannot make two different bases agree;
- ``frozen``: every name left out with its shape and dtype; ``aliases`` of tied frozen weights;
  ``order``: the module's whole state-dict order (the json's own ``order`` lists what is stored);
- ``trainable``: the trained parameters, and ``lora``: each LoRA layer's scaling (what folding the adapter
  into its base weight needs; trainable_parts.py).

The hash is computed at the first save and kept while no rank's part of the frozen tensors changed
(``live_digest``): later saves cost a version check or a CRC-32 of each rank's own slice, not a gather.

Buffers are always written: they are small, and some change while the parameters around them are frozen
(BatchNorm's running statistics), which a reference to the base could not restore. The optimizer state is
complete as before: frozen parameters have none. Resuming (Trainer, Fabric, ``load_checkpoint_dir``)
expects the live model to hold the base already (built from its source): the live frozen tensors are
hashed as at save time and must give the recorded hash, else one error names the source and both hashes;
only the stored part is then read. Reading the checkpoint without a live model (``load_from_checkpoint``,
``lightning-zero consolidate`` / ``export``) reads the frozen part from the recorded source and checks
its hash the same way. The json's version is 2: a build that cannot read the reference refuses the
directory instead of consolidating the adapter alone as if it were the model. The base source is the one
path a checkpoint names outside its own directory (trust.py confines the others): it is only ever read as
tensors -- safetensors, ``torch.load(weights_only=True)``, or a lightning_zero directory verified as any load
verifies one -- and its values must give the recorded hash.
"""

from __future__ import annotations

import hashlib
import os
import re
import weakref
import zlib
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from ..engine.comm import collectives as C
from ..engine.stage3.pretrained_source import PretrainedSource
from .files import is_checkpoint_dir, resolve_checkpoint_dir
from .names import TRAINABLE_ONLY, TRAINABLE_ONLY_VERSION
from .sharded_state import _canonical

KEY = TRAINABLE_ONLY  # the json's entry; in a save's metadata, the base source until the json is written


class BaseMismatchError(ValueError):
    """The frozen base differs from (or cannot be found as) the one a trainable-only checkpoint was trained on."""


# -- save -----------------------------------------------------------------------------------------------------
def check_base_source(base: Optional[str], knob: str = "checkpoint_base") -> Optional[str]:
    """``base`` as recorded (local paths made absolute); one error if it names nothing."""
    if base is None:
        return None
    if not isinstance(base, (str, os.PathLike)) or not os.path.exists(base):
        raise ValueError(f"{knob}={base!r}: no such directory or file. Allowed: a save_pretrained directory "
                         "(safetensors or .bin), a state-dict file, or a lightning_zero checkpoint directory "
                         "holding the frozen base weights.")
    return os.path.abspath(base)


def frozen_names(module: nn.Module, model_state: Mapping[str, Any]) -> list[str]:
    """The stored names of frozen parameters (tied ones under their canonical name), sorted."""
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}
    return sorted(n for n, p in module.named_parameters() if id(p) in frozen and n in model_state)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU: a stage-3 shard (a DTensor) is gathered. Collective for a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def digest(tensors: Iterator[tuple[str, torch.Tensor]]) -> str:
    """The base hash of ``(name, whole tensor)`` pairs given in sorted name order (see the note)."""
    h = hashlib.sha256()
    for name, t in tensors:
        t = t.detach().contiguous().reshape(-1)
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{t.numel()}\0".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().data)
    return "sha256:" + h.hexdigest()


_DIGESTS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _crc(t: torch.Tensor) -> int:
    t = t.detach().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy().data) if t.numel() else 0


def live_digest(module: nn.Module, model_state: Mapping[str, Any], names: list[str], group=None) -> str:
    """The hash of the module's frozen tensors as the save would write them (``model_state``). Collective at
    stage 3 (each frozen shard gathered, one tensor at a time); every rank returns the same value.

    Kept from the previous save while no rank's part of the frozen tensors changed (frozen weights do not
    change, and gathering and hashing a large base at every save would stall training): each rank checks its
    own part -- unchanged storage and version counters, else (stage 3's unit shards share one counter with
    the trained parameters) the CRC-32 of its slice, 1/N of the base -- and one all-reduce of a flag decides."""
    locals_ = [_local(model_state[n]) for n in names]
    key = tuple((n, t.data_ptr(), t._version) for n, t in zip(names, locals_))
    cached = _DIGESTS.get(module)
    crcs = None
    same = cached is not None and cached[0] == key
    if cached is not None and not same:
        crcs = [_crc(t) for t in locals_]
        same = crcs == cached[1]
    stale = torch.tensor([int(not same)])
    C.all_reduce(stale, group=group)
    if int(stale) == 0:
        _DIGESTS[module] = (key, cached[1], cached[2])
        return cached[2]
    value = digest((n, _whole(model_state[n]).view(-1)) for n in names)
    _DIGESTS[module] = (key, crcs if crcs is not None else [_crc(t) for t in locals_], value)
    return value


def lora_layers(module: nn.Module) -> dict[str, dict]:
    """peft LoRA layers found by their attributes (no peft import): {layer name: {adapter, scaling,
    fan_in_fan_out}}; layers folding cannot handle (DoRA, embeddings) say so under ``"unsupported"``."""
    out = {}
    for name, m in module.named_modules():
        if not (isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and isinstance(getattr(m, "scaling", None), dict)):
            continue
        for adapter in m.lora_A:
            entry = {"adapter": adapter, "scaling": float(m.scaling[adapter]),
                     "fan_in_fan_out": bool(getattr(m, "fan_in_fan_out", False))}
            if (getattr(m, "use_dora", None) or {}).get(adapter) or len(getattr(m, "lora_embedding_A", {}) or {}):
                entry["unsupported"] = "DoRA or embedding LoRA"
            out[f"{name}|{adapter}"] = entry
    return out


def peft_configs(module: nn.Module) -> dict[str, dict]:
    """The peft model's adapter configs as json (``adapter_config.json``), found by attribute."""
    import enum

    def plain(v):
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, (set, frozenset)):
            return sorted(plain(x) for x in v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)

    for m in module.modules():
        cfgs = getattr(m, "peft_config", None)
        if isinstance(cfgs, dict) and all(hasattr(c, "to_dict") for c in cfgs.values()):
            return {k: plain(c.to_dict()) for k, c in cfgs.items()}
    return {}


def trainable_only_state(module: nn.Module, engine, model_state: Mapping[str, Any], base: str,
                         metadata: Optional[dict]) -> tuple[dict, dict]:
    """``model_state`` without the frozen parameters and ``metadata`` carrying the reference the json records
    (``record`` moves it there). Collective (the base hash)."""
    names = frozen_names(module, model_state)
    shapes = {n: shape for n, _, _, shape in (engine.unmanaged_shard_items() if engine is not None else [])}
    entry = {"base": {"source": base, "kind": "lightning_zero" if is_checkpoint_dir(base) else "pretrained"},
             "hash": live_digest(module, model_state, names),
             "frozen": {n: {"shape": list(shapes.get(n, model_state[n].shape)),
                            "dtype": str(model_state[n].dtype).removeprefix("torch.")} for n in names},
             "aliases": {a: c for a, c in _canonical(module)[1].items() if c in names},
             "order": [k for k, v in module.state_dict(keep_vars=True).items() if torch.is_tensor(v)],
             "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
             "lora": lora_layers(module), "peft_config": peft_configs(module)}
    return {n: t for n, t in model_state.items() if n not in entry["frozen"]}, {**(metadata or {}), KEY: entry}


def split_reference(metadata: Optional[dict]) -> tuple[Optional[dict], Optional[dict]]:
    """(metadata for ``meta.pt``, the reference for the json) of a save's metadata."""
    if not metadata or KEY not in metadata:
        return metadata, None
    meta = dict(metadata)
    return meta, meta.pop(KEY)


def record(info: dict, reference: Optional[dict]) -> None:
    """The reference into the json: its own entry, ``order`` cut to what is stored, version 2 (see the note)."""
    if reference is None:
        return
    info[KEY] = reference
    info["order"] = [n for n in info["order"] if n in info["tensors"] or n in info["aliases"]]
    info["version"] = TRAINABLE_ONLY_VERSION


# -- read ---------------------------------------------------------------------------------------------------------
_ENTRY_KEYS = {"base": dict, "hash": str, "frozen": dict, "aliases": dict, "order": list, "trainable": list,
               "lora": dict}


def entry_of(info: Mapping) -> Optional[dict]:
    """The json's reference (None for a full checkpoint), its keys and types checked: one clear error."""
    entry = info.get(KEY)
    if entry is None:
        return None
    bad = [k for k, t in _ENTRY_KEYS.items() if not isinstance(entry, dict) or not isinstance(entry.get(k), t)]
    if not bad and not (isinstance(entry["base"].get("source"), str)
                        and all(isinstance(d, dict) and isinstance(d.get("shape"), list) and isinstance(d.get("dtype"), str)
                                and isinstance(getattr(torch, d["dtype"], None), torch.dtype)
                                for d in entry["frozen"].values())):
        bad = ["base.source or frozen"]
    if bad:
        raise ValueError(f"Corrupt checkpoint metadata: its {KEY!r} entry has no valid {', '.join(bad)} (required: "
                         f"{', '.join(_ENTRY_KEYS)}, written by lightning_zero's trainable-only saves).")
    return entry


def left_out(info: Mapping) -> dict[str, dict]:
    """{name: {"shape", "dtype"}} of the frozen tensors a checkpoint does not store (none for a full one)."""
    entry = entry_of(info)
    return dict(entry["frozen"]) if entry else {}


def full_names(info: Mapping) -> tuple[list[str], dict[str, str]]:
    """(the module's whole state-dict order, every alias) of a checkpoint, frozen names included."""
    entry = entry_of(info)
    if not entry:
        return info["order"], info["aliases"]
    return entry["order"], {**info["aliases"], **entry["aliases"]}


def _mismatch(entry: dict, got: str, what: str) -> BaseMismatchError:
    src = entry["base"]["source"]
    return BaseMismatchError(
        f"The base model differs from the one this checkpoint was trained on: expected {src} hash {entry['hash']}, "
        f"got {got} ({what}). Allowed: build the model from that base (its frozen weights unchanged) and resume, "
        f"or load a checkpoint saved with checkpoint_trainable_only=False.")


def verify_live_base(info: Mapping, module: nn.Module, engine=None, group=None) -> None:
    """Resume: the live frozen tensors must hash to the recorded value. Collective at stage 3."""
    entry = entry_of(info)
    if not entry:
        return
    from .sharded_state import sharded_model_state

    state = sharded_model_state(module, engine, group)
    missing = sorted(n for n in entry["frozen"] if n not in state)
    if missing:
        raise _mismatch(entry, "none", f"the model has no tensor {', '.join(missing[:5])}")
    got = digest((n, _whole(state[n]).view(-1).to(getattr(torch, entry["frozen"][n]["dtype"])))
                 for n in sorted(entry["frozen"]))
    if got != entry["hash"]:
        raise _mismatch(entry, got, "the frozen weights of the model being resumed")


def _normal(name: str) -> str:
    """A name without peft's wrappers: ``base_model.model.`` and ``.base_layer`` (the plain model's name)."""
    return re.sub(r"(^|\.)base_layer(?=\.|$)", "", name.replace("base_model.model.", "", 1))


def match_names(wanted: list[str], available: list[str]) -> dict[str, str]:
    """{wanted name: available name}: equal after dropping peft's wrappers and one prefix on either side
    (a LightningModule's ``model.``, a head model's ``transformer.``); {} if no one prefix pair fits all."""
    avail = {_normal(a): a for a in available}
    if not wanted:
        return {}
    first = _normal(wanted[0])
    pairs = [("", a[: len(a) - len(first)]) if len(a) >= len(first) else (first[: len(first) - len(a)], "")
             for a in avail if a == first or a.endswith("." + first) or first.endswith("." + a)]
    for cut, add in sorted(pairs, key=lambda p: len(p[0]) + len(p[1])):  # the shortest prefixes first
        out = {w: avail.get(add + _normal(w)[len(cut):]) for w in wanted}
        if all(_normal(w).startswith(cut) and v is not None for w, v in out.items()):
            return out
    return {}


def read_base(info: Mapping, dtype: Optional[torch.dtype] = torch.float32, trust_checkpoint: bool = False,
              full_reader=None) -> dict[str, torch.Tensor]:
    """The frozen tensors of a trainable-only checkpoint from its recorded source, hash-checked, in ``dtype``
    (floating ones; None: as saved). ``full_reader(dir)``: a lightning_zero directory's whole state dict
    (consolidate.py's, which calls back here for a source that is trainable-only itself). {} for a full one."""
    entry = entry_of(info)
    if not entry:
        return {}
    src = entry["base"]["source"]
    if not os.path.exists(src):
        raise BaseMismatchError(f"The frozen base of this trainable-only checkpoint is missing: {src!r} does not "
                                f"exist (recorded hash {entry['hash']}). Allowed: put that base back at {src!r}, or "
                                "resume it into a model built from the base (fit(ckpt_path=...)).")
    frozen = entry["frozen"]
    names = sorted(frozen)
    if is_checkpoint_dir(src) or is_checkpoint_dir(resolve_checkpoint_dir(src)):
        whole = full_reader(src)
        found = match_names(names, list(whole))
        get = lambda n: whole[found[n]]  # noqa: E731
    else:
        source = PretrainedSource(src)
        found = match_names(names, source.keys())
        get = lambda n: source.read(found[n])  # noqa: E731
    if len(found) != len(names):
        raise _mismatch(entry, "none", f"{src} holds no tensor for {', '.join([n for n in names if n not in found][:5])}")
    base = {}
    for n in names:
        t = get(n).to(getattr(torch, frozen[n]["dtype"]))
        if list(t.shape) != frozen[n]["shape"]:
            raise _mismatch(entry, "none", f"{src}'s {found[n]} has shape {list(t.shape)}, the checkpoint "
                                           f"{frozen[n]['shape']}")
        base[n] = t
    got = digest((n, base[n]) for n in names)
    if got != entry["hash"]:
        raise _mismatch(entry, got, f"the weights read from {src}")
    return {n: t.to(dtype) if dtype is not None and t.is_floating_point() else t for n, t in base.items()}
