"""Ulysses sequence parallelism on an HF T5 encoder-decoder (tiny config) at S=2, exact against one process
on the whole sequence (fp32, rtol 1e-5): the encoder's self-attention split (relative position bias of the
whole sequence on each rank's heads), its output all-gathered, the decoder whole on every rank -- the same
loss and logits on every rank, the ranks' gradients averaged equal to the reference's. Padded encoder mask,
a source length that does not split, eager and SDPA kernels; the encoder alone (T5EncoderModel) too."""
from __future__ import annotations

import copy

import pytest
import torch

from lightning_zero.tools.launch import run_ranks
from tests.helpers.sp_models import close, close_grad, grads, run_pair, t5, t5_batch


def _rank(rank, world, impl, length):
    batch = t5_batch(length)
    res, model, sharding = run_pair(t5(impl), batch)
    local = sharding.shard_batch(batch)
    res["local_ids"] = local["input_ids"].shape[1]
    res["mask_len"] = local["attention_mask"].shape[1]
    # the encoder alone (T5EncoderModel): its output whole on every rank, gradients of a loss on it alike
    from transformers import T5EncoderModel

    from lightning_zero.sequence_parallel import apply_sequence_parallel

    torch.manual_seed(1)
    encoder = T5EncoderModel(t5(impl).config)
    ref = copy.deepcopy(encoder)
    enc_batch = {k: batch[k] for k in ("input_ids", "attention_mask")}
    weight = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(2))
    out_ref = ref(**enc_batch).last_hidden_state
    (out_ref * weight).sum().backward()
    enc_local = apply_sequence_parallel(encoder).shard_batch(enc_batch)
    out = encoder(**enc_local).last_hidden_state
    (out[:, :length] * weight).sum().backward()
    res["encoder"] = (out[:, :length].detach(), out_ref.detach(), grads(encoder), grads(ref))
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl,length", [("sdpa", 20), ("eager", 19)])
def test_t5_split_encoder_equals_one_process(impl, length):
    results = run_ranks(_rank, 2, (impl, length), timeout_s=240)
    for res in results:
        assert res["local_ids"] == -(-length // 2)  # only the encoder's inputs are cut
        assert res["mask_len"] == length + length % 2  # the mask whole (padded to split)
        close(res["loss"], res["ref_loss"])
        close(res["logits"], res["ref_logits"])  # the decoder's logits: whole on every rank
    for name, ref in results[0]["ref_grads"].items():
        close_grad(sum(r["grads"][name] for r in results) / 2, ref)
    for r in results:
        close(r["encoder"][0], r["encoder"][1])
    for name, ref in results[0]["encoder"][3].items():
        close_grad(sum(r["encoder"][2][name] for r in results) / 2, ref)
