"""``SequenceSharding``: one model's sequence parallelism as the data path sees it -- this rank's slice of a
batch.

A causal LM's batch: every ``(B, s)`` tensor (input_ids, inputs_embeds, position_ids, token_type_ids,
labels) is cut to this rank's ``s / S`` positions. Before the cut, the labels are shifted on the WHOLE
sequence (the last position of one rank predicts the first token of the next: a shift after the cut would
lose S - 1 targets) and passed as HF's ``shift_labels``, with ``num_items_in_batch`` the whole batch's valid
targets ([Note: every rank computes the whole loss]); the position ids are made (``arange``, HF's default)
before the cut so that each rank embeds / rotates its global positions; ``attention_mask`` stays whole
([Note: masks of the whole sequence]), and so do a packed batch's position ids ([Note: packed sequences]).
A T5 batch: only the encoder's inputs are cut; the mask, the decoder's inputs and the labels stay whole.

[Note: lengths that do not split] A length that is not a multiple of S is padded at the end up to one: the
pad token (the model's ``pad_token_id``, else 0), label -100, attention mask 0 (a T5 batch without a mask
gets one), the last position id repeated (a valid index for GPT-2's table). For a causal LM no real position
attends to a later one, and for T5 the padded keys are masked, so the real positions' logits and the loss
are the unpadded ones exactly; the padded positions' logits are junk (they are at the end of the last
rank's slice).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from lightning_zero.sequence_parallel.group_ref import SequenceGroup

CAUSAL_CUT = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids", "labels", "shift_labels")
T5_CUT = ("input_ids", "inputs_embeds")
T5_WHOLE = ("attention_mask", "decoder_input_ids", "decoder_attention_mask", "decoder_inputs_embeds", "labels")
_PAD_VALUE = {"labels": -100, "shift_labels": -100, "token_type_ids": 0, "inputs_embeds": 0}


class SequenceSharding:
    """What ``apply_sequence_parallel`` returns: ``size`` (S), ``rank`` (this rank's slice), ``group`` (the
    process group), ``kind`` ("causal_lm" or "t5") and ``shard_batch``."""

    def __init__(self, sequence_group: SequenceGroup, kind: str, pad_token_id: int):
        self.sequence_group = sequence_group
        self.kind = kind
        self.pad_token_id = pad_token_id

    @property
    def size(self) -> int:
        return self.sequence_group.size

    @property
    def rank(self) -> int:
        return self.sequence_group.rank

    @property
    def group(self) -> Any:
        return self.sequence_group.group

    def __repr__(self) -> str:
        return f"SequenceSharding(kind={self.kind!r}, size={self.size}, rank={self.rank})"

    def shard_batch(self, batch: Mapping) -> dict:
        """This rank's slice of ``batch`` (the model's keyword arguments), to call the model with as
        ``model(**shard_batch(batch))``; see the module's docstring for what is cut and what stays whole."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"shard_batch takes the model's keyword arguments as a mapping (input_ids, "
                            f"attention_mask, labels, ...), got {type(batch).__name__}.")
        out = dict(batch)
        lead = out.get("input_ids") if out.get("input_ids") is not None else out.get("inputs_embeds")
        if not isinstance(lead, torch.Tensor) or lead.dim() < 2:
            raise ValueError("shard_batch needs input_ids (batch, length) or inputs_embeds (batch, length, hidden).")
        B, s = lead.shape[:2]
        cut = CAUSAL_CUT if self.kind == "causal_lm" else T5_CUT
        whole = ("attention_mask",) if self.kind == "causal_lm" else T5_WHOLE
        unknown = sorted(k for k, v in out.items() if isinstance(v, torch.Tensor) and v.dim() >= 2
                         and tuple(v.shape[:2]) == (B, s) and k not in cut + whole)
        if unknown:
            raise ValueError(f"shard_batch does not know how to split {unknown} along the sequence: a "
                             f"{self.kind} batch's sequence tensors are {list(cut)} (cut) and {list(whole)} "
                             "(kept whole).")
        mask = out.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, s)):
            raise ValueError(f"attention_mask must be the (batch, length) = {(B, s)} padding mask of the whole "
                             f"sequence, got {tuple(getattr(mask, 'shape', ()))}.")
        if self.kind == "causal_lm":
            self._causal_targets(out, B, s, lead.device)
        pad = (-s) % self.size
        if pad:  # [Note: lengths that do not split]
            for k in cut:
                if out.get(k) is not None:
                    out[k] = _pad_end(out[k], pad, k, self.pad_token_id)
            if mask is None and self.kind == "t5":
                mask = torch.ones(B, s, dtype=torch.long, device=lead.device)
            if mask is not None:
                out["attention_mask"] = F.pad(mask, (0, pad), value=0)
            if out.get("packed_position_ids") is not None:  # the padding: a sequence of its own
                out["packed_position_ids"] = _pad_end(out["packed_position_ids"], pad, "position_ids", 0)
        local = (s + pad) // self.size
        lo = self.rank * local
        for k in cut:
            if out.get(k) is not None:
                out[k] = out[k][:, lo : lo + local].contiguous()
        return out

    @staticmethod
    def _causal_targets(out: dict, B: int, s: int, device: torch.device) -> None:
        labels, shift = out.pop("labels", None), out.pop("shift_labels", None)
        if shift is None and labels is not None:
            shift = F.pad(labels[:, 1:], (0, 1), value=-100)  # shifted on the whole sequence, before the cut
        if shift is not None:
            out["labels"] = shift  # HF computes a loss only when labels are given; it reads shift_labels
            out["shift_labels"] = shift
            out["num_items_in_batch"] = (shift != -100).sum()
        if out.get("position_ids") is None:
            out["position_ids"] = torch.arange(s, device=device).unsqueeze(0)
        elif out.get("attention_mask") is None and _restarts(out["position_ids"]):  # [Note: packed sequences]
            out["packed_position_ids"] = out["position_ids"].expand(B, s)


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether a row's position ids restart (HF's test for a packed batch: a step other than 1)."""
    return bool((position_ids.diff(dim=-1) != 1).any())


def _pad_end(t: torch.Tensor, pad: int, key: str, pad_token_id: int) -> torch.Tensor:
    if key == "position_ids":
        return torch.cat([t, t[:, -1:].expand(t.shape[0], pad)], dim=1)
    value = _PAD_VALUE.get(key, pad_token_id)
    if t.dim() == 3:  # inputs_embeds
        return F.pad(t, (0, 0, 0, pad), value=value)
    return F.pad(t, (0, pad), value=value)
