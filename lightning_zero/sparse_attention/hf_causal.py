"""Block-sparse causal self-attention for HF GPT-2 and Llama, swapped in with one call.

These models reach their attention kernel through transformers' ``AttentionInterface`` by the name in
``module.config._attn_implementation``. Each swapped attention module gets its own shallow copy of the config
naming ``"lz_block_sparse"`` (registered here) and a parameterless ``sparse`` child: the model's config (what
``save_pretrained`` writes), its masks (built from the model's config, so still SDPA's) and its state dict
are untouched, and the stock class loads the weights back.

[Note: the decode step] With a KV cache the queries (the new tokens) are fewer than the keys; the kernel is
square, so those steps run SDPA with the layout's rows of the new positions as a boolean mask (O(new x n)),
the same attention the square kernel computes for those positions.

transformers is imported inside the functions only.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from lightning_zero.sparse_attention.attention import SparseSelfAttention
from lightning_zero.sparse_attention.layout_checks import check_options
from lightning_zero.sparse_attention.layouts import SparsityConfig, make_sparsity_config

IMPLEMENTATION = "lz_block_sparse"


def _keep(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _padding_of_causal(keep: torch.Tensor):
    """(B, 1, n, n) causal-and-padding mask -> its key padding (B, n) if that is all it says, else None."""
    if keep.dim() != 4 or keep.shape[1] != 1:
        return None
    n = keep.shape[-1]
    kp = keep[:, 0, -1, :]  # the last query sees every real key
    causal = torch.ones(n, n, dtype=torch.bool, device=keep.device).tril()
    return kp if bool(((causal & kp[:, None, :]) == keep[:, 0]).all()) else None


def block_sparse_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                                   scaling: float | None = None, dropout: float = 0.0, **kwargs: Any):
    """transformers' attention-function signature: (B, H, q, d) in, (B, q, H, d) and no weights out."""
    sparse: SparseSelfAttention = module.sparse
    H = query.shape[1]
    if key.shape[1] != H:  # grouped-query attention: each key/value head serves H / kv query heads
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    q_len, k_len = query.shape[-2], key.shape[-2]
    keep = None if attention_mask is None else _keep(attention_mask)
    if q_len == k_len:
        kp = None if keep is None else _padding_of_causal(keep)
        out = sparse(query, key, value, key_padding_mask=kp, attn_mask=keep if kp is None else None,
                     scale=scaling, dropout_p=dropout)
    else:  # [Note: the decode step]
        layout = sparse.layout(k_len)
        b = sparse.block
        qpos = torch.arange(k_len - q_len, k_len)
        allowed = layout[:, qpos // b].repeat_interleave(b, dim=-1)[..., :k_len]  # (H, q, k)
        allowed = (allowed & (torch.arange(k_len)[None, :] <= qpos[:, None])).to(query.device)[None]
        if keep is not None:
            allowed = allowed & keep[..., -q_len:, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, block_sparse_attention_forward)


class CausalSparseAttention(SparseSelfAttention):
    """The ``sparse`` child of a swapped GPT-2 / Llama attention: unpickled (a spawned worker), it registers
    the attention function its parent's config names before any forward needs it."""

    def __setstate__(self, state):
        super().__setstate__(state)
        _register()


def _self_attention_modules(model: Any) -> list:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention

    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, GPT2Attention):
            if not mod.is_cross_attention:
                found.append((name, mod))
        elif isinstance(mod, LlamaAttention):
            found.append((name, mod))
    return found


def sparsify_causal_lm(model: Any, sparsity_config: SparsityConfig | None = None, *, layout: str = "fixed",
                       block: int = 16, pad_to_block: bool = True, options: dict | None = None,
                       **more_options: Any) -> Any:
    """Make every self-attention of an HF GPT-2 or Llama model block-sparse and causal, in place; returns it.

    A ``SparsityConfig`` or a ``layout`` name with ``block`` and the layout's options (``num_heads`` from the
    model; ``attention`` defaults to ``'unidirectional'``: the blocks above the diagonal would be masked anyway).
    """
    found = _self_attention_modules(model)
    if not found:
        raise TypeError(f"sparsify_causal_lm found no GPT2Attention or LlamaAttention self-attention in "
                        f"{type(model).__name__}; for T5 use sparsify_t5_encoder.")
    heads = found[0][1].config.num_attention_heads
    options = check_options(options, more_options)
    if sparsity_config is None:
        if layout in ("fixed", "variable", "bigbird", "bslongformer", "local"):
            options.setdefault("attention", "unidirectional")
        sparsity_config = make_sparsity_config(layout, heads, block, **options)
    elif options:
        raise ValueError(f"options {sorted(options)} given with a sparsity_config: set them on the config.")
    if sparsity_config.num_heads != heads:
        raise ValueError(f"sparsity_config.num_heads={sparsity_config.num_heads} but the model has {heads} heads.")
    _register()
    for _, mod in found:
        mod.config = copy.copy(mod.config)
        mod.config._attn_implementation = IMPLEMENTATION
        mod.sparse = CausalSparseAttention(sparsity_config, causal=True, pad_to_block=pad_to_block)
    return model
