"""One call that makes an HF T5 encoder's self-attention block-sparse, weights and state-dict keys unchanged.

Each encoder ``T5Attention`` becomes a ``SparseT5Attention`` (a subclass, ``__class__`` swapped in place):
the same object with the same ``q, k, v, o`` and ``relative_attention_bias``, the same hooks (a stage-3
engine's units are the ``T5Block``s around it and do not move), and a parameterless ``sparse`` child. The
config is not touched, so ``save_pretrained`` / ``lightning-zero export --hf`` write a stock T5 that the stock
class loads; a run that trained sparse swaps again after loading.

[Note: the bias and the mask stay O(n)] Stock T5 builds a (1, H, n, n) position bias in the first layer and
hands it to the others, and a (B, 1, n, n) padding mask. Here the first layer computes its bias per relative
distance, a (H, 2n - 1) table that every layer gathers per block (``RelativeBias``), and a forward pre-hook on
the encoder passes the padding mask as (B, 1, 1, n), which HF's mask builder returns as-is.

transformers is imported inside the functions only: the package imports neither Lightning nor transformers.
"""
from __future__ import annotations

from typing import Any

import torch

from lightning_zero.sparse_attention.attention import SparseSelfAttention
from lightning_zero.sparse_attention.block_sparse import RelativeBias
from lightning_zero.sparse_attention.layout_checks import check_options
from lightning_zero.sparse_attention.layouts import SparsityConfig, make_sparsity_config
from lightning_zero.sparse_attention.mixed_classes import MixedClasses

_HOOK_ATTR = "_lz_sparse_mask_hook"


def _relative_table(attn: Any, n: int) -> torch.Tensor:
    """T5's bias at every relative distance -(n-1) .. n-1 (the encoder's bidirectional buckets), (H, 2n - 1).

    Handed to the next layers as this plain tensor, not a ``RelativeBias``: HF's gradient checkpointing (also
    with ``use_reentrant=True``) then sees it as an input and its gradient flows back to the first layer."""
    rel = torch.arange(-(n - 1), n, device=attn.relative_attention_bias.weight.device)
    buckets = attn._relative_position_bucket(rel, bidirectional=not attn.is_decoder,
                                             num_buckets=attn.relative_attention_num_buckets,
                                             max_distance=attn.relative_attention_max_distance)
    return attn.relative_attention_bias(buckets).t()


def _key_padding(mask: torch.Tensor | None, dtype: torch.dtype):
    """HF's encoder mask -> (key_padding_mask, attn_mask): (B, 1, 1, n) or a query-independent 4-D mask is a
    key padding mask; anything else is kept as a dense mask."""
    if mask is None:
        return None, None
    keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    if mask.dtype != torch.bool and bool(((mask != 0) & keep).any()):
        raise ValueError("SparseT5Attention takes HF's boolean or 0 / finfo.min masks; an additive mask with "
                         "other values is a bias: pass it as position_bias.")
    if keep.dim() == 4 and keep.shape[1] == 1 and (keep.shape[2] == 1 or bool((keep == keep[:, :, :1]).all())):
        return keep[:, 0, 0], None
    return None, keep


