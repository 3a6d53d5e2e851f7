"""Tiled MLP and tiled LM loss (lightning_zero/sequence_parallel/tiled*.py) against the untiled HF model.

One process, fp32: the loss and every gradient of GPT-2 and Llama (tiny, from configs) with their MLPs tiled
and their logits computed tile by tile equal the untiled model's at rtol 1e-5, for HF's mean loss with
ignored labels and for already-shifted labels summed over ``num_items_in_batch``, with tile sizes that do not
divide the length (23). Forward hooks show the pieces are tiles: the LM head never outputs more than one
tile of logits, and each tile is recomputed once in backward. The engine runs: tests/test_tiled_engine.py.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_zero.sequence_parallel import TiledMLPForward, is_tiled, tile_lm_loss, tile_mlp
from tests.helpers.tiled_models import BATCH, MODELS, SEQ, VOCAB, batch, lm_loss, t5

MLP_TILE, LOSS_TILE = 5, 7


def _pair(kind: str, mlp_tile=MLP_TILE, loss_tile=LOSS_TILE):
    torch.manual_seed(0)
    plain = MODELS[kind]()
    tiled = copy.deepcopy(plain)
    if mlp_tile:
        tile_mlp(tiled, mlp_tile)
    if loss_tile:
        tile_lm_loss(tiled, loss_tile)
    return plain, tiled


def _loss_and_grads(model, b, variant):
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, b, variant)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", ["labels", "shift_labels"])
@pytest.mark.parametrize("tiles", [(MLP_TILE, LOSS_TILE), (0, 4), (6, 0), (SEQ + 9, SEQ + 9)],
                         ids=["mlp5+loss7", "loss4", "mlp6", "one-tile"])
def test_tiled_loss_and_every_grad_equal_the_untiled_model(kind, variant, tiles):
    plain, tiled = _pair(kind, *tiles)
    b = batch()
    ref_loss, ref_grads = _loss_and_grads(plain, b, variant)
    loss, grads = _loss_and_grads(tiled, b, variant)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_the_labels_are_shifted_on_the_whole_sequence_and_num_items_divides():
    """The two kwargs are not interchangeable: the already-shifted labels are read (the unshifted ones passed
    beside them would give another loss) and the sum is divided by ``num_items_in_batch``, not the count."""
    plain, tiled = _pair("gpt2")
    b = batch()
    shifted = lm_loss(tiled, b, "shift_labels")
    mean = lm_loss(tiled, b, "labels")
    # batch() doubles num_items_in_batch: half the mean over the same valid targets
    torch.testing.assert_close(shifted, mean / 2, rtol=1e-5, atol=0)
    assert not torch.allclose(tiled(input_ids=b["input_ids"], labels=b["input_ids"]).loss, mean)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_no_whole_logits_tensor_exists(kind):
    """The LM head's largest output is one tile of logits (B x 7 x V, not B x 23 x V), and it runs once per tile
    in forward and once more per tile in backward (the recompute); the MLPs' first projection alike."""
    _plain, tiled = _pair(kind)
    outputs: dict[str, list[int]] = {"head": [], "mlp": []}
    tiled.lm_head.register_forward_hook(lambda m, a, out: outputs["head"].append(out.numel()))
    first = tiled.transformer.h[0].mlp.c_fc if kind == "gpt2" else tiled.model.layers[0].mlp.gate_proj
    first.register_forward_hook(lambda m, a, out: outputs["mlp"].append(out.numel()))
    lm_loss(tiled, batch(), "labels").backward()
    tiles = [-(-SEQ // LOSS_TILE), -(-SEQ // MLP_TILE)]
    assert len(outputs["head"]) == 2 * tiles[0] and len(outputs["mlp"]) == 2 * tiles[1]
    assert max(outputs["head"]) == BATCH * LOSS_TILE * VOCAB
    assert max(outputs["mlp"]) == BATCH * MLP_TILE * first.out_features if kind == "llama" else \
        max(outputs["mlp"]) == BATCH * MLP_TILE * first.nf


def test_without_labels_the_logits_are_hf_own_and_with_labels_none():
    plain, tiled = _pair("llama")
    ids = batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(tiled(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tiled(input_ids=ids, logits_to_keep=1).logits,
                                   plain(input_ids=ids, logits_to_keep=1).logits, rtol=1e-5, atol=1e-6)
    out = tiled(input_ids=ids, labels=ids)
    assert out.logits is None and out.cache is not None  # the base model's outputs are kept
    as_tuple = tiled(ids, labels=ids, return_dict=False)
    torch.testing.assert_close(as_tuple[0], plain(ids, labels=ids).loss, rtol=1e-5, atol=0)


def test_t5_feed_forward_is_tiled_and_equal():
    torch.manual_seed(0)
    plain = t5()
    tiled = copy.deepcopy(plain)
    mlps = tile_mlp(tiled, MLP_TILE)
    assert len(mlps) == 4 and all(type(m).__name__ == "T5DenseGatedActDense" for m in mlps)  # 2 + 2 layers
    b = batch()
    losses, grads = [], []
    for m in (plain, tiled):
        loss = m(input_ids=b["input_ids"], labels=b["labels"][:, :11].contiguous()).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_tiling_again_sets_the_tile_and_the_model_pickles():
    _plain, tiled = _pair("gpt2")
    b = batch()
    before = lm_loss(tiled, b, "labels").detach()
    tile_mlp(tiled, 3)
    tile_lm_loss(tiled, 11)
    mlp = tiled.transformer.h[1].mlp
    assert is_tiled(mlp) and mlp.forward.tile_tokens == 3 and mlp.forward.module is mlp
    assert tiled.forward.tile_tokens == 11
    copied = pickle.loads(pickle.dumps(tiled))
    assert isinstance(copied.transformer.h[1].mlp.forward, TiledMLPForward)
    assert copied.transformer.h[1].mlp.forward.module is copied.transformer.h[1].mlp
    assert copied.forward.model is copied and type(copied.loss_function).__name__ == "TiledCausalLMLoss"
    torch.testing.assert_close(lm_loss(copied, b, "labels"), before, rtol=1e-5, atol=0)
    assert lm_loss(copied, b, "labels") is not None and copied(input_ids=b["input_ids"], labels=b["labels"]).logits \
        is None
    assert set(copied.state_dict()) == set(_plain.state_dict())  # HF's keys: checkpoints and export unchanged


class Scaled:
    """A loss wrapper as sequence parallelism's whole-sequence loss is one: the wrapped loss as ``inner``, its
    value changed (here tripled) on the way out."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, logits, labels, vocab_size, **kwargs):
        return 3 * self.inner(logits, labels, vocab_size, **kwargs)


@pytest.mark.parametrize("wrapped", ["before", "after"])
def test_a_loss_wrapper_around_the_model_loss_composes_in_either_order(wrapped):
    """The tiled loss sits at the bottom of the model's loss chain: a wrapper installed before or after
    ``tile_lm_loss`` gets the tiled loss as its inner one and still applies."""
    plain, tiled = _pair("gpt2", 0, 0)
    if wrapped == "before":
        tiled.loss_function = Scaled(tiled.loss_function)
    tile_lm_loss(tiled, LOSS_TILE)
    if wrapped == "after":
        tiled.loss_function = Scaled(tiled.loss_function)
    b = batch()
    ref_loss, ref_grads = _loss_and_grads(plain, b, "shift_labels")
    loss, grads = _loss_and_grads(tiled, b, "shift_labels")
    assert type(tiled.loss_function.inner).__name__ == "TiledCausalLMLoss"
    assert tiled(input_ids=b["input_ids"], labels=b["labels"]).logits is None
    torch.testing.assert_close(loss, 3 * ref_loss, rtol=1e-5, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], 3 * g, rtol=1e-5, atol=1e-7, msg=name)


def test_bad_input_gets_one_clear_error():
    model = MODELS["gpt2"]()
    for bad in (0, -3, True, 2.5, "8", None):
        with pytest.raises(ValueError, match=r"tile_mlp: tile_tokens must be a positive int"):
            tile_mlp(model, bad)
        with pytest.raises(ValueError, match=r"tile_lm_loss: tile_tokens must be a positive int"):
            tile_lm_loss(model, bad)
    with pytest.raises(ValueError, match=r"tile_mlp: Sequential has no transformer MLP.*GPT2MLP, LlamaMLP, "
                                         r"T5LayerFF's DenseReluDense"):
        tile_mlp(nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)), 8)
    with pytest.raises(ValueError, match=r"tile_lm_loss: GPT2Model holds no causal LM.*GPT2LMHeadModel, "
                                         r"LlamaForCausalLM"):
        tile_lm_loss(model.transformer, 8)
    tile_lm_loss(model, 8)
    ids = batch()["input_ids"]
    model.loss_function = lambda *a, **k: torch.zeros(())  # replaced after tiling: the tiled logits reach no reader
    with pytest.raises(RuntimeError, match=r"GPT2LMHeadModel's loss_function was replaced after tile_lm_loss.*call "
                                           r"tile_lm_loss\(model, tile_tokens\) again"):
        model(input_ids=ids, labels=ids)
    with pytest.raises(ValueError, match=r"tile_lm_loss: GPT2LMHeadModel's loss is .* not HF's ForCausalLMLoss"):
        tile_lm_loss(model, 8)
    model.loss_function = Scaled(lambda *a, **k: torch.zeros(()))  # a wrapper around another loss: refused too
    with pytest.raises(ValueError, match=r"tile_lm_loss: GPT2LMHeadModel's loss is .* not HF's ForCausalLMLoss"):
        tile_lm_loss(model, 8)
