"""Ulysses sequence parallelism (lightning_zero.sequence_parallel) on HF GPT-2 and Llama from tiny configs,
exact against one process on the whole sequence (fp32, rtol 1e-5): every rank's loss is the whole
sequence's, its logits the reference's slice, and the ranks' gradients averaged over the S ranks the
reference's gradients -- what the ZeRO engine's average over data- and sequence-parallel ranks makes of
them. Right-padded masks, a length that does not split, eager and SDPA kernels, GQA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zero.tools.launch import run_ranks
from tests.helpers.sp_models import causal_batch, causal_lm, check_pair, close, run_pair

# (arch, kernel, S, length, query heads, key/value heads): S=4 splits Llama's 8 query / 4 key-value heads;
# S=4 over 4 query / 2 key-value heads repeats each key/value head twice ([Note: grouped-query attention
# under Ulysses]); 30 tokens on 4 ranks pad 2 at the end
CASES = [("gpt2", "sdpa", 2, 24, 4, 4), ("gpt2", "eager", 4, 30, 4, 4), ("llama", "sdpa", 2, 24, 4, 2),
         ("llama", "eager", 4, 30, 8, 4), ("llama", "sdpa", 4, 24, 4, 2), ("llama", "eager", 4, 24, 8, 2)]


def _rank(rank, world, arch, impl, length, heads, kv_heads):
    batch = causal_batch(length)
    res, model, sharding = run_pair(causal_lm(arch, impl, heads, kv_heads), batch)
    local = sharding.shard_batch(batch)
    # a custom loss through the public function: the same whole loss from this rank's logits
    logits = model(**{k: v for k, v in local.items() if k not in ("labels", "shift_labels")}).logits
    local_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local["shift_labels"].reshape(-1),
                                ignore_index=-100, reduction="sum")
    from lightning_zero.sequence_parallel import whole_sequence_loss

    res["custom_loss"] = whole_sequence_loss(local_sum, local["num_items_in_batch"], sharding).detach()
    # the same batch as embeddings: cut along the same positions
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach()
    by_embeds = sharding.shard_batch({**{k: v for k, v in batch.items() if k != "input_ids"}, "inputs_embeds": embeds})
    real = length - rank * local["input_ids"].shape[1]  # the padded positions' logits are junk
    res["embeds_logits"] = model(**by_embeds).logits.detach()[:, :real]
    # what the data path refuses: a mask of this rank's slice, labels not shifted on the whole sequence
    errors = []
    for bad in ({**local, "attention_mask": local["attention_mask"][:, : local["input_ids"].shape[1]]},
                {k: v for k, v in local.items() if k != "shift_labels"}):
        try:
            model(**bad)
        except ValueError as err:
            errors.append(str(err))
    res["errors"] = errors
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,impl,size,length,heads,kv_heads", CASES)
def test_split_equals_one_process_on_the_whole_sequence(arch, impl, size, length, heads, kv_heads):
    results = run_ranks(_rank, size, (arch, impl, length, heads, kv_heads), timeout_s=240)
    check_pair(results, length)
    for res in results:
        close(res["custom_loss"], res["ref_loss"])
        close(res["embeds_logits"], res["logits"][:, : res["embeds_logits"].shape[1]])
        assert len(res["errors"]) == 2, res["errors"]
        assert "whole sequence's (batch, " in res["errors"][0]
        assert "shift_labels" in res["errors"][1]


def _broken_backward_rank(rank, world):
    """The exchange's backward without its collective (a reshape in place of the reverse exchange)."""
    from lightning_zero.sequence_parallel import all_to_all

    def backward(ctx, grad):
        B, h, s, d = grad.shape
        return grad.reshape(B, h * ctx.size, s // ctx.size, d), None, None

    all_to_all._SeqToHeads.backward = staticmethod(backward)
    return run_pair(causal_lm("gpt2"), causal_batch(24))[0]


@pytest.mark.timeout(300)
def test_the_gradient_check_catches_a_broken_exchange_backward():
    """The mutation check: the forward is still exact, the gradient comparison fails."""
    results = run_ranks(_broken_backward_rank, 2, timeout_s=240)
    for res in results:
        close(res["loss"], res["ref_loss"])
    with pytest.raises(AssertionError):
        check_pair(results, 24)


def _exchange_rank(rank, world):
    from lightning_zero.sequence_parallel import heads_to_seq, seq_to_heads

    g = torch.Generator().manual_seed(1)
    whole = torch.randn(2, 4, 12, 3, generator=g)  # (B, H, s, d), the same on every rank
    x = whole[:, :, rank * 6 : (rank + 1) * 6].clone().requires_grad_()
    y = seq_to_heads(x, None)
    back = heads_to_seq(y, None)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + rank))
    (y * w).sum().backward()
    return {"y": y.detach(), "back": back.detach(), "x": x.detach(), "grad": x.grad, "w": w}


