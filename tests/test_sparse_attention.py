"""Block-sparse attention (lightning_zero.sparse_attention), single process, fp32 rtol 1e-5 against
independent references: torch's ``scaled_dot_product_attention`` (dense layout, and every layout with its
block mask written out as a dense mask), and a stock HF T5 built from a small config."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_zero.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                                             FixedSparsityConfig, LocalSlidingWindowSparsityConfig, RelativeBias,
                                             SparseSelfAttention, SparsityConfig, VariableSparsityConfig,
                                             make_sparsity_config, sparsify_t5_encoder)

ROOT = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-5, 1e-6
H, D = 4, 8


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same numbers whatever ran before it (the tolerances are checked on these)."""
    torch.manual_seed(0)


def _qkv(B, n, seed=0, heads=H):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, n, D, generator=g).requires_grad_() for _ in range(3)]


def _grads(out, inputs, weight):
    return torch.autograd.grad((out * weight).sum(), inputs)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def _close_grad(a, b):
    """rtol 1e-5, with an absolute floor at 1e-6 of the tensor's largest entry: a gradient summed over
    tokens in another order cancels to a few ulps of its scale where its true value is near zero."""
    torch.testing.assert_close(a, b, rtol=RTOL, atol=max(ATOL, 1e-6 * float(b.abs().max())))


def _dense_mask(layout, block, n, causal=False, key_padding=None):
    """The layout expanded to tokens (H, n, n), cut to n, with causal and padding applied: True = attend."""
    m = layout.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :n, :n][None]
    if causal:
        m = m & torch.ones(n, n, dtype=torch.bool).tril()
    if key_padding is not None:
        m = m & key_padding[:, None, None, :]
    return m


def _reference(q, k, v, allowed, bias=None, scale=None):
    """torch's SDPA with the layout as an additive mask (finfo.min, as HF's eager masks)."""
    add = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=add if bias is None else add + bias, scale=scale)


@pytest.mark.parametrize("n,causal", [(64, False), (64, True), (50, False), (37, True)])
def test_dense_layout_equals_sdpa_forward_and_backward(n, causal):
    q, k, v = _qkv(2, n)
    w = torch.randn(2, H, n, D)
    att = SparseSelfAttention(DenseSparsityConfig(H, block=16), causal=causal)
    out = att(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    _close(out, ref)
    for a, b in zip(_grads(out, (q, k, v), w), _grads(ref, (q, k, v), w)):
        _close_grad(a, b)


def _layouts():
    return {
        "fixed": FixedSparsityConfig(H, block=8, num_local_blocks=2),
        "fixed_horizontal": FixedSparsityConfig(H, block=8, num_local_blocks=4, num_global_blocks=2,
                                                horizontal_global_attention=True),
        "fixed_per_head": FixedSparsityConfig(H, block=8, different_layout_per_head=True, num_local_blocks=4,
                                              num_different_global_patterns=4),
        "fixed_causal": FixedSparsityConfig(H, block=8, num_local_blocks=2, attention="unidirectional"),
        "variable": VariableSparsityConfig(H, block=8, num_random_blocks=1, local_window_blocks=[1, 2, 3],
                                           global_block_indices=[0, 5], global_block_end_indices=[1, 7],
                                           horizontal_global_attention=True),
        "bigbird": BigBirdSparsityConfig(H, block=8, num_random_blocks=2, different_layout_per_head=True),
        "bigbird_causal": BigBirdSparsityConfig(H, block=8, attention="unidirectional"),
        "bslongformer": BSLongformerSparsityConfig(H, block=8, num_sliding_window_blocks=3,
                                                   global_block_indices=[0, 6]),
        "local": LocalSlidingWindowSparsityConfig(H, block=8, num_sliding_window_blocks=3),
    }


@pytest.mark.parametrize("name", list(_layouts()))
@pytest.mark.parametrize("extras", ["plain", "t5_bias_and_padding", "dense_bias"])
def test_every_layout_equals_dense_attention_with_its_mask(name, extras):
    cfg = _layouts()[name]
    n, B = 76, 2  # 10 blocks of 8, the last one padded
    att = SparseSelfAttention(cfg)
    causal = att.causal
    layout = cfg.make_layout(80)
    assert not layout.all(), "a sparse layout must actually drop blocks at this length"
    q, k, v = _qkv(B, n, seed=1)
    w = torch.randn(B, H, n, D)
    g = torch.Generator().manual_seed(2)
    kp, bias_arg, bias_dense = None, None, None
    if extras == "t5_bias_and_padding":
        kp = torch.ones(B, n, dtype=torch.bool)
        kp[1, 61:] = False
        table = torch.randn(H, 2 * 80 - 1, generator=g).requires_grad_()
        bias_arg = RelativeBias(table, 79)
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None] + 79
        bias_dense = table[:, rel][None]
        w = w * kp[:, None, :, None]  # padded queries' outputs are not used (nor are they by HF)
    elif extras == "dense_bias":
        bias_arg = bias_dense = torch.randn(B, H, n, n, generator=g).requires_grad_()
    out = att(q, k, v, bias=bias_arg, key_padding_mask=kp, scale=0.3)
    ref = _reference(q, k, v, _dense_mask(layout, 8, n, causal, kp), bias_dense, scale=0.3)
    keep = w != 0
    _close(out * keep, ref * keep)
    leaves = [q, k, v] + ([bias_arg.table if isinstance(bias_arg, RelativeBias) else bias_arg] if bias_arg is not None
                          else [])
    for a, b in zip(_grads(out, leaves, w), _grads(ref, leaves, w)):
        _close_grad(a, b)


