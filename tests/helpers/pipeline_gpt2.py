"""The pipeline tests' tiny HF GPT-2 (cut between blocks), its data, and the single-process reference.

The reference trains the uncut GPT2LMHeadModel in one process on the same global batch, cut into the same
D x M micro-batches whose gradients are summed: what DDP over D ranks with M accumulation steps computes (see
tests/test_pipeline.py for why the cut is shared and lr is 1e-3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_zero.engine import ZeroConfig
from lightning_zero.engine.pipeline.pipeline_zero import PipelineZero, pipeline_layout, virtual_stages
from lightning_zero.engine.pipeline.split import split_gpt2

VOCAB, SEQ, BATCH, M = 64, 8, 8, 2  # global batch of 8 sequences; M micro-batches per replica
ACCUM, CLIP, LR = 2, 0.5, 1e-3
CALLS = 6  # step() calls = 3 optimizer steps
RTOL, ATOL = 1e-5, 1e-6


def gpt2_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def lm_loss(logits, ids):  # next-token cross-entropy, mean over the micro-batch's tokens
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def global_batch(call):
    g = torch.Generator().manual_seed(100 + call)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def single_process_reference(dp_sizes):
    """Single process, one entry of ``dp_sizes`` per step() call: the data-parallel size of that call."""
    model = gpt2_model()
    opt = adamw(model.parameters())
    losses = []
    for call, dp in enumerate(dp_sizes):
        ids, total = global_batch(call), 0.0
        for chunk in ids.chunk(dp * M):
            loss = lm_loss(model(chunk).logits, chunk)
            (loss / (dp * M * ACCUM)).backward()
            total += loss.item() / (dp * M)
        losses.append(total)
        if call % ACCUM == ACCUM - 1:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            assert norm > CLIP  # the clip acts
            opt.step()
            opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_pipeline(num_stages, stage, schedule, grad_reduce="auto", **kw):
    lay = pipeline_layout(num_stages)
    if schedule == "interleaved":  # two chunks per rank: stages p and p + P of 2P, one block each
        model = gpt2_model()
        module = [split_gpt2(model, 2 * num_stages, i) for i in virtual_stages(lay.stage_index, num_stages, 2)]
        opt = [adamw(m.parameters()) for m in module]
    else:
        module = split_gpt2(gpt2_model(), num_stages, lay.stage_index)
        opt = adamw(module.parameters())
    return PipelineZero(module, num_stages, lm_loss, opt, M, schedule=schedule,
                        config=ZeroConfig(stage=stage, bucket_mb=0.01, grad_reduce=grad_reduce),
                        accumulate_grad_batches=ACCUM,
                        gradient_clip_val=CLIP, **kw)


def train_pipeline(pipe, calls):
    lay, losses = pipe.layout, []
    rows = BATCH // lay.dp_size
    for call in range(calls):
        ids = global_batch(call)[lay.dp_rank * rows:(lay.dp_rank + 1) * rows]
        losses.append(pipe.step(ids, ids).item())
    return losses


def named_state(pipe):
    return {sd["source_names"][k]: v for sd in pipe.state_dicts() for k, v in sd["model"].items()}


def run_calls(pipe, calls):
    """Losses of ``pipe.step`` over the calls in ``calls`` (a range: a resumed run starts past the saved ones),
    each data-parallel replica on its rows of the global batch."""
    lay, rows = pipe.layout, BATCH // pipe.layout.dp_size
    return [pipe.step(ids, ids).item() for ids in
            (global_batch(c)[lay.dp_rank * rows:(lay.dp_rank + 1) * rows] for c in calls)]