@pytest.mark.timeout(200)
def test_the_exchange_moves_heads_and_positions_and_its_backward_reverses_it():
    res = run_ranks(_exchange_rank, 2, timeout_s=150)
    whole = torch.cat([r["x"] for r in res], dim=2)
    for rank, r in enumerate(res):
        assert torch.equal(r["y"], whole[:, rank * 2 : (rank + 1) * 2])  # this rank's heads, every position
        assert torch.equal(r["back"], r["x"])
    # d/dx of sum_r <y_r, w_r>: each position's rows of every rank's weight, in head order
    wgrad = torch.cat([r["w"] for r in res], dim=1)
    for rank, r in enumerate(res):
        assert torch.equal(r["grad"], wgrad[:, :, rank * 6 : (rank + 1) * 6])


def _counted_rank(rank, world, checkpointing):
    """One forward and backward of the split GPT-2 (2 layers), its collectives counted; HF's activation
    checkpointing re-runs each layer's forward, exchanges included, in backward."""
    from lightning_zero.engine.comm import collectives

    model = causal_lm("gpt2")
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    batch = causal_batch(24)
    res, split, sharding = run_pair(model, batch)
    local = sharding.shard_batch(batch)
    split.zero_grad()
    collectives.stats.reset()
    out = split(**local)
    forward = dict(collectives.stats.by_group)
    collectives.stats.reset()
    out.loss.backward()
    res["forward"], res["backward"] = forward, dict(collectives.stats.by_group)
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_exchanges_per_layer_and_their_wire_bytes_with_and_without_activation_checkpointing(checkpointing):
    results = run_ranks(_counted_rank, 2, (checkpointing,), timeout_s=240)
    check_pair(results, 24)
    # per layer: q, k, v and the output, each B x H x s/S x d fp32 = 2 x 4 x 12 x 8 x 4 bytes, half of it sent
    payload = 2 * 4 * 12 * 8 * 4
    for res in results:
        assert res["forward"] == {("all_to_all", "world"): [8, 8 * payload, 8 * payload // 2],
                                  ("all_reduce", "world"): [1, 4, 4]}  # the loss: one fp32 scalar
        exchanges = 16 if checkpointing else 8  # the re-run forward's exchanges, then backward's
        assert res["backward"] == {("all_to_all", "world"): [exchanges, exchanges * payload,
                                                             exchanges * payload // 2],
                                   ("all_reduce", "world"): [1, 4, 4]}


def test_a_padded_mask_is_built_once_per_forward_and_not_kept_after_it(monkeypatch):
    """One process (S=1, the identity exchange): the layers share the whole mask HF's builder made once, and
    the mask does not outlive its batch."""
    import gc

    from transformers import masking_utils

    from lightning_zero.sequence_parallel import apply_sequence_parallel, split_attention

    model = causal_lm("llama")
    batch = causal_batch(20)
    ref = model(**batch)
    sharding = apply_sequence_parallel(model)
    assert sharding.size == 1
    built = []
    real = masking_utils.create_causal_mask
    monkeypatch.setattr(masking_utils, "create_causal_mask", lambda **kw: built.append(1) or real(**kw))
    out = model(**sharding.shard_batch(batch))
    close(out.loss, ref.loss)
    close(out.logits, ref.logits)
    assert len(built) == 1  # two layers, one mask
    gc.collect()
    assert split_attention._LAST[0] is None


def _packed_rank(rank, world, arch, length):
    """Rows of several sequences each (position ids restarting, no attention mask): HF masks each sequence off
    the others on one process; the split model must too."""
    batch = causal_batch(length, pad_last=0)
    cuts = [(0, 9, length), (0, 4, 13, length)]
    batch["position_ids"] = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(c, c[1:])]) for c in cuts])
    del batch["attention_mask"]
    batch["use_cache"] = False  # HF detects packing without a cache only (a training forward; the split never has one)
    return run_pair(causal_lm(arch), batch)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,size,length", [("llama", 2, 24), ("gpt2", 4, 22)])
def test_packed_sequences_are_masked_off_each_other_as_on_one_process(arch, size, length):
    check_pair(run_ranks(_packed_rank, size, (arch, length), timeout_s=240), length)