def _t5(**kw):
    from transformers import T5Config

    cfg = dict(vocab_size=96, d_model=32, d_kv=8, num_heads=H, d_ff=64, num_layers=2, num_decoder_layers=2,
               dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
               relative_attention_num_buckets=8, relative_attention_max_distance=20)
    cfg.update(kw)
    return T5Config(**cfg)


def _batch(n, B=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 96, (B, n), generator=g)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, n - 9:] = 0
    labels = torch.randint(2, 96, (B, 6), generator=g)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("n,checkpointing", [(48, None), (45, None), (45, True)])
def test_swapped_t5_equals_stock_t5_at_dense_layout(n, checkpointing):
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    stock = T5ForConditionalGeneration(_t5())
    sparse = sparsify_t5_encoder(copy.deepcopy(stock), layout="dense", block=16)
    if checkpointing is not None:  # HF's own, reentrant: the bias table must reach layer 0 as a tensor input
        for m in (stock, sparse):
            m.gradient_checkpointing_enable({"use_reentrant": checkpointing})
    assert list(sparse.state_dict()) == list(stock.state_dict())
    batch = _batch(n)
    a, b = stock(**batch), sparse(**batch)
    _close(b.logits, a.logits)
    _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(stock.named_parameters(), sparse.parameters()):
        assert p.grad is not None and q.grad is not None, name
        _close_grad(q.grad, p.grad)


def test_swapped_t5_encoder_equals_stock_with_the_layout_as_mask():
    from transformers import T5EncoderModel

    torch.manual_seed(0)
    stock = T5EncoderModel(_t5())
    cfg = BSLongformerSparsityConfig(H, block=8, num_sliding_window_blocks=3)
    sparse = sparsify_t5_encoder(copy.deepcopy(stock), cfg)
    n = 64
    batch = _batch(n)
    kp = batch["attention_mask"].bool()
    allowed = _dense_mask(cfg.make_layout(n)[:1], 8, n, key_padding=kp)  # (B, 1, n, n)
    a = stock(input_ids=batch["input_ids"], attention_mask=allowed).last_hidden_state
    b = sparse(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    keep = kp[:, :, None]
    _close(b * keep, a * keep)
    w = torch.randn(a.shape) * keep
    (a * w).sum().backward()
    (b * w).sum().backward()
    for (name, p), q in zip(stock.named_parameters(), sparse.parameters()):
        _close_grad(q.grad, p.grad)


def test_swapped_t5_saves_a_stock_checkpoint(tmp_path):
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(_t5())
    batch = _batch(32)
    expected = model(**batch).logits
    sparsify_t5_encoder(model, layout="bigbird", block=8)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "sparse" not in json.dumps(cfg).lower()
    loaded, info = T5ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert type(loaded.encoder.block[0].layer[0].SelfAttention).__name__ == "T5Attention"
    _close(loaded(**batch).logits, expected)


def _saved_bytes(fn):
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_activation_bytes_grow_linearly_at_fixed_blocks_per_row():
    def run(cfg, n):
        q, k, v = _qkv(1, n, seed=4)
        table = torch.randn(H, 2 * n - 1).requires_grad_()
        att = SparseSelfAttention(cfg)
        return _saved_bytes(lambda: att(q, k, v, bias=RelativeBias(table, n - 1),
                                        key_padding_mask=torch.ones(1, n, dtype=torch.bool)))

    sizes = [256, 512, 1024]
    sparse = [run(BSLongformerSparsityConfig(H, block=16, num_sliding_window_blocks=3), n) for n in sizes]
    dense = [run(DenseSparsityConfig(H, block=16), n) for n in sizes]
    for small, big in zip(sparse, sparse[1:]):
        assert 1.9 < big / small < 2.1, sparse  # O(n)
    for small, big in zip(dense, dense[1:]):
        assert big / small > 3.5, dense  # the same counting sees O(n^2) when every block is kept
    assert dense[-1] > 10 * sparse[-1]


def test_length_not_a_multiple_of_the_block_is_padded_or_refused():
    q, k, v = _qkv(1, 50)
    cfg = BSLongformerSparsityConfig(H, block=16)
    assert SparseSelfAttention(cfg)(q, k, v).shape == q.shape  # padded to 64, keys masked, cut back
    with pytest.raises(ValueError, match=r"not a multiple of the sparse block size 16.*such as 64 or 48"):
        SparseSelfAttention(cfg, pad_to_block=False)(q, k, v)
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        cfg.make_layout(50)


def test_a_layout_with_an_empty_query_row_is_refused():
    class Holes(SparsityConfig):
        def make_layout(self, seq_len):
            layout = self.setup_layout(seq_len)
            layout[:, :, 0] = True
            layout[:, 2, :] = False
            return layout

    q, k, v = _qkv(1, 64)
    with pytest.raises(ValueError, match="leaves 4 query block row"):
        SparseSelfAttention(Holes(H, block=16))(q, k, v)

    class Future(SparsityConfig):  # every row sees only the last block: empty under a causal mask
        def make_layout(self, seq_len):
            layout = self.setup_layout(seq_len)
            layout[:, :, -1] = True
            return layout

    SparseSelfAttention(Future(H, block=16))(q, k, v)  # fine both ways
    with pytest.raises(ValueError, match=r"empty.*at or before the diagonal \(causal\)"):
        SparseSelfAttention(Future(H, block=16), causal=True)(q, k, v)


def test_bad_configs_are_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match="allowed dense, fixed, variable, bigbird, bslongformer, local"):
        make_sparsity_config("longformer", H)
    with pytest.raises(ValueError, match="allowed options: .*num_sliding_window_blocks"):
        make_sparsity_config("bslongformer", H, num_local_blocks=3)
    with pytest.raises(ValueError, match="'bidirectional', 'unidirectional'"):
        FixedSparsityConfig(H, attention="causal")
    with pytest.raises(ValueError, match="needs different_layout_per_head=True"):
        FixedSparsityConfig(H, num_different_global_patterns=2)
    from transformers import T5ForConditionalGeneration

    with pytest.raises(ValueError, match="use attention='bidirectional'"):
        sparsify_t5_encoder(T5ForConditionalGeneration(_t5()), layout="fixed", attention="unidirectional")
    with pytest.raises(ValueError, match="encoder has 4 heads"):
        sparsify_t5_encoder(T5ForConditionalGeneration(_t5()), BigBirdSparsityConfig(8))


