"""What sequence parallelism refuses, each with one error naming what is allowed, raised before the model is
changed: heads that do not split over S (GPT-2, Llama, T5), a model without a supported
attention, a kernel it cannot run on head shards, batches it cannot cut. And the
split model survives pickling: in a fresh process it says to apply again, then runs at another size."""
from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero.tools.launch import run_ranks
from tests.helpers.sp_models import causal_batch, causal_lm, close, t5, t5_batch

ROOT = Path(__file__).resolve().parents[1]


def _refusals(rank, world):
    from lightning_zero.sequence_parallel import apply_sequence_parallel

    out = {}
    models = (("gpt2", causal_lm("gpt2", heads=4)), ("llama", causal_lm("llama", heads=4, kv_heads=2)),
              ("t5", t5(heads=4)))
    for name, model in models:
        before = copy.deepcopy(model.state_dict())
        try:
            apply_sequence_parallel(model, None)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
        attn = [m for m in model.modules() if hasattr(m, "ulysses")]
        out[name + "_untouched"] = not attn and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return out


@pytest.mark.timeout(300)
def test_heads_that_do_not_split_over_three_ranks_are_refused_naming_the_module():
    res = run_ranks(_refusals, 3, timeout_s=240)[0]
    assert res["gpt2"].startswith("transformer.h.0.attn (GPT2Attention) has 4 attention heads: sequence parallelism "
                                  "of size 3") and res["gpt2"].endswith("allowed sizes: [1, 2, 4].")
    assert res["llama"].startswith("model.layers.0.self_attn (LlamaAttention) has 4 attention heads: sequence "
                                   "parallelism of size 3") and res["llama"].endswith("allowed sizes: [1, 2, 4].")
    assert res["t5"].startswith("encoder.block.0.layer.0.SelfAttention (T5Attention) has 4 attention heads")
    assert res["gpt2_untouched"] and res["llama_untouched"] and res["t5_untouched"]


def test_models_and_kernels_it_cannot_split():
    from lightning_zero.sequence_parallel import apply_sequence_parallel

    with pytest.raises(TypeError, match="splits HF GPT-2 and Llama models .* and T5 encoders; Linear has none"):
        apply_sequence_parallel(torch.nn.Linear(2, 2))
    model = causal_lm("gpt2")
    model.transformer.h[0].attn.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"transformer.h.0.attn \(GPT2Attention\) runs attn_implementation="
                                         r"'flash_attention_2'.*\['eager', 'sdpa', 'lz_block_sparse'\]"):
        apply_sequence_parallel(model)


def test_batches_it_cannot_cut():
    from lightning_zero.sequence_parallel import apply_sequence_parallel

    sharding = apply_sequence_parallel(causal_lm("gpt2"))
    batch = causal_batch(12)
    with pytest.raises(TypeError, match="takes the model's keyword arguments as a mapping"):
        sharding.shard_batch([batch["input_ids"]])
    with pytest.raises(ValueError, match=r"does not know how to split \['special_tokens_mask'\].*\['input_ids', "):
        sharding.shard_batch({**batch, "special_tokens_mask": torch.zeros_like(batch["input_ids"])})
    with pytest.raises(ValueError, match=r"attention_mask must be the \(batch, length\) = \(2, 12\) padding mask"):
        sharding.shard_batch({**batch, "attention_mask": batch["attention_mask"][:, None, None, :]})
    with pytest.raises(ValueError, match="needs input_ids"):
        sharding.shard_batch({"labels": batch["labels"]})


def _pickled(rank, world):
    from lightning_zero.sequence_parallel import apply_sequence_parallel

    model = causal_lm("llama")
    batch = {"input_ids": causal_batch(16, pad_last=0)["input_ids"]}
    ref = model(**batch).logits.detach()
    sharding = apply_sequence_parallel(model)
    local = sharding.shard_batch(batch)
    twin = copy.deepcopy(model)  # a deep copy in the same process keeps working (callbacks copy models)
    close(twin(**local).logits, model(**local).logits)
    from lightning_zero.sparse_attention import sparsify_t5_encoder

    sparse_t5 = sparsify_t5_encoder(t5(), layout="bslongformer", block=4)
    t5_in = {k: v for k, v in t5_batch(16).items() if k != "attention_mask"}
    t5_ref = sparse_t5(**t5_in).logits.detach()
    apply_sequence_parallel(sparse_t5)
    return {"model": pickle.dumps(model), "batch": batch, "ref": ref, "t5": pickle.dumps(sparse_t5),
            "t5_batch": t5_in, "t5_ref": t5_ref}


