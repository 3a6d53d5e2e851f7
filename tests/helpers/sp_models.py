"""Tiny HF models and one rank's run for the sequence-parallel tests: the reference is one process on the
whole sequence (each rank computes it locally, no collective), the run is the same model split over the
default group, both from the same seed."""
from __future__ import annotations

import copy

import torch

RTOL, ATOL = 1e-5, 1e-6
VOCAB = 96


def causal_lm(arch: str, impl: str = "sdpa", heads: int = 4, kv_heads: int = 2, hidden: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=2, n_head=heads, n_positions=128,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          attn_implementation=impl))
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads,
                                        max_position_embeddings=128, attn_implementation=impl))


def t5(impl: str = "sdpa", heads: int = 4):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=heads, d_ff=64, num_layers=2, num_decoder_layers=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, attn_implementation=impl))


def causal_batch(length: int, batch: int = 2, pad_last: int = 7, seed: int = 3) -> dict:
    """Right-padded: the second row's last ``pad_last`` positions are padding (label -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if pad_last:
        mask[-1, length - pad_last :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def t5_batch(length: int, target: int = 9, seed: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length - 5 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(2, VOCAB, (2, target), generator=g)}


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_pair(model, batch: dict, group=None) -> tuple:
    """The whole-sequence reference and the sequence-parallel run of ``model`` on ``batch``, one backward each:
    (what ``check_pair`` compares, the split model, its sharding)."""
    from lightning_zero.sequence_parallel import apply_sequence_parallel

    ref = copy.deepcopy(model)
    out_ref = ref(**batch)
    out_ref.loss.backward()
    sharding = apply_sequence_parallel(model, group)
    local = sharding.shard_batch(batch)
    out = model(**local)
    out.loss.backward()
    return {"size": sharding.size, "rank": sharding.rank, "loss": out.loss.detach(), "ref_loss": out_ref.loss.detach(),
            "logits": out.logits.detach(), "ref_logits": out_ref.logits.detach(), "grads": grads(model),
            "ref_grads": grads(ref)}, model, sharding


def close(a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def close_grad(a, b):
    """rtol 1e-5 with an absolute floor at 1e-6 of the tensor's largest entry (a gradient summed in another
    order cancels to a few ulps of its scale where its true value is near zero)."""
    torch.testing.assert_close(a, b, rtol=RTOL, atol=max(ATOL, 1e-6 * float(b.abs().max())))


def check_pair(results: list, length: int) -> None:
    """Every rank: the whole loss, its slice of the logits; the ranks' gradients averaged: the reference's."""
    size = len(results)
    local = -(-length // size)
    for r, res in enumerate(results):
        close(res["loss"], res["ref_loss"])
        ref = res["ref_logits"][:, r * local : (r + 1) * local]
        close(res["logits"][:, : ref.shape[1]], ref)
    for name, ref in results[0]["ref_grads"].items():
        close_grad(sum(res["grads"][name] for res in results) / size, ref)
