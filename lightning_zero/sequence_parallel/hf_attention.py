"""Ulysses self-attention for HF GPT-2 and Llama through transformers' ``AttentionInterface``.

These models reach their attention kernel by the name in ``module.config._attn_implementation``, after
they projected this rank's positions (and applied Llama's RoPE at their global positions: the position ids
are sliced with the batch). Each split attention module gets its own shallow copy of the config naming
``"lz_ulysses"`` (registered here) and a parameterless ``ulysses`` child (``UlyssesAttention``); the model's
config, its state dict and what ``save_pretrained`` writes are untouched.

The registered function exchanges q, k and v to head-sharded whole sequences (``all_to_all.py``), runs the
module's ORIGINAL kernel -- eager, SDPA, or the block-sparse one with its layout cut to this rank's heads
(``sparse_heads.py``) -- with the whole sequence's mask ([Note: masks of the whole sequence]), and
exchanges the output back to this rank's positions.

[Note: grouped-query attention under Ulysses] Llama's key/value heads are exchanged like its query heads:
rank r receives query heads ``r*H/S ..`` and key/value heads ``r*KV/S ..``, and query head h's key/value head
h // (H/KV) is among them exactly when S divides KV; the kernel's ``num_key_value_groups`` (H/KV) stays right.
When S does not divide KV, each key/value head is first repeated ``x = S / gcd(KV, S)`` times (the fewest
copies whose count S divides; x divides H/KV because S and KV both divide H): query head h's head among the
KV*x is h // (H/(KV*x)), a copy of its own, and the kernel is handed the module with
``num_key_value_groups = H/(KV*x)``. The copies' gradients sum back into the head (repeat_interleave's
backward). So only the query heads must split: S divides H (``apply.py`` says so before a forward); k and v
then cost x times their bytes on the wire.

transformers is imported inside the functions only.
"""
from __future__ import annotations

import copy
import math
from typing import Any

from lightning_zero.sequence_parallel.all_to_all import heads_to_seq, seq_to_heads
from lightning_zero.sequence_parallel.group_ref import SequenceGroup
from lightning_zero.sequence_parallel.sparse_heads import HeadShardLayout
from lightning_zero.sequence_parallel.split_attention import UlyssesAttention, eager_module_of
from lightning_zero.sparse_attention.hf_causal import CausalSparseAttention

IMPLEMENTATION = "lz_ulysses"


def ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs: Any):
    """transformers' attention-function signature: (B, H, s/S, d) in, (B, s/S, H, d) and no weights out."""
    sp: UlyssesAttention = module.ulysses
    group = sp.group.group
    kernel_module = module
    heads, kv_heads, size = query.shape[1], key.shape[1], sp.group.size
    if kv_heads % size:  # [Note: grouped-query attention under Ulysses]
        copies = size // math.gcd(kv_heads, size)
        key, value = key.repeat_interleave(copies, dim=1), value.repeat_interleave(copies, dim=1)
        kernel_module = _KeyValueGroups(module, heads // (kv_heads * copies))
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    B, _, s, _ = q.shape
    mask = sp.whole_mask(attention_mask, B, s, q.dtype, q.device, causal=True,
                         packed_position_ids=kwargs.pop("packed_position_ids", None))
    if sp.kernel == "eager" and getattr(module, "reorder_and_upcast_attn", False):
        out, _ = module._upcast_and_reordered_attn(q, k, v, mask)  # GPT-2's own eager variant
    else:
        out, _ = sp.kernel_function()(kernel_module, q, k, v, mask, **kwargs)
    out = heads_to_seq(out.transpose(1, 2), group)  # the kernels return (B, s, H/S, d)
    return out.transpose(1, 2).contiguous(), None


class _KeyValueGroups:
    """``module`` as a kernel reads it, with ``num_key_value_groups`` of the repeated key/value heads."""

    def __init__(self, module: Any, groups: int):
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, ulysses_attention_forward)


class CausalUlyssesAttention(UlyssesAttention):
    """The ``ulysses`` child of a split GPT-2 / Llama attention: unpickled (a spawned worker), it registers the
    attention function its parent's config names before any forward needs it; its group:
    [Note: a group that survives pickling]."""

    def __setstate__(self, state):
        super().__setstate__(state)
        register()


def self_attention_modules(model: Any) -> list:
    """(path, module, query heads) of every GPT-2 / Llama self-attention in ``model``."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention

    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, GPT2Attention) and not mod.is_cross_attention:
            found.append((name, mod, mod.num_heads))
        elif isinstance(mod, LlamaAttention):
            found.append((name, mod, mod.config.num_attention_heads))
    return found


def kernel_of(module: Any) -> str:
    """The kernel a self-attention runs (before it was split, when it was)."""
    if isinstance(getattr(module, "ulysses", None), UlyssesAttention):
        return module.ulysses.kernel
    return module.config._attn_implementation or "eager"


def split_attention(module: Any, group: SequenceGroup) -> None:
    """Make one GPT-2 / Llama self-attention a Ulysses one over ``group``, in place; again: a new group."""
    kernel = kernel_of(module)
    old = getattr(module, "ulysses", None)
    sparse_config = None
    if kernel == "lz_block_sparse":
        sparse_config = old.sparse_config if isinstance(old, UlyssesAttention) else module.sparse.sparsity_config
        sparse = module.sparse
        module.sparse = CausalSparseAttention(HeadShardLayout(sparse_config, group.rank, group.size), causal=True,
                                              pad_to_block=sparse.pad_to_block)
    config = old.mask_config if isinstance(old, UlyssesAttention) else module.config
    module.ulysses = CausalUlyssesAttention(group, kernel, eager_module_of(module), config, sparse_config)
    if not isinstance(old, UlyssesAttention):
        module.config = copy.copy(module.config)
        module.config._attn_implementation = IMPLEMENTATION
