"""Tiled MLP + tiled LM loss under ZeroEngine stage 3 (gloo ranks) against the same run untiled.

fp32, SGD with momentum (linear in the gradients, so the final weights compare the reduced gradients of every
step): HF GPT-2 and Llama (tiny, from configs) at 2 ranks, and GPT-2 at 1 rank, with stage 3 alone and with the
engine's activation checkpointing ("auto": the blocks, whose recompute re-runs the tiles under nested
checkpoints; or the MLPs themselves, the tiled forward inside the engine's checkpoint, and tiled again once the
engine lets go) and activation offload. Losses and final weights equal the untiled run at rtol 1e-5; the LM head
(called as a module, so stage 3 gathers it) never outputs more than one tile of logits; the recorded unit
order and the peak of gathered bytes are the untiled run's (the tiles' recomputes gather nothing more), except
where the projections are units themselves (Llama's lm_head too): those run per tile and in the recomputes.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.sequence_parallel import is_tiled, tile_lm_loss, tile_mlp
from tests.helpers.dist_utils import run_distributed
from tests.helpers.tiled_models import BATCH, MODELS, VOCAB, batch, lm_loss

STEPS, MLP_TILE, LOSS_TILE = 3, 5, 7
PROJ = "zero3, the projections as units"
CASES = {
    "zero3": dict(stage=3),
    "zero3 + checkpointing + offload": dict(stage=3, activation_checkpointing="auto", offload_activations=True),
    # the engine wraps the tiled MLPs' forward in its own checkpoint, and gives the tiled one back at the end
    "zero3 + MLP checkpointing": dict(stage=3, activation_checkpointing="MLP"),
    # units inside the tiles: the tile recomputes in backward call them (Llama's lm_head is a Linear unit too)
    "zero3, the projections as units": dict(stage=3, unit_classes="PROJECTIONS"),
}


def _train(rank, kind, cfg, tiled, variant):
    torch.manual_seed(0)
    model = MODELS[kind]()
    head_out = []
    if tiled:
        tile_mlp(model, MLP_TILE)
        tile_lm_loss(model, LOSS_TILE)
    model.lm_head.register_forward_hook(lambda m, a, out: head_out.append(out.numel()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ZeroEngine(model, opt, cfg)
    losses = []
    for step in range(STEPS):
        engine.prepare_forward()
        loss = lm_loss(model, batch(step, rank), variant)
        loss.backward()
        losses.append(loss.item())
        engine.step()
    out = {"losses": losses, "head_max": max(head_out), "order": list(engine.partitioner._order),
           "lm_head_unit": any(u.module is model.lm_head for u in engine.partitioner.units[:-1]),
           "peak_gathered": engine.partitioner.peak_gathered_bytes}
    engine.remove()
    out["tiled_after"] = [is_tiled(m) for m in model.modules() if type(m).__name__ in ("GPT2MLP", "LlamaMLP")]
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _runs(rank, world_size, cases):
    results = {}
    for kind, label, variant in cases:
        try:
            options = dict(CASES[label])
            if options.get("activation_checkpointing") == "MLP":
                options["activation_checkpointing"] = [{"gpt2": "GPT2MLP", "llama": "LlamaMLP"}[kind]]
            if options.get("unit_classes") == "PROJECTIONS":
                options["unit_classes"] = [{"gpt2": "Conv1D", "llama": "Linear"}[kind]]
            results[(kind, label)] = tuple(_train(rank, kind, ZeroConfig(**options), tiled, variant)
                                           for tiled in (False, True))
        except Exception:  # noqa: BLE001 -- reported by the test, with the case
            results[(kind, label)] = traceback.format_exc()
    return results


def _check(results, cases):
    for rank_results in results:
        for kind, label, _variant in cases:
            res = rank_results[(kind, label)]
            assert not isinstance(res, str), f"{kind} {label}:\n{res}"
            plain, tiled = res
            where = f"{kind} {label}"
            torch.testing.assert_close(torch.tensor(tiled["losses"]), torch.tensor(plain["losses"]), rtol=1e-5,
                                       atol=0, msg=where)
            for k, v in plain["state"].items():
                torch.testing.assert_close(tiled["state"][k], v, rtol=1e-5, atol=1e-7, msg=f"{where}: {k}")
            assert plain["head_max"] == BATCH * 23 * VOCAB and tiled["head_max"] == BATCH * LOSS_TILE * VOCAB, where
            assert (tiled["lm_head_unit"], plain["lm_head_unit"]) == ((kind, label) == ("llama", PROJ),) * 2, where
            assert tiled["tiled_after"] == [True] * 2 and plain["tiled_after"] == [False] * 2, where
            if label != PROJ:
                assert tiled["order"] == plain["order"], where
                assert tiled["peak_gathered"] <= plain["peak_gathered"], where
            else:  # a unit inside a tile runs once per tile, and again in the tile's recompute in backward
                assert len(tiled["order"]) > len(plain["order"]), where


@pytest.mark.timeout(300)
def test_tiled_stage3_at_two_ranks_equals_the_untiled_run():
    cases = [("gpt2", "zero3", "shift_labels"), ("llama", "zero3", "labels"), ("gpt2", PROJ, "labels"),
             ("llama", PROJ, "shift_labels"),
             ("gpt2", "zero3 + checkpointing + offload", "labels"),
             ("llama", "zero3 + checkpointing + offload", "shift_labels")]
    _check(run_distributed(_runs, 2, cases), cases)


@pytest.mark.timeout(180)
def test_tiled_stage3_at_one_rank_equals_the_untiled_run():
    cases = [("gpt2", "zero3 + checkpointing + offload", "shift_labels"), ("gpt2", "zero3 + MLP checkpointing", "labels"),
             ("llama", "zero3 + MLP checkpointing", "shift_labels")]
    _check(run_distributed(_runs, 1, cases), cases)
