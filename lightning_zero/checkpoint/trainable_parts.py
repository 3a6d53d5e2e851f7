"""What a trainable-only checkpoint consolidates to: the whole model, the adapter alone, or the adapter
folded into its base ([Note: trainable-only checkpoints] in trainable_only.py).

- ``"full"``: the base (from its recorded source, hash-checked) and the trained part under the module's own
  names: loads with ``strict=True`` into the model that was trained (the peft-wrapped one).
- ``"adapter"``: the trained parameters alone, as saved (no base read). :func:`peft_adapter` renames them
  as peft's ``save_pretrained`` does (``adapter_model.safetensors`` + ``adapter_config.json``, written without
  importing peft), so ``PeftModel.from_pretrained(base, DIR)`` loads them.
- ``"merged"``: each LoRA layer folded into its base weight, ``W + (B @ A) * scaling`` (transposed for
  ``fan_in_fan_out`` layers such as GPT-2's ``Conv1D``), what peft's ``merge_and_unload`` computes, under the
  plain model's names (peft's ``base_model.model.`` and ``.base_layer`` dropped, the adapters gone): loads
  into the model without peft. Layers that are not plain LoRA (DoRA, embedding LoRA) are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from . import trainable_only as TO
from .consolidate import atomic_output, full_model_state, iter_stored_tensors, save_state
from .files import read_info, resolve_checkpoint_dir

PARTS = ("full", "adapter", "merged")


def check_part(part: str, info: dict, path) -> dict:
    """The checkpoint's trainable-only entry, with ``part`` allowed for it; one error otherwise."""
    if part not in PARTS:
        raise ValueError(f"part={part!r}; allowed: {', '.join(map(repr, PARTS))}.")
    entry = TO.entry_of(info)
    if part != "full" and entry is None:
        raise ValueError(f"{str(path)!r} is a full checkpoint (every tensor stored): --{part} needs one saved with "
                         "checkpoint_trainable_only=True. Allowed for it: the full state dict (no flag).")
    if part == "merged":
        bad = sorted(k.split("|")[0] for k, v in entry["lora"].items() if "unsupported" in v)
        if not entry["lora"] or bad:
            raise ValueError(f"{str(path)!r}: cannot fold the adapter into its base: "
                             + (f"{', '.join(bad[:5])} are not plain LoRA layers" if bad else "no LoRA layer was "
                                "recorded when it was saved") + ". Allowed: --adapter or the full state dict.")
    return entry


def part_state(path: Path, info: dict, part: str, dtype: Optional[torch.dtype] = torch.float32,
               progress=None, trust_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of ``part`` (see the module docstring) of the checkpoint at ``path``."""

    entry = check_part(part, info, path)
    if part == "adapter":
        names = [n for n in entry["trainable"] if n in info["tensors"]]
        return dict(iter_stored_tensors(path, info, names, dtype, progress, trust_checkpoint=trust_checkpoint))
    full = full_model_state(path, info, dtype, progress, trust_checkpoint)
    return full if part == "full" else merged(full, entry)


def write_part(ckpt_dir, out, part: str, dtype: Optional[torch.dtype] = torch.float32, progress=None,
               trust_checkpoint: bool = False) -> dict:
    """``lightning-zero consolidate DIR OUT [--adapter | --merged]``: ``part`` into the file ``out``
    (safetensors by its suffix, else ``torch.save``). Returns {"tensors", "bytes"}."""
    path, out = resolve_checkpoint_dir(ckpt_dir), Path(out)
    sd = part_state(path, read_info(path, trust_checkpoint), part, dtype, progress, trust_checkpoint)
    with atomic_output(out) as tmp:
        save_state(sd, tmp, out.suffix == ".safetensors")
    unique = {(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in sd.values()}
    return {"tensors": len(sd), "bytes": sum(unique.values())}


@torch.no_grad()
def merged(full: dict[str, torch.Tensor], entry: dict) -> dict[str, torch.Tensor]:
    """The LoRA layers of ``full`` folded into their base weights, under the plain model's names."""
    out = dict(full)
    for key, layer in entry["lora"].items():
        name, adapter = key.split("|")
        a, b = out.pop(f"{name}.lora_A.{adapter}.weight"), out.pop(f"{name}.lora_B.{adapter}.weight")
        w = f"{name}.base_layer.weight"
        delta = (b.float() @ a.float()) * layer["scaling"]
        if layer["fan_in_fan_out"]:
            delta = delta.T
        out[w] = (out[w].float() + delta).to(out[w].dtype)
    return {TO._normal(n): t for n, t in out.items()}


def peft_adapter(adapter: dict[str, torch.Tensor], entry: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, adapter_config.json) in peft's ``save_pretrained`` layout: names from ``base_model.model.``
    on (the LightningModule's prefix dropped), without the adapter name; the config as saved."""
    configs = entry.get("peft_config") or {}
    if len(configs) != 1:
        raise ValueError(f"The checkpoint records {len(configs)} peft adapter configs; peft's adapter format "
                         "holds one. Allowed: a plain state dict of the adapter (an OUT file ending in "
                         ".safetensors or .pt).")
    (adapter_name, config), = configs.items()
    out = {}
    for n, t in adapter.items():
        at = n.find("base_model.model.")
        if at < 0:
            raise ValueError(f"{n!r} is not inside a peft model (no 'base_model.model.'); cannot write peft's "
                             "adapter format. Allowed: a plain state dict of the adapter.")
        out[n[at:].replace(f".{adapter_name}.", ".")] = t
    return out, config
