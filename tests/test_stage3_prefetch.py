"""Stage 3 prefetch depth and ``reshard_after_forward`` (engine/stage3/partition.py): DDP-exact, and doing
what they say (gathers counted, not timed).

* ``prefetch=k`` gathers the next k units of the recorded order ahead, in forward and backward;
  ``reshard_after_forward=False`` keeps a training unit gathered from its forward to its backward, so a
  step gathers each unit once, not twice (FSDP2's ``reshard_after_forward=False``).
* Against torch DDP (ParityNet: tied weights, frozen / unused / rank-dependent parameters; accumulation,
  clipping) at 2 and 4 ranks, and on HF GPT-2 built from its config.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm import collectives as C
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import UNITS, close, ddp_reference, train_parity_net
from tests.helpers.zoo_models import _hf

SETTINGS = {"prefetch0": dict(prefetch=0), "prefetch2": dict(prefetch=2), "prefetch3": dict(prefetch=3),
            "keep": dict(reshard_after_forward=False), "keep_prefetch2": dict(reshard_after_forward=False, prefetch=2),
            # a checkpointed unit's recompute finds it still gathered: no second gather, released after backward
            "keep_checkpointed": dict(reshard_after_forward=False, activation_checkpointing="auto")}
CASES = [("adamw", 1, None), ("adamw", 2, 0.5)]


def _parity(rank, world_size):
    torch.set_num_threads(1)
    out = {}
    for case in CASES:
        out[("ddp",) + case] = ddp_reference(rank, *case)
        for name, kw in SETTINGS.items():
            cfg = ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0, **kw)
            out[(name,) + case] = train_parity_net(rank, *case, zero=True, cfg=cfg)
    return out


@functools.lru_cache(maxsize=None)
def _results(world_size):
    return run_distributed(_parity, world_size)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_prefetch_depth_and_keeping_units_for_backward_equal_ddp(world_size, setting):
    for res in _results(world_size):
        for case in CASES:
            (rl, rn, rp), (zl, zn, zp) = res[("ddp",) + case], res[(setting,) + case]
            close(zl, rl, f"{setting} {case} losses")
            close(zn, rn, f"{setting} {case} norms")
            close(zp, rp, f"{setting} {case} weights")


# -- GPT-2: DDP parity, and the gathers a verified step issues ----------------------------------------------------
def _tokens(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 100, (2, 8), generator=g)


def gpt2_4_blocks():
    t = _hf()
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=4, n_head=2, vocab_size=100, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _gpt2(rank, world_size, kw):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt2_4_blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kw is None:
        runner, engine = DDP(model), None
    else:
        engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=["GPT2Block"], **kw))
        runner = model
    losses, gathers = [], []
    for step in range(4):
        C.stats.reset()
        ids = _tokens(step, rank)
        loss = runner(ids, labels=ids).loss
        loss.backward()
        if engine is not None:
            engine.step()
        else:
            opt.step()
            opt.zero_grad()
        gathers.append(C.stats.calls["all_gather"])
        losses.append(loss.item())
    peak = engine.partitioner.peak_in_flight if engine is not None else 0
    if engine is not None:
        engine.restore_fp32_module()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, gathers, peak


@pytest.mark.timeout(240)
def test_gpt2_keeping_units_gathers_each_once_and_equals_ddp():
    runs = {name: run_distributed(_gpt2, 2, kw) for name, kw in
            (("ddp", None), ("default", {}), ("keep", dict(reshard_after_forward=False)),
             ("prefetch2", dict(prefetch=2)), ("none", dict(prefetch=0)))}
    for rank in range(2):
        ref = runs["ddp"][rank]
        for name in ("default", "keep", "prefetch2", "none"):
            close(runs[name][rank][0], ref[0], f"{name} losses")
            close(runs[name][rank][1], ref[1], f"{name} weights")
        # a verified step (the 3rd: recorded in the 1st, verified after it) gathers each of the 4 blocks in
        # forward and the first three again in backward by default (the last block's backward follows its
        # forward: it stays gathered between them), each once when kept for backward
        default, keep = runs["default"][rank][2][2], runs["keep"][rank][2][2]
        assert default - keep == 3, (default, keep)
        # each unit is prefetched once either way; deeper prefetch has more gathers in flight at once, and the
        # first `prefetch` blocks' gathers travel behind the root's at the forward's start
        assert (runs["prefetch2"][rank][3], runs["default"][rank][3], runs["none"][rank][3]) == (3, 2, 1)
