"""T5 architecture arithmetic for the estimator: parameter counts and the activations autograd saves.

Design note
-----------
The estimator must size T5-3B without building it, so parameters are counted from the preset dimensions
(checked against a meta-device model for every preset) and activations from the ops of HF's T5 forward
(checked against the saved-tensors-hook measurement of the benchmark harness; docs/tuning.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BYTE_VOCAB = 384  # the recipe's tokenizer=bytes: transformers' ByT5Tokenizer (256 bytes + 3 specials + 125 sentinels)
# The recipe's default tokenizer: its subword BPE (conf/tokenizer/subword.yaml vocab_size; a test keeps the two
# equal), hence the estimator's default vocabulary (--vocab). The tuner asks the recipe for the vocabulary of
# the run it measures (tune_model_config).
RECIPE_VOCAB = 2048
# The real architectures of the original T5 checkpoints (relu FFN, tied embeddings), plus two small sizes for
# CPU runs. The single source: the recipe (examples/t5_module.py) and conf/model/*.yaml use these.
T5_PRESETS: dict[str, dict] = {
    "t5_tiny": dict(vocab_size=259, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16),
    # ~1.4M parameters: the smallest size that learns to condition on the code within a few CPU minutes
    "t5_mini": dict(vocab_size=259, d_model=128, d_ff=512, num_layers=3, num_heads=4, d_kv=32),
    "t5_small": dict(vocab_size=32128, d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64),
    "t5_base": dict(vocab_size=32128, d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64),
    "t5_large": dict(vocab_size=32128, d_model=1024, d_ff=4096, num_layers=24, num_heads=16, d_kv=64),
    "t5_3b": dict(vocab_size=32128, d_model=1024, d_ff=16384, num_layers=24, num_heads=32, d_kv=128),
}


def t5_presets() -> dict[str, dict]:
    return {k: dict(v) for k, v in T5_PRESETS.items()}


@dataclass
class T5Dims:
    vocab_size: int
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    d_kv: int
    num_decoder_layers: Optional[int] = None
    relative_attention_num_buckets: int = 32
    gated: bool = False  # feed_forward_proj "gated-gelu" (the recipe's presets are relu)
    tied: bool = True
    dropout_rate: float = 0.0
    name: str = "t5"

    @property
    def dec_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    @property
    def inner(self) -> int:
        return self.num_heads * self.d_kv

    def block_numel(self, decoder: bool, first: bool) -> int:
        d, ff = self.d_model, self.d_ff * (3 if self.gated else 2)
        attn = (8 if decoder else 4) * d * self.inner
        bias = self.relative_attention_num_buckets * self.num_heads if first else 0
        return attn + d * ff + (3 if decoder else 2) * d + bias

    @property
    def numel(self) -> int:
        enc = sum(self.block_numel(False, i == 0) for i in range(self.num_layers))
        dec = sum(self.block_numel(True, i == 0) for i in range(self.dec_layers))
        return enc + dec + self.root_numel

    @property
    def root_numel(self) -> int:
        """Parameters outside the T5Blocks: shared embedding (+ untied head), two final norms."""
        return self.vocab_size * self.d_model * (1 if self.tied else 2) + 2 * self.d_model


_HF_ORGS = ("google-t5/", "google/")  # HF hub ids of the original checkpoints: google-t5/t5-3b, google/t5-3b


def preset_name(name: str) -> str:
    """The recipe preset ``name`` means, in our spelling (``t5_3b``) or HF's (``t5-3b``, ``google-t5/t5-3b``),
    in any case; a spelling two presets share would be refused as ambiguous (none do)."""
    key = str(name).strip().lower()
    key = next((key[len(org):] for org in _HF_ORGS if key.startswith(org)), key).replace("-", "_")
    matches = [p for p in T5_PRESETS if p.lower().replace("-", "_") == key]
    if len(matches) != 1:
        problem = "ambiguous" if matches else "unknown"
        raise ValueError(f"T5 model {name!r}: {problem} preset. Allowed: {', '.join(T5_PRESETS)} (or HF's spelling: "
                         f"{', '.join(p.replace('_', '-') for p in T5_PRESETS)}, google-t5/...; any case).")
    return matches[0]


def t5_dims(preset: str, vocab_size: Optional[int] = RECIPE_VOCAB, dropout_rate: float = 0.0, **overrides) -> T5Dims:
    """Dims of a recipe preset (:func:`preset_name`: ours or HF's spelling); ``vocab_size=None`` keeps the preset's
    own (sentencepiece) vocabulary."""
    presets = t5_presets()
    preset = preset_name(preset)
    cfg = dict(presets[preset])
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    cfg.update(overrides)
    known = {k: cfg[k] for k in T5Dims.__dataclass_fields__ if k in cfg}
    return T5Dims(**known, dropout_rate=dropout_rate, name=preset)


def t5_dims_from_config(config) -> T5Dims:
    """From a ``transformers.T5Config``."""
    return T5Dims(config.vocab_size, config.d_model, config.d_ff, config.num_layers, config.num_heads,
                  config.d_kv, config.num_decoder_layers, config.relative_attention_num_buckets,
                  bool(getattr(config, "is_gated_act", False)), bool(config.tie_word_embeddings),
                  float(config.dropout_rate), getattr(config, "name_or_path", "") or "t5")


def t5_activation_parts(dims: T5Dims, batch: int, src_len: int, tgt_len: int, mixed: bool,
                        dropout_rate: Optional[float] = None) -> dict[str, int]:
    """What autograd saves in one training forward of ``T5ForConditionalGeneration`` (one rank), in bytes:
    ``enc_layer`` / ``dec_layer`` per T5Block, ``outside`` the blocks; with every T5Block checkpointed,
    ``checkpointed`` in the forward and ``recompute``, what one block's recompute saves in backward (block 0,
    which also computes the position biases, or a decoder block).

    Counted per op from HF T5 (transformers 5, sdpa attention) in the compute dtype (``e`` bytes):
    an RMS norm saves its input's normalized copy and its output (8 bytes per element either way: fp32
    hs+y, or in half precision an fp32 upcast plus two half tensors), each residual add's output, the
    FFN's ReLU output, the embedding output and the loss's log-softmax over the vocabulary. Self-attention
    with T5's learned position bias runs sdpa's math path (the bias needs a gradient), which on CPU
    computes in fp32 and saves q, k, v and the softmax probabilities (B x heads x L^2); cross-attention
    (no bias gradient) uses the fused kernel: q, k, v, output and the log-sum-exp -- unless attention
    dropout is on, which sends it down the fp32 math path as well. Dropout (p > 0) adds
    its mask (compute dtype on CPU, 1 byte on CUDA: counted as e) and a saved output where the next op
    keeps it. Calibrated in docs/tuning.md against :class:`~lightning_zero.tuning.harness.SavedBytes`.
    """
    e = 2 if mixed else 4
    p = dims.dropout_rate if dropout_rate is None else dropout_rate
    drop = 1 if p > 0 else 0
    B, S, T = batch, src_len, tgt_len
    d, inner, ff, h, V = dims.d_model, dims.inner, dims.d_ff, dims.num_heads, dims.vocab_size
    ff_saved = ff * (3 if dims.gated else 1)  # gated: act(wi_0 x), wi_1 x and their product

    def norm(n: int) -> int:
        return 8 * n * d + 4 * n

    def self_attn(n: int, L: int) -> int:  # math path, fp32: q, k, v, probs; o's input in e
        return 12 * n * inner + 4 * B * h * L * L + e * n * inner + drop * 8 * B * h * L * L

    def ffn(n: int) -> int:
        return e * n * ff_saved + drop * 2 * e * n * ff

    ne, nd = B * S, B * T
    enc_layer = 2 * norm(ne) + 2 * e * ne * d + self_attn(ne, S) + ffn(ne) + drop * 2 * e * ne * d
    enc = e * ne * d * (1 + drop) + 8 * S * S
    enc += norm(ne) + e * ne * d * (1 + drop)  # final norm, its output (cross-attention k/v input)
    if drop:  # attention dropout sends cross-attention down the math path too (fp32, probs + mask saved)
        cross = 8 * ne * inner + 4 * nd * inner + 12 * B * h * T * S + e * nd * inner
    else:  # fused kernel: q, k, v, output (o's input), log-sum-exp
        cross = 2 * e * ne * inner + 2 * e * nd * inner + 4 * B * h * T
    dec_layer = 3 * norm(nd) + 3 * e * nd * d + self_attn(nd, T) + cross + ffn(nd) + drop * 3 * e * nd * d
    dec = e * nd * d * (1 + drop) + 8 * T * T + T * T + (0 if drop else e * h * T * S)
    dec += norm(nd) + e * nd * d * (1 + drop) + e * nd * V + 8 * nd  # final norm, head input, log-softmax
    # block 0 computes the relative position biases (the terms above that only the first block saves)
    bias0 = 8 * S * S + 8 * T * T + T * T + (0 if drop else e * h * T * S)
    # checkpointed T5Blocks save their inputs only: each block's hidden states (block 0's is the embedding
    # output, counted above), plus, once, the three position biases (1 x heads x L x L') the first blocks pass on
    ckpt = (enc + dec - e * (ne + nd) * d - bias0 + e * h * (S * S + T * T + T * S)
            + dims.num_layers * e * ne * d + dims.dec_layers * e * nd * d)
    return {"outside": int(enc + dec), "enc_layer": int(enc_layer), "dec_layer": int(dec_layer),
            "checkpointed": int(ckpt), "recompute": int(max(enc_layer + 8 * S * S,  # the first decoder block with dropout: an fp32 B x h x T x S bias
                                          dec_layer + bias0 - 8 * S * S + drop * 4 * B * h * T * S))}


def t5_activation_bytes(dims: T5Dims, batch: int, src_len: int, tgt_len: int, mixed: bool,
                        dropout_rate: Optional[float] = None) -> int:
    """Bytes autograd saves in one training forward of ``T5ForConditionalGeneration`` (one rank); see
    :func:`t5_activation_parts` for what is counted."""
    p = t5_activation_parts(dims, batch, src_len, tgt_len, mixed, dropout_rate)
    return p["outside"] + dims.num_layers * p["enc_layer"] + dims.dec_layers * p["dec_layer"]


def t5_activation_memory(dims: T5Dims, batch: int, src_len: int, tgt_len: int, mixed: bool,
                         checkpointing: bool = False, offload: bool = False,
                         dropout_rate: Optional[float] = None) -> dict[str, int]:
    """Activation bytes of one micro-batch: ``device`` at the peak, ``host`` (offloaded) and the parts.

    Checkpointing (every T5Block, ``activation_checkpointing="auto"``): what the forward saves plus one
    block's recompute, alive together in backward. Offload: the saved tensors live on the host; the device
    holds a block's worth while its backward unpacks them (or the recompute, with checkpointing).
    """
    from ..engine.placement.placement import Location, Placement  # here: the CLI imports this module without torch

    p = t5_activation_parts(dims, batch, src_len, tgt_len, mixed, dropout_rate)
    full = p["outside"] + dims.num_layers * p["enc_layer"] + dims.dec_layers * p["dec_layer"]
    saved = p["checkpointed"] if checkpointing else full
    placement = Placement.from_knobs(offload_activations=offload)  # [Note: placement]
    working = p["recompute"] if (checkpointing or placement.activations.off_device) else 0
    booked = placement.book(activations=saved)
    return {"device": int(working + booked[Location.DEVICE]), "host": int(booked[Location.HOST]),
            "saved": int(saved), "recompute": int(working if checkpointing else 0)}


# -- what the engine allocates --------------------------------------------------------------------------
