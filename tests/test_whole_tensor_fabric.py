"""Whole-tensor optimizers under Lightning Fabric: Muon + AdamW (``muon_split``) set up together or one by one,
``fabric.backward``, accumulation with ``fabric.no_backward_sync``, clipping across both optimizers (DDP's
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``) or per optimizer (``fabric.clip_gradients``), an
LR schedule on each; against Fabric's DDP with the same seed and data, on forked gloo ranks that build every
Fabric in one job. Muon's Newton-Schulz is patched to fp32 in the ranks (tests/helpers/whole_tensor_lightning.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

from lightning_zero import ZeroFabricStrategy, muon_split
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lightning_models import uses_sometimes
from tests.helpers.models import batch, loss_fn, make_model
from tests.helpers.whole_tensor_lightning import (CLIP, count_steps, fp32_newton_schulz, routes_released,
                                                  tracked_engines)

RTOL, ATOL = 1e-5, 1e-6
STEPS, ACCUM = 3, 2


def _run(strategy, rank: int, clip: str, separate: bool = False) -> dict:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size())
    fabric.launch()
    model = make_model()
    counts: list = []
    if separate:  # setup_module, the optimizers over the set-up module's parameters, setup_optimizers
        model = fabric.setup_module(model)
    hidden, rest = muon_split(model)
    muon = torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01, eps=1e-2)  # eps: its step feels the clip
    for opt in (muon, adamw):
        count_steps(opt, counts)
    if separate:
        muon, adamw = fabric.setup_optimizers(muon, adamw)
    else:
        model, muon, adamw = fabric.setup(model, muon, adamw)
    scheds = [torch.optim.lr_scheduler.LambdaLR(muon, lambda s: 1.0 / (1.0 + s)),
              torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.7)]
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = loss_fn(model, batch(step, rank, micro), uses_sometimes(rank, step)) / ACCUM
                fabric.backward(loss)
            losses.append(loss.item())
        if clip == "global":  # DDP's line: one norm over both optimizers
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        else:  # Fabric's own: each optimizer's parameters by their own norm
            norms += [float(fabric.clip_gradients(model, opt, max_norm=CLIP)) for opt in (muon, adamw)]
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        for sched in scheds:
            sched.step()
    gathered = getattr(fabric.strategy, "gathered_params", None)  # stage 3: whole only in there
    with gathered() if gathered is not None else contextlib.nullcontext():
        params = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    if isinstance(fabric.strategy, ZeroFabricStrategy):
        fabric.strategy.teardown()
    return {"losses": losses, "norms": norms, "params": params, "step_counts": counts,
            "lrs": [muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]]}


def _late_optimizer(rank: int) -> str:
    """AdamW set up after Muon trained: the error's text."""
    fabric = Fabric(strategy="zero2", accelerator="cpu", devices=torch.distributed.get_world_size())
    fabric.launch()
    model = fabric.setup_module(make_model())
    hidden, rest = muon_split(model)
    muon = fabric.setup_optimizers(torch.optim.Muon(hidden, lr=2e-2))  # one optimizer: no tuple
    fabric.backward(loss_fn(model, batch(0, rank), False))
    muon.step()
    try:
        fabric.setup_optimizers(torch.optim.AdamW(rest))
        return "no error"
    except RuntimeError as err:
        return str(err)
    finally:
        fabric.strategy.teardown()


def _job(rank: int, world_size: int) -> dict:
    torch.optim._muon._zeropower_via_newtonschulz = fp32_newton_schulz  # this forked rank only
    ddp = lambda: DDPStrategy(find_unused_parameters=True)  # noqa: E731
    out, before = {}, tracked_engines()
    for clip in ("global", "per_optimizer"):
        out["ddp", clip] = _run(ddp(), rank, clip)
    for name in ("zero1", "zero2", "zero3", "zero3_offload"):  # the registered names
        out[name, "global"] = _run(name, rank, "global")
    out["zero2", "per_optimizer"] = _run("zero2", rank, "per_optimizer")
    out["zero3 separate", "global"] = _run(ZeroFabricStrategy(stage=3), rank, "global", separate=True)
    out["late_optimizer"] = _late_optimizer(rank)
    out["torch_clip_restored"] = routes_released(before)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_job, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", [("zero1", "global"), ("zero2", "global"), ("zero3", "global"),
                                 ("zero3_offload", "global"), ("zero2", "per_optimizer"),
                                 ("zero3 separate", "global")], ids=lambda k: "-".join(k).replace(" ", "_"))
def test_muon_adamw_under_fabric_equals_fabric_ddp(runs, key):
    for rank, res in enumerate(runs):
        got, ref = res[key], res["ddp", key[1]]
        for what in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(got[what]), torch.tensor(ref[what]), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {what}: {m}")
        assert all(n > CLIP for n in ref["norms"])  # clipping acts
        for name, v in ref["params"].items():
            torch.testing.assert_close(got["params"][name], v, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        assert got["step_counts"] == ref["step_counts"] == [STEPS, STEPS]  # once per accumulated step
        assert got["lrs"] == ref["lrs"]
    first = make_model()
    assert not torch.equal(runs[0]["ddp", "global"]["params"]["fc1.weight"], first.fc1.weight.detach())


def test_torch_clip_is_torchs_own_after_teardown(runs):
    assert all(res["torch_clip_restored"] for res in runs)


def test_an_optimizer_set_up_after_training_is_refused(runs):
    for res in runs:
        assert "joins a model whose optimizers already trained" in res["late_optimizer"]
        assert "Allowed: every optimizer of a model set up before training" in res["late_optimizer"]
