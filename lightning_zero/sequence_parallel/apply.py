"""``apply_sequence_parallel(model, group)``: an HF GPT-2, Llama or T5 model split along the sequence over
``group``, in place; returns its ``SequenceSharding``. ``check_sequence_parallel(model, size)``: the same
checks without a group, before any rank starts.

Every attention is checked before anything changes (one error naming the first module that cannot be
split, its head counts, S and the sizes that work). Calling it again -- the same group, another one, or in
a process where the model was unpickled -- re-binds the model to ``group``; nothing is wrapped twice.

A causal LM gets a forward pre-hook on the model given ([Note: masks of the whole sequence]: the whole 2-D
mask on as ``(B, 1, 1, s)``, a mask of the local slice refused) and its ``loss_function`` wrapped
(``WholeSequenceLoss``); a T5 model its encoder's attentions and hooks (``hf_t5.py``).
"""
from __future__ import annotations

from typing import Any

import torch

from lightning_zero.sequence_parallel.batch import SequenceSharding
from lightning_zero.sequence_parallel.group_ref import SequenceGroup
from lightning_zero.sequence_parallel.hf_attention import kernel_of, register, self_attention_modules, split_attention
from lightning_zero.sequence_parallel.hf_t5 import GROUP_ATTR, encoder_attentions, split_t5_encoder, t5_encoder
from lightning_zero.sequence_parallel.loss import WholeSequenceLoss
from lightning_zero.sequence_parallel.split_attention import KERNELS, take_whole_mask


def _sizes(heads: int) -> list[int]:
    return [d for d in range(1, heads + 1) if heads % d == 0]


def _check(found: list, size: int) -> None:
    for path, mod, heads in found:
        kernel = kernel_of(mod)
        if kernel not in KERNELS:
            raise ValueError(f"{path} ({type(mod).__name__}) runs attn_implementation={kernel!r}: sequence "
                             f"parallelism runs the kernel on whole sequences of its heads for {list(KERNELS)} "
                             "(set attn_implementation to one of them).")
        if heads % size:  # key/value heads need not split: [Note: grouped-query attention under Ulysses]
            raise ValueError(f"{path} ({type(mod).__name__}) has {heads} attention heads: sequence parallelism "
                             f"of size {size} gives each rank {heads}/{size} whole heads, so S must divide the "
                             f"head count; allowed sizes: {_sizes(heads)}.")


def _causal_pre_hook(module, args, kwargs):
    """The whole padding mask on as (B, 1, 1, s); a local one, positional arguments past input_ids, a cache
    and unshifted labels refused."""
    group: SequenceGroup = getattr(module, GROUP_ATTR)
    if len(args) > 1:
        raise ValueError("pass the model's arguments by keyword under sequence parallelism "
                         "(model(**sharding.shard_batch(batch))).")
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise ValueError("sequence parallelism splits whole sequences: no KV cache (generate without it).")
    take_whole_mask(args, kwargs, group, f"the {type(module).__name__}")
    if group.size > 1 and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError("labels without shift_labels under sequence parallelism: pass the batch through "
                         "SequenceSharding.shard_batch (the labels are shifted on the whole sequence).")
    kwargs["use_cache"] = False
    return args, kwargs


def _pad_token_id(config: Any) -> int:
    pad = getattr(config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) and pad >= 0 else 0


def check_sequence_parallel(model: torch.nn.Module, size: int) -> str:
    """Whether ``model`` splits over ``size`` ranks, without a process group and without changing it (a
    launcher asks before the ranks start): its kind ("causal_lm" or "t5"), or the one error
    ``apply_sequence_parallel`` would raise."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"the sequence-parallel size must be an integer >= 1, got {size!r}.")
    encoder = t5_encoder(model)
    if encoder is not None:
        heads = encoder.config.num_heads
        _check([(p, m, heads) for p, m in encoder_attentions(encoder)], size)
        return "t5"
    found = self_attention_modules(model)
    if not found:
        raise TypeError(f"apply_sequence_parallel splits HF GPT-2 and Llama models (GPT2Attention, LlamaAttention "
                        f"self-attention) and T5 encoders; {type(model).__name__} has none of them.")
    _check(found, size)
    return "causal_lm"


def apply_sequence_parallel(model: torch.nn.Module, group: Any = None) -> SequenceSharding:
    """Split ``model`` (HF GPT-2 / Llama: causal LM or base model; T5 encoder-decoder or encoder) along the
    sequence over ``group`` (a process group, None: the default one), in place; returns its sharding."""
    seq = SequenceGroup(group)
    if check_sequence_parallel(model, seq.size) == "t5":
        split_t5_encoder(t5_encoder(model), seq)
        return SequenceSharding(seq, "t5", _pad_token_id(model.config))
    found = self_attention_modules(model)
    register()
    for _, mod, _ in found:
        split_attention(mod, seq)
    setattr(model, GROUP_ATTR, seq)
    if _causal_pre_hook not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_causal_pre_hook, with_kwargs=True)
    if hasattr(type(model), "loss_function"):
        current = model.loss_function
        model.loss_function = WholeSequenceLoss(current.inner if isinstance(current, WholeSequenceLoss) else current,
                                                seq)
    return SequenceSharding(seq, "causal_lm", _pad_token_id(model.config))
