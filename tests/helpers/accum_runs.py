"""A zoo model (HF GPT-2 or T5 from a config) trained with gradient accumulation and norm clipping, under
ZeroEngine or torch DDP.

The offload parity tests (NVMe, CPU) compare the two at fp32 rtol 1e-5: same seed, same per-rank batches,
same AdamW (torch's default kernel on both sides, ``offload_kernel="user"`` on ours; or torch's fused kernel
on both), a LambdaLR schedule, ``ACCUM`` micro-batches per step (``no_sync`` for all but the last) and
``clip_grad_norm_(CLIP)``. lr is 1e-3, as in tests/test_pipeline.py: GPT-2's key bias has an analytically zero
gradient (softmax ignores a per-query shift), so any two summation orders of its float noise (accumulation,
reduce-scatter vs all-reduce, the clip coefficient's last bit) become AdamW updates of order lr; at lr 1e-2
that is 3e-6 in those biases for every ZeRO stage, offloaded or not, against 1e-7 at 1e-3.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import clip_and_step
from tests.helpers.zoo_models import ZOO

ACCUM, CLIP, LR = 2, 0.5, 1e-3


def zoo_setup(cfg: Optional[ZeroConfig], fused: bool = False, name: str = "gpt2"):
    """(model, optimizer, schedule, engine or None) of ``ZOO[name]`` from seed 0."""
    builder = ZOO[name][0]
    torch.manual_seed(0)
    model = builder()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    engine = ZeroEngine(model, opt, cfg) if cfg is not None else None
    return model, opt, sched, engine


def zoo_steps(rank: int, model, opt, sched, engine, steps: range, runner=None, clip: Optional[float] = CLIP,
              name: str = "gpt2") -> tuple[list, list]:
    """``steps`` optimizer steps (their indices pick the batches): per micro-batch losses, pre-clip norms."""
    _, make_batch, loss_fn = ZOO[name]
    runner = runner or (model if engine is not None else DDP(model, find_unused_parameters=True))
    losses, norms = [], []
    for step in steps:
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            ctx = torch.enable_grad() if last else (engine.no_sync() if engine is not None else runner.no_sync())
            with ctx:
                if engine is not None:
                    engine.prepare_forward()
                loss = loss_fn(runner, make_batch(step * ACCUM + micro, rank)) / ACCUM
                loss.backward()
            losses.append(loss.item())
        clip_and_step(engine, model, opt, clip, norms)
        sched.step()
    return losses, norms


def zoo_run(rank: int, cfg: Optional[ZeroConfig], steps: int, fused: bool = False, clip: Optional[float] = CLIP,
            name: str = "gpt2") -> tuple[list, list, dict]:
    """(losses, norms, final fp32 state dict) of ``steps`` steps; ``cfg=None``: the torch DDP reference."""
    model, opt, sched, engine = zoo_setup(cfg, fused, name)
    losses, norms = zoo_steps(rank, model, opt, sched, engine, range(steps), clip=clip, name=name)
    if engine is not None:
        engine.restore_fp32_module()
        engine.remove(hand_back=False)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
