"""Ulysses self-attention for an HF T5 encoder; the decoder runs whole on every rank.

Each encoder ``T5Attention`` becomes a ``UlyssesT5Attention`` (a subclass, ``__class__`` swapped in place,
weights, hooks and state-dict keys unchanged) with a parameterless ``ulysses`` child. Its forward projects
this rank's positions, exchanges q, k, v to head-sharded whole sequences, runs T5's own kernel (eager or
SDPA, as the config says; a block-sparse encoder's kernel with its layout cut to this rank's heads) with the
relative position bias of the whole sequence for this rank's heads and the whole padding mask, and exchanges
the output back.

[Note: T5's bias on this rank's heads] The first layer computes the bias, ``(1, H/S, s, s)``, from the rows
of ``relative_attention_bias.weight`` of this rank's heads only, and hands it to the later layers as stock T5
does; the other heads' rows get no gradient here, and each head's rows get theirs on the rank holding it.

The encoder's output is all-gathered along the sequence (a forward hook; backward: the reduce-scatter-sum,
[Note: every rank computes the whole loss]), so the decoder, its cross-attention (over the whole encoder
mask: ``shard_batch`` keeps ``attention_mask`` whole for T5) and the loss are the single process's on every
rank. A forward pre-hook on the encoder passes the whole ``attention_mask`` on as ``(B, 1, 1, s)``
([Note: masks of the whole sequence]).

transformers is imported inside the functions only.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_zero.sequence_parallel.all_to_all import heads_to_seq, seq_to_heads
from lightning_zero.sequence_parallel.gather_reduce import all_gather_along
from lightning_zero.sequence_parallel.group_ref import SequenceGroup
from lightning_zero.sequence_parallel.sparse_heads import HeadShardLayout
from lightning_zero.sequence_parallel.split_attention import UlyssesAttention, eager_module_of, take_whole_mask
from lightning_zero.sparse_attention import hf_t5 as sparse_t5
from lightning_zero.sparse_attention.attention import SparseSelfAttention
from lightning_zero.sparse_attention.block_sparse import RelativeBias
from lightning_zero.sparse_attention.mixed_classes import MixedClasses

GROUP_ATTR = "lz_sequence_group"


def _head_bias(attn: Any, length: int, group: SequenceGroup, per_distance: bool = False) -> torch.Tensor:
    """[Note: T5's bias on this rank's heads]: (1, H/S, length, length), or with ``per_distance`` the block-sparse
    kernel's table (H/S, 2 length - 1) at every distance -(length-1) .. length-1."""
    pos = torch.arange(length, dtype=torch.long, device=attn.relative_attention_bias.weight.device)
    rel = torch.arange(-(length - 1), length, device=pos.device) if per_distance else pos[None, :] - pos[:, None]
    buckets = attn._relative_position_bucket(rel, bidirectional=not attn.is_decoder,
                                             num_buckets=attn.relative_attention_num_buckets,
                                             max_distance=attn.relative_attention_max_distance)
    per = attn.n_heads // group.size
    weight = attn.relative_attention_bias.weight[:, group.rank * per : (group.rank + 1) * per]
    values = F.embedding(buckets, weight)
    return values.t() if per_distance else values.permute(2, 0, 1).unsqueeze(0)


