"""Ulysses sequence parallelism composed with block-sparse attention: a GPT-2 / Llama / T5 encoder sparsified
first, then split over S=2, equals the single-process sparse model (fp32, rtol 1e-5). Each rank runs the layout's rows
of its own heads on the whole sequence; layouts that differ per head make a wrong head slice visible."""
from __future__ import annotations

import pytest

from lightning_zero.tools.launch import run_ranks
from tests.helpers.sp_models import causal_batch, causal_lm, check_pair, close, close_grad, run_pair, t5, t5_batch


def _rank(rank, world, arch, layout, options):
    from lightning_zero.sparse_attention import sparsify_causal_lm

    model = sparsify_causal_lm(causal_lm(arch), layout=layout, block=4, **options)
    res, split, _ = run_pair(model, causal_batch(30))
    attn = next(m for n, m in split.named_modules() if hasattr(m, "ulysses"))
    res["layout"] = attn.sparse.sparsity_config.describe()
    res["heads"] = attn.sparse.sparsity_config.num_heads
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,layout,options", [
    ("gpt2", "bigbird", {"num_random_blocks": 1, "num_sliding_window_blocks": 1, "num_global_blocks": 1,
                         "different_layout_per_head": True}),
    ("llama", "bigbird", {"num_random_blocks": 2, "num_sliding_window_blocks": 3, "num_global_blocks": 1,
                          "different_layout_per_head": True, "seed": 5}),
])
def test_sparse_model_split_equals_the_single_process_sparse_model(arch, layout, options):
    results = run_ranks(_rank, 2, (arch, layout, options), timeout_s=240)
    check_pair(results, 30)
    assert [r["heads"] for r in results] == [2, 2]
    assert results[0]["layout"].endswith("heads 0..1 of 4") and results[1]["layout"].endswith("heads 2..3 of 4")


def _t5_rank(rank, world, length):
    from lightning_zero.sparse_attention import describe_sparse, sparsify_t5_encoder

    model = sparsify_t5_encoder(t5(), layout="bigbird", block=4, num_random_blocks=1, num_sliding_window_blocks=1,
                                num_global_blocks=1, different_layout_per_head=True)
    res, split, _ = run_pair(model, t5_batch(length))
    res["describe"] = describe_sparse(split)
    return res


@pytest.mark.timeout(300)
def test_sparse_t5_encoder_split_equals_the_single_process_sparse_model():
    """The encoder's layout and relative-bias table cut to each rank's heads; 30 tokens (padded by the kernel to
    its block of 4) with a padded encoder mask."""
    results = run_ranks(_t5_rank, 2, (30,), timeout_s=240)
    for res in results:
        close(res["loss"], res["ref_loss"])
        close(res["logits"], res["ref_logits"])
    for name, ref in results[0]["ref_grads"].items():
        close_grad(sum(r["grads"][name] for r in results) / 2, ref)
    assert "heads 0..1 of 4" in results[0]["describe"] and "heads 2..3 of 4" in results[1]["describe"]
