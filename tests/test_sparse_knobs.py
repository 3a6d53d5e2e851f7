"""Every sparsity-config knob against bad input: one ValueError naming the knob and what is allowed, raised when the
config is built; in the T5 recipe the same values are its config error before any process starts (the Hydra
overrides as a user types them, and one run of the app itself)."""
import os
import subprocess
import sys

import pytest
import torch

from lightning_zero.sparse_attention import (LAYOUTS, BSLongformerSparsityConfig, SparseSelfAttention,
                                             make_sparsity_config)
from tests.helpers.hydra_recipe import ROOT, compose_recipe

H = 4
INT1 = r"allowed an integer >= 1"
INT0 = r"allowed an integer >= 0"
FLAG = r"allowed true or false"

# (layout, options, what the message must say); every layout's every knob, DeepSpeed's names
BAD = [
    *[(name, {"num_heads": v}, rf"num_heads={v!r}: {INT1}") for name in LAYOUTS for v in (0, -2, 2.0, True)],
    *[(name, {"block": v}, rf"block={v!r}: {INT1}") for name in LAYOUTS for v in (0, -16, "16", True)],
    *[(name, {"different_layout_per_head": v}, rf"different_layout_per_head={v!r}: {FLAG}")
      for name in LAYOUTS if name != "local" for v in ("yes", 1, None)],
    ("local", {"different_layout_per_head": True}, r"allowed options: .*num_sliding_window_blocks"),
    *[(name, {"seed": v}, rf"seed={v!r}: {INT0}") for name in LAYOUTS for v in (-1, 1.5)],
    # fixed
    ("fixed", {"num_local_blocks": 0}, rf"num_local_blocks=0: {INT1}"),
    ("fixed", {"num_local_blocks": "4"}, rf"num_local_blocks='4': {INT1}"),
    ("fixed", {"num_global_blocks": 0}, rf"num_global_blocks=0: {INT1}"),  # was ZeroDivisionError
    ("fixed", {"num_global_blocks": -1}, rf"num_global_blocks=-1: {INT1}"),
    ("fixed", {"num_local_blocks": 4, "num_global_blocks": 3}, r"must be a multiple of num_global_blocks=3"),
    ("fixed", {"num_different_global_patterns": 0}, rf"num_different_global_patterns=0: {INT1}"),
    ("fixed", {"num_different_global_patterns": 2}, r"needs different_layout_per_head=True"),
    ("fixed", {"num_different_global_patterns": 5, "different_layout_per_head": True}, r"cannot exceed .* = 4"),
    ("fixed", {"horizontal_global_attention": "yes"}, rf"horizontal_global_attention='yes': {FLAG}"),
    ("fixed", {"horizontal_global_attention": True, "attention": "unidirectional"}, r"needs attention='bidir"),
    # variable
    ("variable", {"num_random_blocks": -1}, rf"num_random_blocks=-1: {INT0}"),  # was near-dense
    ("variable", {"local_window_blocks": []}, r"local_window_blocks=\[\]: allowed a list of one or more"),
    ("variable", {"local_window_blocks": [4, 0]}, r"local_window_blocks=\[4, 0\]: allowed a list of one or more"),
    ("variable", {"local_window_blocks": 4}, r"local_window_blocks=4: allowed a list of one or more"),
    ("variable", {"global_block_indices": [-1]}, r"global_block_indices=\[-1\]: allowed a list of integers >= 0"),
    ("variable", {"global_block_indices": 0}, r"global_block_indices=0: allowed a list of integers >= 0, e.g."),
    ("variable", {"global_block_indices": ["0"]}, r"global_block_indices=\['0'\]: allowed a list of integers"),
    ("variable", {"global_block_indices": [0, 2], "global_block_end_indices": [1]}, r"one end per start"),
    ("variable", {"global_block_indices": [2], "global_block_end_indices": [2]}, r"start index 2 must be smaller"),
    ("variable", {"global_block_end_indices": 3}, r"global_block_end_indices=3: allowed a list"),
    ("variable", {"horizontal_global_attention": 1}, rf"horizontal_global_attention=1: {FLAG}"),
    # bigbird
    ("bigbird", {"num_random_blocks": -1}, rf"num_random_blocks=-1: {INT0}"),
    ("bigbird", {"num_sliding_window_blocks": 0}, rf"num_sliding_window_blocks=0: {INT1}"),
    ("bigbird", {"num_sliding_window_blocks": -3}, rf"num_sliding_window_blocks=-3: {INT1}"),
    ("bigbird", {"num_global_blocks": 0}, rf"num_global_blocks=0: {INT1}"),
    ("bigbird", {"num_global_blocks": -1}, rf"num_global_blocks=-1: {INT1}"),
    # bslongformer
    ("bslongformer", {"num_sliding_window_blocks": -3}, rf"num_sliding_window_blocks=-3: {INT1}"),
    ("bslongformer", {"num_sliding_window_blocks": 0}, rf"num_sliding_window_blocks=0: {INT1}"),
    ("bslongformer", {"num_sliding_window_blocks": 2.5}, rf"num_sliding_window_blocks=2.5: {INT1}"),
    ("bslongformer", {"global_block_indices": [-1]}, r"global_block_indices=\[-1\]: allowed a list of integers"),
    ("bslongformer", {"global_block_indices": 0}, r"global_block_indices=0: allowed a list"),
    ("bslongformer", {"global_block_end_indices": [0]}, r"start index 0 must be smaller than its end index 0"),
    ("bslongformer", {"num_local_blocks": 4}, r"allowed options: .*num_sliding_window_blocks"),
    # local
    ("local", {"num_sliding_window_blocks": -3}, rf"num_sliding_window_blocks=-3: {INT1}"),
    ("local", {"num_sliding_window_blocks": 0}, rf"num_sliding_window_blocks=0: {INT1}"),
    *[(name, {"attention": "causal"}, r"attention='causal': allowed 'bidirectional', 'unidirectional'")
      for name in LAYOUTS if name != "dense"],
]