class UlyssesT5Attention(torch.nn.Module):
    """Mixin body; the real class is made by ``_ulysses_class`` as a subclass of transformers' T5Attention."""

    ulysses: UlyssesAttention

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
        if key_value_states is not None or cache is not None:
            raise ValueError("UlyssesT5Attention is encoder self-attention only (no key_value_states, no cache).")
        sp = self.ulysses
        group = sp.group.group
        B, local = hidden_states.shape[:2]
        shape = (B, local, -1, self.key_value_proj_dim)
        q, k, v = (seq_to_heads(lin(hidden_states).view(shape).transpose(1, 2), group)
                   for lin in (self.q, self.k, self.v))
        s = q.shape[2]
        dropout = self.dropout if self.training else 0.0
        sparse = getattr(self, "sparse", None)
        if isinstance(sparse, SparseSelfAttention):  # a block-sparse encoder: [Note: T5's bias on this rank's heads]
            if position_bias is None and self.has_relative_attention_bias:
                position_bias = _head_bias(self, sparse.padded_length(s), sp.group, per_distance=True)
            bias = position_bias
            if isinstance(bias, torch.Tensor) and bias.dim() == 2:  # the first layer's table
                bias = RelativeBias(bias, (bias.shape[1] - 1) // 2)
            padding = mask[:, 0, 0, :].to(torch.bool) if isinstance(mask, torch.Tensor) and mask.dim() == 4 and \
                tuple(mask.shape[1:]) == (1, 1, s) else None
            out = sparse(q, k, v, bias=bias, key_padding_mask=padding, scale=1.0, dropout_p=dropout)
        else:
            if position_bias is None:
                position_bias = _head_bias(self, s, sp.group) if self.has_relative_attention_bias else \
                    q.new_zeros(1, q.shape[1], s, s)
            whole = sp.whole_mask(mask, B, s, q.dtype, q.device, causal=False)
            out, _ = sp.kernel_function()(self, q, k, v, whole, dropout=dropout, scaling=self.scaling,
                                          position_bias=position_bias, **kwargs)
            out = out.transpose(1, 2)
        out = heads_to_seq(out, group)
        return self.o(out.transpose(1, 2).reshape(B, local, -1)), position_bias, None


# The classes for transformers' own T5Attention and for sparse_attention's class made from it are found by pickle
# under these names ([Note: mixed classes that pickle], sparse_attention/mixed_classes.py)
_T5_CLASS_NAME = "UlyssesT5AttentionForT5Attention"
_SPARSE_CLASS_NAME = "UlyssesT5AttentionForSparseT5Attention"


def _stock_bases() -> dict:
    from transformers.models.t5.modeling_t5 import T5Attention

    return {T5Attention: _T5_CLASS_NAME, getattr(sparse_t5, "SparseT5AttentionForT5Attention"): _SPARSE_CLASS_NAME}


_CLASSES = MixedClasses(UlyssesT5Attention, globals(), "Ulysses", _stock_bases)
_ulysses_class = _CLASSES.of


def __getattr__(name: str):
    found = _CLASSES.by_name(name) if name in (_T5_CLASS_NAME, _SPARSE_CLASS_NAME) else None
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found


def _encoder_pre_hook(module, args, kwargs):
    """The whole ``attention_mask`` as ``(B, 1, 1, s)``; a mask of this rank's slice refused."""
    group: SequenceGroup = getattr(module, GROUP_ATTR)
    if len(args) > 1:
        raise ValueError("pass the T5 encoder's arguments by keyword under sequence parallelism (HF's models do).")
    take_whole_mask(args, kwargs, group, "the T5 encoder", prepared_ok=True)
    return args, kwargs


def _encoder_gather_hook(module, args, kwargs, output):
    group: SequenceGroup = getattr(module, GROUP_ATTR)
    if isinstance(output, tuple):
        return (all_gather_along(output[0], 1, group.group),) + tuple(output[1:])
    output["last_hidden_state"] = all_gather_along(output["last_hidden_state"], 1, group.group)
    return output


def t5_encoder(model: Any) -> Any:
    """The encoder ``T5Stack`` of a T5 model, or None."""
    from transformers.models.t5.modeling_t5 import T5Stack

    encoder = model if isinstance(model, T5Stack) else getattr(model, "encoder", None)
    return encoder if isinstance(encoder, T5Stack) and not encoder.is_decoder else None


def encoder_attentions(encoder: Any) -> list:
    """(path, module) of every encoder self-attention."""
    return [(f"encoder.block.{i}.layer.0.SelfAttention", blk.layer[0].SelfAttention)
            for i, blk in enumerate(encoder.block)]


def split_t5_encoder(encoder: Any, group: SequenceGroup) -> None:
    """Every encoder self-attention a Ulysses one over ``group`` and the encoder's hooks, in place; again: a
    new group."""
    for _, attn in encoder_attentions(encoder):
        old = getattr(attn, "ulysses", None)
        kernel = old.kernel if isinstance(old, UlyssesAttention) else (attn.config._attn_implementation or "eager")
        sparse_config = None
        if isinstance(getattr(attn, "sparse", None), SparseSelfAttention):  # its layout cut to this rank's heads
            sparse_config = old.sparse_config if isinstance(old, UlyssesAttention) else attn.sparse.sparsity_config
            attn.sparse = SparseSelfAttention(HeadShardLayout(sparse_config, group.rank, group.size), causal=False,
                                              pad_to_block=attn.sparse.pad_to_block)
        attn.__class__ = _ulysses_class(type(attn))
        attn.ulysses = UlyssesAttention(group, kernel, eager_module_of(attn), attn.config, sparse_config)
    setattr(encoder, GROUP_ATTR, group)
    if _encoder_pre_hook not in encoder._forward_pre_hooks.values():
        encoder.register_forward_pre_hook(_encoder_pre_hook, with_kwargs=True)
    if _encoder_gather_hook not in encoder._forward_hooks.values():
        encoder.register_forward_hook(_encoder_gather_hook, with_kwargs=True)