class SparseT5Attention(torch.nn.Module):
    """Mixin body; the real class is made by ``_sparse_class`` as a subclass of transformers' T5Attention."""

    sparse: SparseSelfAttention

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
        if key_value_states is not None or cache is not None:
            raise ValueError("SparseT5Attention is encoder self-attention only (no key_value_states, no cache).")
        B, n = hidden_states.shape[:2]
        shape = (B, n, -1, self.key_value_proj_dim)
        q, k, v = (lin(hidden_states).view(shape).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if position_bias is None and self.has_relative_attention_bias:
            position_bias = _relative_table(self, self.sparse.padded_length(n))
        bias = position_bias
        if isinstance(bias, torch.Tensor) and bias.dim() == 2:  # the first layer's table
            bias = RelativeBias(bias, (bias.shape[1] - 1) // 2)
        key_padding_mask, attn_mask = _key_padding(mask, q.dtype)
        out = self.sparse(q, k, v, bias=bias, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                          scale=1.0, dropout_p=self.dropout if self.training else 0.0)
        out = self.o(out.transpose(1, 2).reshape(B, n, -1))
        return out, position_bias, None


# transformers' own T5Attention's class is found by pickle under this name ([Note: mixed classes that pickle])
_T5_CLASS_NAME = "SparseT5AttentionForT5Attention"


def _stock_bases() -> dict:
    from transformers.models.t5.modeling_t5 import T5Attention

    return {T5Attention: _T5_CLASS_NAME}


_CLASSES = MixedClasses(SparseT5Attention, globals(), "Sparse", _stock_bases)
_sparse_class = _CLASSES.of


def __getattr__(name: str):
    if name == _T5_CLASS_NAME:
        return _CLASSES.by_name(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _encoder_mask_hook(module, args, kwargs):
    mask = kwargs.get("attention_mask")
    if mask is None and len(args) > 1:
        raise ValueError("pass attention_mask to the sparse T5 encoder by keyword (HF's models do).")
    if mask is not None and mask.dim() == 2:
        kwargs["attention_mask"] = mask.to(torch.bool)[:, None, None, :]
    return args, kwargs


def sparsify_t5_encoder(model: Any, sparsity_config: SparsityConfig | None = None, *, layout: str = "bslongformer",
                        block: int = 16, pad_to_block: bool = True, options: dict | None = None,
                        **more_options: Any) -> Any:
    """Make every self-attention of ``model``'s T5 encoder block-sparse, in place; returns ``model``.

    ``model``: ``T5ForConditionalGeneration``, ``T5Model``, ``T5EncoderModel`` or a ``T5Stack`` encoder.
    Give a ``SparsityConfig`` or a ``layout`` name (dense, fixed, variable, bigbird, bslongformer, local) with
    ``block`` and the layout's own options (``num_sliding_window_blocks=3``, ...); ``num_heads`` comes from
    the model (``options={...}``, the recipe's ``model.sparse.options``, and keywords merge). Calling it again
    replaces the layout.
    """
    options = check_options(options, more_options)
    from transformers.models.t5.modeling_t5 import T5Attention, T5Stack

    encoder = model if isinstance(model, T5Stack) else getattr(model, "encoder", None)
    if not isinstance(encoder, T5Stack) or encoder.is_decoder:
        raise TypeError(f"sparsify_t5_encoder needs a T5 model with an encoder (T5ForConditionalGeneration, "
                        f"T5Model, T5EncoderModel or the encoder T5Stack), got {type(model).__name__}.")
    heads = encoder.config.num_heads
    if sparsity_config is None:
        sparsity_config = make_sparsity_config(layout, heads, block, **options)
    elif options:
        raise ValueError(f"options {sorted(options)} given with a sparsity_config: set them on the config.")
    if sparsity_config.num_heads != heads:
        raise ValueError(f"sparsity_config.num_heads={sparsity_config.num_heads} but the encoder has {heads} heads.")
    if getattr(sparsity_config, "attention", "bidirectional") != "bidirectional":
        raise ValueError("the T5 encoder attends both ways: use attention='bidirectional' for its layout.")
    for blk in encoder.block:
        attn = blk.layer[0].SelfAttention
        if not isinstance(attn, T5Attention):
            raise TypeError(f"encoder self-attention is {type(attn).__name__}, expected T5Attention.")
        attn.__class__ = _sparse_class(type(attn))
        attn.sparse = SparseSelfAttention(sparsity_config, causal=False, pad_to_block=pad_to_block)
    if not hasattr(encoder, _HOOK_ATTR):
        setattr(encoder, _HOOK_ATTR, encoder.register_forward_pre_hook(_encoder_mask_hook, with_kwargs=True))
    return model


def is_sparse(model: Any) -> bool:
    enc = getattr(model, "encoder", model)
    return any(isinstance(m, SparseT5Attention) for m in enc.modules())


def describe_sparse(model: Any) -> str | None:
    """What a run's summary says about the encoder's attention: None when no layer is sparse, else how many
    layers and with which layout (the first swapped layer's; ``sparsify_t5_encoder`` gives all the same)."""
    enc = getattr(model, "encoder", model)
    attns = [m for m in enc.modules() if isinstance(m, SparseT5Attention)]
    if not attns:
        return None
    total = len(getattr(enc, "block", attns))  # one self-attention per encoder block
    sparse = attns[0].sparse
    pad = "padded to the block" if sparse.pad_to_block else "lengths must be multiples of the block"
    return (f"block-sparse encoder self-attention in {len(attns)} of {total} layers: "
            f"{sparse.sparsity_config.describe()}; {pad}")


__all__ = ["SparseT5Attention", "sparsify_t5_encoder", "is_sparse", "describe_sparse"]
