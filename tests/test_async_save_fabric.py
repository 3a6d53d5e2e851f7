"""``ZeroFabricStrategy(async_save=True)``: ``fabric.save`` returns once the state is staged, a resume from the
background copy (one model, and two models in one directory) equals the uninterrupted run bit for bit, and a
write that fails is raised by the next ``fabric.backward`` on every rank."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.fabric import Fabric

import lightning_zero  # noqa: F401
from lightning_zero import ZeroFabricStrategy
from lightning_zero.checkpoint import CheckpointWriteError
from tests.helpers.ckpt_models import run_forked
from tests.helpers.fabric_pair import pair_state, pair_steps, setup_pair

pytestmark = pytest.mark.timeout(240)


def _setup(stage: int, async_save: bool):
    return setup_pair(ZeroFabricStrategy(stage=stage, async_save=async_save))


def _job(rank, world_size, root, stage):
    out = {}
    fabric, g, d, opt_g, opt_d = _setup(stage, async_save=True)
    pair_steps(fabric, g, d, opt_g, opt_d, rank, 0, 2)
    fabric.save(os.path.join(root, "both"), {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": 2})
    fabric.save(os.path.join(root, "g_only"), {"g": g, "opt_g": opt_g, "step": 2})  # waits for the first
    out["after"] = pair_steps(fabric, g, d, opt_g, opt_d, rank, 2, 2)  # while g_only is written
    out["uninterrupted"] = pair_state(fabric, g, d)
    with open(os.path.join(root, "blocker"), "w") as f:  # a file where the next checkpoint's directory must go
        f.write("x")
    fabric.save(os.path.join(root, "blocker", "c"), {"g": g, "opt_g": opt_g})
    fabric.strategy.checkpoints.saver._thread.join()  # the failed write is over; it surfaces at the next backward
    try:
        pair_steps(fabric, g, d, opt_g, opt_d, rank, 4, 1)
        out["raised"] = None
    except CheckpointWriteError as err:
        out["raised"] = str(err)
    fabric.strategy.teardown()

    fabric, g, d, opt_g, opt_d = _setup(stage, async_save=True)
    state = {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": 0}
    fabric.load(os.path.join(root, "both"), state)
    out["resumed"] = pair_steps(fabric, g, d, opt_g, opt_d, rank, state["step"], 2)
    out["resumed state"] = pair_state(fabric, g, d)
    state = {"g": g, "opt_g": opt_g, "step": 0}
    fabric.load(os.path.join(root, "g_only"), state)
    out["g_only step"] = state["step"]
    fabric.strategy.teardown()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_background_saves_resume_exactly_and_failures_surface(tmp_path, stage):
    res = run_forked(_job, 2, str(tmp_path), stage)
    for r in res:
        assert r["resumed"] == r["after"]
        for k, v in r["uninterrupted"].items():
            assert torch.equal(r["resumed state"][k], v), k
        assert r["g_only step"] == 2
        assert r["raised"] is not None and "background checkpoint save" in r["raised"], r["raised"]
    assert sorted(os.listdir(tmp_path)) == ["blocker", "both", "g_only"], "nothing of the failed save is visible"


def _tp_job(rank, world_size, root):
    from torch.utils.data import DataLoader

    from tests.helpers.tp_models import TokenRows, full_state, lm_loss, make_gpt, parallelize

    def run(seed, resume):
        strategy = ZeroFabricStrategy(stage=2, tensor_parallel_size=2, async_save=True,
                                      parallelize_fn=lambda m, mesh: parallelize(m, mesh["tensor_parallel"]))
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
        fabric.launch()
        model = fabric.setup_module(make_gpt(seed=seed))
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        state = {"model": model, "optimizer": opt, "step": 0}
        if resume:
            fabric.load(os.path.join(root, "tp.ckpt"), state)
        batches = list(fabric.setup_dataloaders(DataLoader(TokenRows(), batch_size=4, shuffle=False)))
        losses = []
        for step in range(state["step"], 3):
            fabric.backward(lm_loss(model, batches[step]))
            opt.step()
            opt.zero_grad()
            if step == 1 and not resume:
                fabric.save(os.path.join(root, "tp.ckpt"), {"model": model, "optimizer": opt, "step": 2})
            losses.append(lm_loss(model, batches[step]).item())
        final = full_state(model)
        fabric.strategy.teardown()  # waits for the background write
        return losses, final

    uninterrupted = run(0, resume=False)
    resumed = run(1, resume=True)
    return uninterrupted, resumed


def test_fabric_tensor_parallel_background_save_resumes_exactly(tmp_path):
    for (losses, final), (resumed_losses, resumed_final) in run_forked(_tp_job, 4, str(tmp_path)):
        assert resumed_losses == losses[2:]
        for k, v in final.items():
            assert torch.equal(resumed_final[k], v), k
