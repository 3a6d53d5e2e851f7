"""The recipe with ``model.attention=sparse``: a short 2-rank fit under every ZeRO preset (at stage 3 the
units still the T5 blocks), the HF export a stock T5, and the module swapping again when rebuilt."""
import math

import pytest

from tests.helpers.hydra_recipe import compose_recipe as _compose, pairs_file  # noqa: F401  (pairs_file: a fixture)

SPARSE = ["model.attention=sparse", "model.sparse.block=4", "model.sparse.layout=bslongformer",
          "+model.sparse.options.num_sliding_window_blocks=3"]


def test_sparse_module_swaps_the_encoder_and_keeps_stock_keys():
    from t5_module import T5FineTuner

    from lightning_zero.sparse_attention import is_sparse

    dense = T5FineTuner(preset="t5_tiny")
    sparse = T5FineTuner(preset="t5_tiny", attention="sparse",
                         sparse_attention={"layout": "bigbird", "block": 8, "options": {"num_random_blocks": 2}})
    assert is_sparse(sparse.model) and not is_sparse(dense.model)
    assert list(sparse.state_dict()) == list(dense.state_dict())
    assert sparse.hparams.attention == "sparse"
    attn = sparse.model.encoder.block[0].layer[0].SelfAttention.sparse.sparsity_config
    assert (type(attn).__name__, attn.block, attn.num_random_blocks) == ("BigBirdSparsityConfig", 8, 2)
    with pytest.raises(ValueError, match="model.attention='flash': allowed dense, sparse"):
        T5FineTuner(preset="t5_tiny", attention="flash")
    from t5_attention import describe_attention

    layers = len(sparse.model.encoder.block)
    assert describe_attention(dense.model) == "dense (HF T5's own)"
    assert describe_attention(sparse.model) == (
        f"block-sparse encoder self-attention in {layers} of {layers} layers: bigbird layout, block 8 "
        "(different_layout_per_head=False, seed=0, num_random_blocks=2, num_sliding_window_blocks=3, "
        "num_global_blocks=1, attention='bidirectional'); padded to the block")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero0", "zero1", "zero1_offload", "zero2", "zero2_offload", "zero3",
                                      "zero3_offload"])
def test_recipe_fits_with_sparse_attention(tmp_path, pairs_file, restore_threads, strategy, capsys,  # noqa: F811
                                           caplog):
    import logging

    from t5_finetune import train
    from transformers import T5ForConditionalGeneration

    out = tmp_path / "out"
    cfg = _compose(f"strategy={strategy}", "model=t5_tiny", "trainer=cpu", "trainer.devices=2", "data=jsonl",
                   f"data.path={pairs_file}", "data.source_field=code", "data.target_field=doc",
                   "data.batch_size=4", "data.limit_train=16", "data.limit_val=4", "data.max_source_len=60",
                   "data.max_target_len=12", "trainer.max_steps=2", "trainer.val_check_interval=2",
                   "tokenizer.vocab_size=400", "trainer.enable_progress_bar=false", "optim.warmup_steps=1",
                   f"output.dir={out}", "output.tensorboard=false", *SPARSE)
    with caplog.at_level(logging.INFO, logger="t5_finetune"):
        summary = train(cfg)
    head = capsys.readouterr().out
    # the run says it is sparse, and how: in its start line and in its summary
    said = ("block-sparse encoder self-attention in 2 of 2 layers: bslongformer layout, block 4 "
            "(different_layout_per_head=False, seed=0, num_sliding_window_blocks=3, global_block_indices=[0], "
            "global_block_end_indices=None, attention='bidirectional'); padded to the block")
    assert f"| attention: {said} |" in caplog.text, caplog.text
    assert f"attention:    {said}" in head, head
    assert summary["run_info"]["global_step"] == 2
    assert math.isfinite(summary["last_val"]["val_loss"])
    if strategy.startswith("zero3"):
        built = int(head[head.index("stage-3 units built: ") + len("stage-3 units built: "):].split()[0])
        assert built >= 2  # the T5 blocks, as with dense attention
    hf = summary["run_info"]["hf_model"]
    model, info = T5ForConditionalGeneration.from_pretrained(hf, output_loading_info=True)
    assert not any(info.values()), info