@pytest.mark.timeout(300)
def test_a_split_model_unpickles_in_a_fresh_process_and_runs_after_apply_again(tmp_path):
    """Llama, and a block-sparse T5 (its swapped class found by name in the fresh process)."""
    res = run_ranks(_pickled, 2, timeout_s=240)[0]
    for name in ("model", "t5"):
        (tmp_path / f"{name}.pkl").write_bytes(res[name])
    torch.save({k: res[k] for k in ("batch", "ref", "t5_batch", "t5_ref")}, tmp_path / "io.pt")
    code = ("import pickle, sys, torch; d = sys.argv[1]; m = pickle.load(open(d + '/model.pkl', 'rb')); "
            "t = pickle.load(open(d + '/t5.pkl', 'rb')); io = torch.load(d + '/io.pt'); b = io['batch']\n"
            "try:\n    m(**b)\nexcept RuntimeError as e:\n    print('refused:', e)\n"
            "from lightning_zero.sequence_parallel import apply_sequence_parallel\n"
            "s = apply_sequence_parallel(m); print('size', s.size)\n"
            "torch.testing.assert_close(m(**s.shard_batch(b)).logits, io['ref'], rtol=1e-5, atol=1e-6); print('same')\n"
            "s = apply_sequence_parallel(t); print(type(t.encoder.block[0].layer[0].SelfAttention).__name__)\n"
            "out = t(**s.shard_batch(io['t5_batch'])).logits\n"
            "torch.testing.assert_close(out, io['t5_ref'], rtol=1e-5, atol=1e-6); print('same')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("refused: this model was split for sequence parallelism over ranks [0, 1] in another "
                               "process: call apply_sequence_parallel(model, group) in this one")
    assert lines[1:] == ["size 1", "same", "UlyssesT5AttentionForSparseT5Attention", "same"]


def test_applying_again_wraps_nothing_twice():
    """Block-sparse GPT-2 and T5 applied twice: one of each wrapper, the whole layout kept."""
    from lightning_zero.sequence_parallel import apply_sequence_parallel
    from lightning_zero.sequence_parallel.loss import WholeSequenceLoss
    from lightning_zero.sparse_attention import sparsify_causal_lm

    model = sparsify_causal_lm(causal_lm("gpt2"), layout="fixed", block=4, num_local_blocks=2)
    batch = causal_batch(16)
    ref = model(**batch)
    full = model.transformer.h[0].attn.sparse.sparsity_config
    for _ in range(2):
        sharding = apply_sequence_parallel(model)
    attn = model.transformer.h[0].attn
    assert attn.config._attn_implementation == "lz_ulysses" and attn.ulysses.kernel == "lz_block_sparse"
    assert attn.ulysses.sparse_config is full and attn.sparse.sparsity_config.full is full
    assert len(model._forward_pre_hooks) == 1
    assert isinstance(model.loss_function, WholeSequenceLoss) and not isinstance(model.loss_function.inner,
                                                                                 WholeSequenceLoss)
    out = model(**sharding.shard_batch(batch))
    close(out.loss, ref.loss)
    close(out.logits, ref.logits)
    from lightning_zero.sparse_attention import sparsify_t5_encoder

    model = sparsify_t5_encoder(t5(), layout="bslongformer", block=4)
    batch = t5_batch(12)
    ref = model(**batch)
    for _ in range(2):
        sharding = apply_sequence_parallel(model)
    attn = model.encoder.block[0].layer[0].SelfAttention
    assert type(attn).__name__ == "UlyssesT5AttentionForSparseT5Attention"
    assert attn.sparse.sparsity_config.full is attn.ulysses.sparse_config
    assert len(model.encoder._forward_pre_hooks) == 2 and len(model.encoder._forward_hooks) == 1  # sparse's + ours
    close(model(**sharding.shard_batch(batch)).logits, ref.logits)


@pytest.mark.timeout(200)
def test_importing_the_package_loads_neither_transformers_nor_lightning():
    code = ("import json, sys; import lightning_zero.sequence_parallel; print(json.dumps(sorted({m.split('.')[0] "
            "for m in sys.modules} & {'transformers', 'lightning', 'lightning_fabric', 'pytorch_lightning'})))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_checks_run_before_any_rank_starts():
    """``check_sequence_parallel``: the refusals of ``apply_sequence_parallel`` without a process group."""
    from lightning_zero.sequence_parallel import check_sequence_parallel

    assert check_sequence_parallel(causal_lm("llama", heads=8, kv_heads=2), 8) == "causal_lm"
    assert check_sequence_parallel(t5(heads=4), 4) == "t5"
    with pytest.raises(ValueError, match=r"transformer.h.0.attn \(GPT2Attention\) has 4 attention heads: sequence "
                                         r"parallelism of size 8 .* allowed sizes: \[1, 2, 4\]"):
        check_sequence_parallel(causal_lm("gpt2"), 8)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="sequence-parallel size must be an integer >= 1"):
            check_sequence_parallel(causal_lm("gpt2"), bad)
