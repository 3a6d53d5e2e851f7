"""Cut an HF-style GPT-2 (``transformer.wte/wpe/drop/h/ln_f`` + ``lm_head``) into pipeline stages by block index.

Design note
-----------
A stage is built from the model's own modules (no copy, no re-implementation of a block): the first stage
owns the embeddings, every stage a contiguous run of blocks, the last ``ln_f`` and the head. Blocks get no
attention mask, which is what GPT-2 itself passes them under SDPA without padding (its causal mask then
reduces to SDPA's ``is_causal``); the eager attention would need the explicit mask, so it is refused rather
than run silently non-causal. ``source_prefixes`` maps the stage's names back to the model's, so per-stage
checkpoints consolidate into the model's own state dict. Imports nothing from transformers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


class GPT2PipelineStage(nn.Module):
    """Blocks ``[lo, hi)`` of a GPT-2, plus the embeddings (first stage) and ``ln_f`` + head (last stage)."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        tr = model.transformer
        self.first, self.last = first, last
        self.source_prefixes = {f"blocks.{i}": f"transformer.h.{lo + i}" for i in range(hi - lo)}
        if first:
            self.wte, self.wpe, self.drop = tr.wte, tr.wpe, tr.drop
            self.source_prefixes.update(wte="transformer.wte", wpe="transformer.wpe")
        self.blocks = nn.ModuleList(tr.h[lo:hi])
        if last:
            self.ln_f, self.lm_head = tr.ln_f, model.lm_head
            self.source_prefixes.update(ln_f="transformer.ln_f", lm_head="lm_head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # x: token ids (batch, seq)
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            out = block(x)
            x = out[0] if isinstance(out, tuple) else out
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def even_split(num_blocks: int, num_stages: int) -> list[int]:
    """First block of each stage, the blocks spread as evenly as possible (earlier stages get the extra)."""
    base, extra = divmod(num_blocks, num_stages)
    starts, at = [], 0
    for s in range(num_stages):
        starts.append(at)
        at += base + (s < extra)
    return starts


def split_gpt2(model: nn.Module, num_stages: int, stage_index: int,
               starts: Optional[Sequence[int]] = None) -> GPT2PipelineStage:
    """Stage ``stage_index`` of ``model`` cut into ``num_stages``; ``starts``: first block of each stage
    (default: :func:`even_split`)."""
    blocks = len(model.transformer.h)
    starts = list(starts) if starts is not None else even_split(blocks, num_stages)
    if len(starts) != num_stages or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) \
            or starts[-1] >= blocks:
        raise ValueError(f"split points {starts} do not cut {blocks} GPT-2 blocks into {num_stages} stages. Allowed: "
                         f"{num_stages} strictly increasing block indices starting at 0, each stage at least one "
                         f"block, all below {blocks} (e.g. {even_split(blocks, num_stages)}).")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} is not a stage of {num_stages}. Allowed: 0 ... {num_stages - 1}.")
    cfg = model.config
    if num_stages > 1 and getattr(cfg, "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings=True ties the first stage's wte to the last stage's lm_head, which "
                         "live on different ranks. Allowed: tie_word_embeddings=False (untied head) with pipeline "
                         "stages, or one stage.")
    attn = getattr(cfg, "_attn_implementation", None)
    if attn not in (None, "sdpa"):
        raise ValueError(f"split_gpt2 runs blocks without an explicit mask, which is causal only under SDPA; the model "
                         f"uses attn_implementation={attn!r}. Allowed: attn_implementation='sdpa'.")
    hi = starts[stage_index + 1] if stage_index + 1 < num_stages else blocks
    return GPT2PipelineStage(model, starts[stage_index], hi, stage_index == 0, stage_index == num_stages - 1)
