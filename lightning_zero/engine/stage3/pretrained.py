"""Pretrained weights into a stage-3 model built on the meta device: every rank reads only its own slices.

Design note
-----------
``load_pretrained(module, path)`` on a meta module (built in ``configure_model`` / ``init_module(empty_init=True)``
with ``from_config``) only checks the names and marks the module; when the stage-3 engine partitions it, each
unit's shard is read straight from the checkpoint (pretrained_source.py) instead of initialized: no
broadcast, no rank holds a unit whole. As DeepSpeed's ``zero.Init`` + ``from_pretrained`` and FSDP2's meta
build + DCP's HF reader do. On a module that already has its values (stages 0-2, an eager build) it loads them
in place, tensor by tensor.

Names follow ``from_pretrained`` for these models: a parameter registered under several names (tied
embeddings: GPT-2's and T5's ``lm_head.weight``, which ``save_pretrained`` leaves out) is read from whichever
name the checkpoint has; the HF ``base_model_prefix`` (``transformer.`` for GPT-2) is added or dropped, so a
base model's checkpoint loads into its head model and back. Keys the model does not have are skipped (as
``from_pretrained`` does, with a warning); a parameter the checkpoint lacks is an error naming it, since
nothing else would give it a value. Non-persistent buffers (rotary frequencies), which no checkpoint holds,
are computed by their module's own init.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

import torch
from torch import nn

from .deferred_init import _allocate_own, has_meta_params, hf_owners, is_hf_model
from .pretrained_source import LoadStats, PretrainedSource

_log = logging.getLogger("lightning_zero.engine")
_MARK = "_zero_pretrained"  # the source a meta module is filled from when it is partitioned
_PathLike = Union[str, "os.PathLike[str]"]


def load_pretrained(module: nn.Module, path: _PathLike) -> nn.Module:
    """Weights from a ``save_pretrained`` directory (safetensors, sharded or not; ``pytorch_model.bin``) or a
    state-dict file into ``module``. On the meta device (stage 3, in ``configure_model``): read at
    partitioning, each rank its own slices. Otherwise: loaded now, in place. Returns ``module``."""
    if any(not p.is_meta and p.untyped_storage().nbytes() < p.numel() * p.element_size()
           for p in module.parameters()):
        raise RuntimeError("load_pretrained: this module is already partitioned by a stage-3 engine. Allowed: call "
                           "it in configure_model (the model built on the meta device), before the strategy's setup.")
    source = path if isinstance(path, PretrainedSource) else PretrainedSource(path)
    names = checkpoint_names(module, source)
    if has_meta_params(module):
        if not all(p.is_meta for p in module.parameters()):
            raise ValueError("load_pretrained: the module is partly on the meta device. Allowed: a module built "
                             "entirely on meta (configure_model under stage 3, init_module(empty_init=True)) "
                             "or one with all its values.")
        module.__dict__[_MARK] = (source, names)
        return module
    module.__dict__.pop(_MARK, None)  # marked while on meta, given storage since (to_empty): loaded now
    with torch.no_grad():
        for p, key in names.params.values():
            p.copy_(source.read(key).view(p.shape))
        for (m, attr), key in names.buffers.items():
            m._buffers[attr].copy_(source.read(key))
    return module


def outermost_hf_model(root: nn.Module) -> nn.Module:
    """The one HF model in ``root`` (``root`` itself, or the one submodule no HF model contains)."""
    if is_hf_model(root):
        return root
    found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            if is_hf_model(child):
                found.append((prefix + name, child))
            else:
                walk(f"{prefix}{name}.", child)

    walk("", root)
    if len(found) != 1:
        raise ValueError(
            f"load_weights_from needs exactly one Hugging Face model in {type(root).__name__}; found "
            f"{len(found)}{': ' + ', '.join(n for n, _ in found) if found else ''}. Allowed: a LightningModule "
            "holding one HF model (built in configure_model), or lightning_zero.load_pretrained(submodule, DIR) "
            "in configure_model for each.")
    return found[0][1]


class CheckpointNames:
    """Which checkpoint key fills each parameter (by id) and each persistent buffer found."""

    def __init__(self) -> None:
        self.params: dict[int, tuple[nn.Parameter, str]] = {}
        self.buffers: dict[tuple[nn.Module, str], str] = {}


def checkpoint_names(module: nn.Module, source: PretrainedSource) -> CheckpointNames:
    prefix = getattr(module, "base_model_prefix", "") or ""
    keys = set(source.keys())
    # a whole LightningModule's state dict (lightning-zero consolidate) names the HF model by its attribute
    outer = _outer_prefix(module, keys)

    def find(name: str) -> Optional[str]:
        for cand in (name, f"{prefix}.{name}" if prefix else None,
                     name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else None):
            for full in ((cand, outer + cand) if outer else (cand,)):
                if cand is not None and full in keys:
                    return full
        return None

    out = CheckpointNames()
    aliases: dict[int, list[str]] = {}
    by_id: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        by_id[id(p)] = p
    missing, bad = [], []
    for pid, names in aliases.items():
        key = next((k for k in map(find, names) if k is not None), None)
        if key is None:
            missing.append(names[0])
            continue
        if source.shape(key) != by_id[pid].shape:
            bad.append(f"{names[0]} {tuple(by_id[pid].shape)} <- {key} {tuple(source.shape(key))}")
        out.params[pid] = (by_id[pid], key)
    if missing or bad:
        raise ValueError(
            f"The checkpoint {source.path} does not fit {type(module).__name__}: "
            + (f"no tensor for {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}" if missing else "")
            + ("; " if missing and bad else "") + (f"shape mismatch {', '.join(bad[:4])}" if bad else "")
            + ". Allowed: a checkpoint of this model class and config (names as save_pretrained writes them, "
              "tied weights under any of their names, with or without the base-model prefix).")
    used = {k for _, k in out.params.values()}
    for mod_name, m in module.named_modules():
        for attr, b in m._buffers.items():
            if b is not None and attr not in m._non_persistent_buffers_set:
                key = find(f"{mod_name}.{attr}" if mod_name else attr)
                if key is not None:
                    out.buffers[(m, attr)] = key
                    used.add(key)
    unexpected = keys - used
    if unexpected:
        _log.warning("load_pretrained: %d checkpoint tensor(s) not in %s, skipped (as from_pretrained does): %s",
                     len(unexpected), type(module).__name__, ", ".join(sorted(unexpected)[:8]))
    return out


def _outer_prefix(module: nn.Module, keys: set[str]) -> str:
    """``"model."`` when the checkpoint holds this module under one attribute of an outer module, else ``""``."""
    names = [n for n, _ in module.named_parameters()]
    if not names or any(n in keys for n in names):
        return ""
    first = names[0]
    cands = {k[: -len(first)] for k in keys if k.endswith("." + first)}
    best = max(cands, key=lambda c: sum(c + n in keys for n in names), default="")
    return best if best.count(".") == 1 else ""


def marked(root: nn.Module) -> list[tuple[nn.Module, PretrainedSource, CheckpointNames]]:
    return [(m, *m.__dict__[_MARK]) for m in root.modules() if _MARK in m.__dict__]


@torch.no_grad()
def fill_shards(root: nn.Module, units: list, device, install) -> Optional["LoadStats"]:
    """Every unit's shard of this rank read from the marked modules' checkpoints; ``install(unit, chunk)``
    takes it (partition.py). Buffers are read whole, or computed by their module's init."""
    loaded = marked(root)
    stats = loaded[0][1].stats
    for _, source, _ in loaded:  # one count over all the checkpoints read
        source.stats = stats
    where: dict[int, tuple[PretrainedSource, str]] = {}
    for _, source, names in loaded:
        for pid, (_, key) in names.params.items():
            where[pid] = (source, key)
    names_of = {id(p): n for n, p in root.named_parameters()}
    outside = [names_of[id(p)] for u in units for p in u.params if id(p) not in where]
    if outside:
        raise ValueError(
            f"Deferred (meta-device) model with pretrained weights: {', '.join(outside[:8])} "
            f"{'are' if len(outside) > 1 else 'is'} outside the module(s) given to load_pretrained, so nothing "
            "gives them values. Allowed: load_pretrained on the module holding every meta parameter (build the "
            "other modules eagerly, outside configure_model).")
    for u in units:
        if not u.params:
            continue
        chunk = torch.zeros(u.layout.shard_numel, dtype=torch.float32)
        stats.keep(chunk.numel() * chunk.element_size())
        for p, spec, off in zip(u.params, u.layout.specs, u.layout.offsets):
            source, key = where[id(p)]
            source.read_into(key, spec.lo, spec.hi, chunk[off: off + spec.shard_len])
        install(u, chunk)
    for m, source, names in loaded:
        _fill_buffers(m, source, names, device)
        m.__dict__.pop(_MARK, None)
    return stats


def _fill_buffers(model: nn.Module, source: PretrainedSource, names: CheckpointNames, device) -> None:
    owners = hf_owners(model)
    for m in model.modules():
        metas = [a for a, b in m._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        _allocate_own(m, device, nan=True)
        if any((m, a) not in names.buffers for a in metas):  # not in the checkpoint: the module's own init
            scratch = {n: p for n, p in m._parameters.items() if p is not None}
            for n, p in scratch.items():  # its parameters are shards by now: the init writes a throwaway copy
                m._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), p.requires_grad)
            try:
                if id(m) in owners:
                    owners[id(m)]._init_weights(m)
                elif hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            finally:
                m._parameters.update(scratch)
        for a in metas:
            if (m, a) in names.buffers:
                m._buffers[a].copy_(source.read(names.buffers[(m, a)]))
            elif m._buffers[a].is_floating_point() and m._buffers[a].isnan().any():
                raise ValueError(f"load_pretrained: the buffer {type(m).__name__}.{a} is not in the checkpoint and "
                                 "no init of its module computes it. Allowed: a checkpoint that holds it, or a "
                                 "module whose reset_parameters()/_init_weights() sets it.")