def test_random_layouts_are_the_same_on_every_rank():
    """Seeded, not Python's global random: two processes (ranks) draw the same BigBird layout."""
    a = BigBirdSparsityConfig(H, num_random_blocks=2, different_layout_per_head=True).make_layout(512)
    b = BigBirdSparsityConfig(H, num_random_blocks=2, different_layout_per_head=True).make_layout(512)
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])
    assert not torch.equal(a, BigBirdSparsityConfig(H, num_random_blocks=2, different_layout_per_head=True,
                                                    seed=1).make_layout(512))


@pytest.mark.timeout(200)
def test_import_loads_no_lightning_and_no_transformers():
    code = ("import json, sys; import lightning_zero.sparse_attention; print(json.dumps(sorted({m.split('.')[0] "
            "for m in sys.modules} & {'lightning', 'pytorch_lightning', 'lightning_fabric', 'transformers'})))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _causal_lms():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=H, n_positions=128,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=H, num_key_value_heads=2,
                                              max_position_embeddings=128)),
    }


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_swapped_causal_lm_equals_stock_at_dense_layout(arch):
    from lightning_zero.sparse_attention import sparsify_causal_lm

    stock = _causal_lms()[arch]
    sparse = sparsify_causal_lm(copy.deepcopy(stock), layout="dense", block=16)
    assert list(sparse.state_dict()) == list(stock.state_dict())
    assert sparse.config._attn_implementation == stock.config._attn_implementation  # what save_pretrained sees
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 96, (2, 45), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 38:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    a = stock(input_ids=ids, attention_mask=mask, labels=labels)
    b = sparse(input_ids=ids, attention_mask=mask, labels=labels)
    keep = mask.bool()[..., None]
    _close(b.logits * keep, a.logits * keep)
    _close(b.loss, a.loss)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(stock.named_parameters(), sparse.parameters()):
        _close_grad(q.grad, p.grad)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_swapped_causal_lm_equals_stock_with_the_layout_as_mask_and_decodes_alike(arch):
    from lightning_zero.sparse_attention import sparsify_causal_lm

    stock = _causal_lms()[arch]
    cfg = FixedSparsityConfig(H, block=4, num_local_blocks=2, attention="unidirectional")
    sparse = sparsify_causal_lm(copy.deepcopy(stock), cfg)
    n = 40
    ids = torch.randint(2, 96, (2, n), generator=torch.Generator().manual_seed(6))
    allowed = _dense_mask(cfg.make_layout(n)[:1], 4, n, causal=True).expand(2, 1, n, n)
    a = stock(input_ids=ids, attention_mask=allowed).logits
    b = sparse(input_ids=ids).logits
    _close(b, a)
    w = torch.randn(a.shape)
    (a * w).sum().backward()
    (b * w).sum().backward()
    for (name, p), q in zip(stock.named_parameters(), sparse.parameters()):
        _close_grad(q.grad, p.grad)
    # the decode step (queries fewer than the cached keys) attends as the square kernel does
    with torch.no_grad():
        past = sparse(input_ids=ids[:, :33], use_cache=True).cache
        step = sparse(input_ids=ids[:, 33:36], cache=past, use_cache=True).logits
        _close(step, b[:, 33:36])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_custom_backward_passes_gradcheck(dropout):
    """The re-gathering backward against finite differences in float64 (bias table and dense bias too);
    with dropout the same mask is drawn at every evaluation (the RNG reseeded)."""
    cfg = BigBirdSparsityConfig(2, block=4, num_random_blocks=1, different_layout_per_head=True)
    att = SparseSelfAttention(cfg, causal=True)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 14, 3, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    table = torch.randn(2, 2 * 16 - 1, generator=g, dtype=torch.float64).requires_grad_()
    dense = torch.randn(1, 2, 14, 14, generator=g, dtype=torch.float64).requires_grad_()
    kp = torch.ones(1, 14, dtype=torch.bool)
    kp[0, 12:] = False

    def fn(q, k, v, table, dense):
        torch.manual_seed(0)
        rel = att(q, k, v, bias=RelativeBias(table, 15), key_padding_mask=kp, dropout_p=dropout)
        return rel[:, :, :12], att(q, k, v, bias=dense, dropout_p=dropout)

    assert torch.autograd.gradcheck(fn, (q, k, v, table, dense), fast_mode=True)


