"""Tiny HF models (from configs, dropout off) and batches for the tiled MLP / tiled loss tests."""

from __future__ import annotations

import torch

from tests.helpers.zoo_models import _hf

VOCAB, SEQ, BATCH = 97, 23, 2  # 23: a prime, so no tile size used in the tests divides it


def gpt2():
    t = _hf()
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=0, eos_token_id=0))


def llama():
    t = _hf()
    return t.LlamaForCausalLM(t.LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=64, bos_token_id=0, eos_token_id=0))


def t5():
    t = _hf()
    return t.T5ForConditionalGeneration(t.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
                                                   vocab_size=VOCAB, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                                                   decoder_start_token_id=0, pad_token_id=0))


MODELS = {"gpt2": gpt2, "llama": llama}


def batch(step: int = 0, rank: int = 0, seq: int = SEQ) -> dict:
    """Token ids and labels with ignored (-100) positions, also already shifted (``shift_labels``), and the
    count of valid targets doubled, as a gradient-accumulation loop passes it (``num_items_in_batch``)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    labels = ids.clone()
    labels[0, 3:6] = -100
    labels[1, -4:] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()  # HF views it flat
    return {"input_ids": ids, "labels": labels, "shift_labels": shifted,
            "num_items_in_batch": 2 * (shifted != -100).sum()}


def lm_loss(model, b: dict, variant: str):
    """The loss of ``model`` on ``b``: HF's mean over valid labels (``"labels"``), or the already-shifted labels
    summed over ``num_items_in_batch`` (``"shift_labels"``: the labels passed are then not read)."""
    if variant == "labels":
        return model(input_ids=b["input_ids"], labels=b["labels"]).loss
    return model(input_ids=b["input_ids"], labels=b["input_ids"], shift_labels=b["shift_labels"],
                 num_items_in_batch=b["num_items_in_batch"]).loss
