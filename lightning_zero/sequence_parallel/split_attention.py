"""``UlyssesAttention``: what a split HF attention keeps -- its group, the kernel it ran before, and the
whole sequence's mask that kernel gets.

[Note: masks of the whole sequence] HF builds an attention mask from the length of the ``input_ids`` it is
given, here this rank's slice, and from a 2-D padding mask of that slice. After the exchange the kernel sees
every position, so that mask is the wrong size and misses the other ranks' padding. The model's forward
pre-hook (``apply.py``) hands HF the whole padding mask as ``(B, 1, 1, s)``, which HF passes to every layer
untouched (a 4-D mask is taken as prepared), and each split attention builds the mask the original kernel
expects with HF's own builders (``create_causal_mask`` / ``create_bidirectional_mask``) at the whole length:
the same mask, bit for bit, that one process on the whole sequence builds (SDPA's boolean mask or none for a
plain causal one, eager's additive 0 / min). A mask of another shape reaching a layer is one HF built from
no mask (eager builds one, SDPA none): no padding.

[Note: packed sequences] One process detects a packed batch (several sequences in a row, the position ids
restarting) from its position ids when no attention mask is given, and masks each sequence off the others.
A rank sees only its slice of them, so ``shard_batch`` passes a packed batch's whole position ids on as
``packed_position_ids`` (a keyword HF hands through to every attention) and the mask is built from them, the
single process's. A padded or packed mask is built once per forward: the layers of
one forward (and checkpointing's re-runs) get the same padding tensor, and the mask built from it is kept
only while that tensor lives (a weak reference), so no (B, 1, s, s) mask outlives its batch.

transformers is imported inside the functions only.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch

from lightning_zero.sequence_parallel.group_ref import SequenceGroup

KERNELS = ("eager", "sdpa", "lz_block_sparse")  # the kernels a split attention can run on its heads
_LAST: list = [None]  # (weak padding, key, mask): the last padded mask ([Note: masks of the whole sequence])


def _forget(ref: weakref.ref) -> None:
    if _LAST[0] is not None and _LAST[0][0] is ref:
        _LAST[0] = None


class UlyssesAttention(torch.nn.Module):
    """The parameterless ``ulysses`` child of a split attention (the state dict is unchanged).

    ``kernel``: the attention implementation the module ran before it was split (``KERNELS``); ``eager_from``:
    the transformers module whose ``eager_attention_forward`` is the model's own eager kernel; ``mask_config``:
    the model's config naming the implementation whose mask the kernel takes (SDPA's for the block-sparse one,
    as the sparse model's masks are built from the model's config)."""

    def __init__(self, group: SequenceGroup, kernel: str, eager_from: str, config: Any, sparse_config: Any = None):
        super().__init__()
        import copy

        self.group = group
        self.kernel = kernel
        self.eager_from = eager_from
        self.mask_config = copy.copy(config)
        self.mask_config._attn_implementation = "eager" if kernel == "eager" else "sdpa"
        self.sparse_config = sparse_config  # the whole layout of a block-sparse model (all heads)

    def kernel_function(self) -> Callable:
        if self.kernel == "eager":
            return sys.modules[self.eager_from].eager_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[self.kernel]

    def whole_mask(self, attention_mask: Any, batch: int, length: int, dtype: torch.dtype, device: torch.device,
                   causal: bool, packed_position_ids: torch.Tensor | None = None):
        """The mask the kernel takes for ``length`` positions ([Note: masks of the whole sequence]);
        ``packed_position_ids``: the whole sequence's position ids of a packed batch ([Note: packed sequences])."""
        padding = None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and \
                attention_mask.shape[-1] == length and attention_mask.shape[1:3] == (1, 1):
            padding = attention_mask
        source = padding if padding is not None else packed_position_ids  # what the mask is made from
        key = (self.mask_config._attn_implementation, getattr(self.mask_config, "is_causal", True), causal, batch,
               length, dtype, device)
        last = _LAST[0]
        if source is not None and last is not None and last[0]() is source and last[1] == key:
            return last[2]
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        embeds = torch.empty(batch, length, 0, dtype=dtype, device=device)  # only its shape, dtype and device
        two_d = None if padding is None else padding[:, 0, 0, :].to(torch.bool)
        if causal:
            mask = create_causal_mask(config=self.mask_config, inputs_embeds=embeds, attention_mask=two_d, cache=None,
                                      position_ids=packed_position_ids if padding is None else None)
        else:
            mask = create_bidirectional_mask(config=self.mask_config, inputs_embeds=embeds, attention_mask=two_d)
        if source is not None:
            _LAST[0] = (weakref.ref(source, _forget), key, mask)
        return mask


def take_whole_mask(args: tuple, kwargs: dict, group: SequenceGroup, owner: str, prepared_ok: bool = False) -> None:
    """A model's forward pre-hook: its ``attention_mask`` checked to be the whole sequence's and handed on as
    ``(B, 1, 1, s)`` ([Note: masks of the whole sequence]); a mask of this rank's slice refused. ``prepared_ok``:
    a ``(B, 1, 1, s)`` mask is taken as it is (a block-sparse T5 encoder's own pre-hook runs first)."""
    lead = kwargs.get("input_ids", args[0] if args else None)
    lead = kwargs.get("inputs_embeds") if lead is None else lead
    mask = kwargs.get("attention_mask")
    if mask is None or lead is None:
        return
    whole = group.size * lead.shape[1]
    prepared = prepared_ok and mask.dim() == 4 and tuple(mask.shape[1:3]) == (1, 1)
    if mask.shape[-1] != whole or (mask.dim() != 2 and not prepared):
        raise ValueError(f"{owner} got an attention_mask of shape {tuple(mask.shape)} for {lead.shape[1]} local "
                         f"tokens on {group.size} sequence-parallel ranks: it must be the whole sequence's (batch, "
                         f"{whole}) padding mask, which SequenceSharding.shard_batch keeps.")
    if mask.dim() == 2:
        kwargs["attention_mask"] = mask.to(torch.bool)[:, None, None, :]


def eager_module_of(module: torch.nn.Module) -> str:
    """The transformers module defining ``module``'s class and its ``eager_attention_forward`` (the engine's
    routed subclasses keep the name but live elsewhere: the MRO is searched)."""
    for cls in type(module).__mro__:
        mod = sys.modules.get(cls.__module__)
        if mod is not None and cls.__module__.startswith("transformers.") and \
                hasattr(mod, "eager_attention_forward"):
            return cls.__module__
    raise TypeError(f"{type(module).__name__} is not an HF attention with an eager_attention_forward.")