def test_rows_in_chunks_compute_the_same(monkeypatch):
    """A group's rows walked in chunks (the working-set bound) give the unchunked result and gradients."""
    from lightning_zero.sparse_attention import block_sparse

    cfg = BSLongformerSparsityConfig(H, block=8, num_sliding_window_blocks=3, global_block_indices=[0, 6])
    q, k, v = _qkv(2, 76, seed=8)
    table = torch.randn(H, 2 * 80 - 1).requires_grad_()
    kp = torch.ones(2, 76, dtype=torch.bool)
    kp[1, 60:] = False
    w = torch.randn(2, H, 76, D) * kp[:, None, :, None]

    def run():
        out = SparseSelfAttention(cfg)(q, k, v, bias=RelativeBias(table, 79), key_padding_mask=kp)
        return (out,) + _grads(out, (q, k, v, table), w)

    whole = run()
    # 2 rows per chunk at 4 key blocks per row: (k and v) x batch 2 x 4 blocks x 8 tokens x D x 4 bytes, twice
    monkeypatch.setattr(block_sparse, "GATHER_CHUNK_BYTES", 2 * (2 * 2 * 4 * 8 * D * 4))
    chunks = list(block_sparse._row_chunks(q.reshape(2, -1, 8, D), torch.arange(10), torch.zeros(40, dtype=torch.long)))
    assert [c[1].tolist() for c in chunks] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    for a, b in zip(run(), whole):
        _close_grad(a, b)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_a_swapped_model_unpickles_in_a_fresh_process(tmp_path, arch):
    """What a spawn launcher does with the model: pickled here, unpickled where nothing was swapped yet."""
    import pickle

    from transformers import T5ForConditionalGeneration

    from lightning_zero.sparse_attention import sparsify_causal_lm

    torch.manual_seed(0)
    if arch == "t5":
        model = sparsify_t5_encoder(T5ForConditionalGeneration(_t5()), layout="bslongformer", block=8)
        batch, name = _batch(40), "SparseT5AttentionForT5Attention"
    else:
        model = sparsify_causal_lm(_causal_lms()["gpt2"], layout="fixed", block=4, num_local_blocks=2)
        batch, name = {"input_ids": _batch(40)["input_ids"]}, "GPT2Attention"
    torch.save(batch, tmp_path / "batch.pt")
    torch.save(model(**batch).logits, tmp_path / "logits.pt")
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(model))
    code = ("import pickle, sys, torch; d = sys.argv[1]; m = pickle.load(open(d + '/model.pkl', 'rb')); "
            "b = torch.load(d + '/batch.pt'); torch.testing.assert_close(m(**b).logits, torch.load(d + '/logits.pt'), "
            "rtol=0, atol=0); print(type(next(x for n, x in m.named_modules() if n.endswith('attn') "
            "or n.endswith('SelfAttention'))).__name__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == name