@pytest.mark.parametrize("layout,options,message", BAD, ids=[f"{a}-{sorted(b.items())}" for a, b, _ in BAD])
def test_each_bad_knob_is_one_error_naming_what_is_allowed(layout, options, message):
    opts = dict(options)
    heads, block = opts.pop("num_heads", H), opts.pop("block", 16)
    with pytest.raises(ValueError, match=message):
        make_sparsity_config(layout, heads, block, **opts)


@pytest.mark.parametrize("layout", ["longformer", ["bslongformer"], None])
def test_unknown_layout_names_the_layouts(layout):
    with pytest.raises(ValueError, match="allowed dense, fixed, variable, bigbird, bslongformer, local"):
        make_sparsity_config(layout, H)


def test_attention_and_drop_in_flags_are_bools():
    cfg = BSLongformerSparsityConfig(H)
    with pytest.raises(ValueError, match=f"pad_to_block='yes': {FLAG}"):
        SparseSelfAttention(cfg, pad_to_block="yes")
    with pytest.raises(ValueError, match=f"causal='no': {FLAG}"):
        SparseSelfAttention(cfg, causal="no")
    from transformers import T5Config, T5ForConditionalGeneration

    from lightning_zero.sparse_attention import sparsify_t5_encoder

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=H))
    with pytest.raises(ValueError, match="options='num_sliding_window_blocks=3': allowed a mapping"):
        sparsify_t5_encoder(t5, options="num_sliding_window_blocks=3")


@pytest.mark.parametrize("layout,options", [("bslongformer", {"num_sliding_window_blocks": 7}),
                                            ("local", {"num_sliding_window_blocks": 9, "attention": "bidirectional"}),
                                            ("bigbird", {"num_random_blocks": 5, "num_global_blocks": 4}),
                                            ("variable", {"num_random_blocks": 5})])
def test_counts_past_a_short_sequence_cover_it(layout, options):
    """A batch shorter than the window (dynamic padding): the whole sequence, where DeepSpeed raised mid-run."""
    att = SparseSelfAttention(make_sparsity_config(layout, H, 16, **options))
    q = torch.randn(1, H, 20, 8)  # 2 blocks
    assert att.layout(20).all()
    assert att(q, q, q).shape == q.shape


# ------------------------------------------------------------------ the recipe's Hydra overrides
RECIPE_BAD = [
    (["+model.sparse.options.num_sliding_window_blocks=-3"], rf"num_sliding_window_blocks=-3: {INT1}"),
    (["+model.sparse.options.num_sliding_window_blocks=0"], rf"num_sliding_window_blocks=0: {INT1}"),
    (["+model.sparse.options.global_block_indices=[-1]"], r"global_block_indices=\[-1\]: allowed a list"),
    (["+model.sparse.options.global_block_indices=3"], r"global_block_indices=3: allowed a list"),
    (["+model.sparse.options.global_block_indices=[0,99]"],
     r"\[99\] start past data.max_source_len=64 \(4 blocks of 16\) .*allowed 0 .. 3"),
    (["+model.sparse.options.different_layout_per_head=yes"], rf"different_layout_per_head='yes': {FLAG}"),
    (["model.sparse.layout=bigbird", "+model.sparse.options.num_random_blocks=-1"], rf"=-1: {INT0}"),
    (["model.sparse.layout=bigbird", "+model.sparse.options.num_global_blocks=0"], rf"=0: {INT1}"),
    (["model.sparse.layout=fixed", "+model.sparse.options.num_global_blocks=0"], rf"=0: {INT1}"),
    (["model.sparse.layout=variable", "+model.sparse.options.local_window_blocks=[]"], r"one or more"),
    (["model.sparse.block=0"], r"model.sparse.block=0 \(allowed: an int >= 1\)"),  # the recipe's range table, first
    (["model.sparse.layout=longformer"], r"allowed dense, fixed, variable, bigbird, bslongformer, local"),
    (["+model.sparse.options.num_local_blocks=4"], r"allowed options: .*num_sliding_window_blocks"),
    (["model.attention=flash"], r"model.attention='flash': allowed dense, sparse"),
]


@pytest.mark.parametrize("overrides,message", RECIPE_BAD, ids=[" ".join(o) for o, _ in RECIPE_BAD])
def test_recipe_overrides_are_a_config_error_before_anything_starts(overrides, message, monkeypatch):
    import t5_finetune
    from t5_config import ConfigError

    def started(*a, **k):
        raise AssertionError("the run went past its config checks")

    for name in ("build_strategy", "build_datamodule", "make_trainer", "build_model"):
        monkeypatch.setattr(t5_finetune, name, started)
    base = [] if "model.attention=flash" in overrides else ["model.attention=sparse"]
    cfg = compose_recipe("trainer=cpu", *base, *overrides)
    with pytest.raises(ConfigError, match=message):
        t5_finetune.train(cfg)


@pytest.mark.timeout(120)
def test_the_app_as_typed_refuses_the_t5_window_of_minus_3():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "t5_finetune.py"), "model.attention=sparse",
                        "+model.sparse.options.num_sliding_window_blocks=-3", "hydra.run.dir=/tmp/lz_sparse_knobs",
                        "hydra.output_subdir=null"], capture_output=True, text=True, env=env, timeout=110)
    assert p.returncode != 0
    assert "t5_finetune: config error: model.sparse (layout='bslongformer', block=16, " in p.stderr, p.stderr
    assert f"num_sliding_window_blocks=-3: {INT1}" in p.stderr
    assert "Traceback" not in p.stderr
