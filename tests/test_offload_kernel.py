"""``offload_kernel``: which kernel the offloaded optimizer step runs, said at setup and selectable.

The offloaded step swaps the user's AdamW for torch's fused CPU kernel by default ("fused"). That kernel is
not bit-identical to the default one DDP runs; on HF GPT-2 the key third of each attention bias has a true
gradient of zero, and Adam turns the kernels' last-bit differences there into updates of the order of lr.
``offload_kernel="user"`` leaves the user's optimizer as it is: the run is then DDP's at fp32 rtol 1e-5.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero import ZeroConfig, ZeroEngine, ZeroFabricStrategy, ZeroStrategy
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import make_model, make_optimizer
from tests.helpers.parity import close
from tests.helpers.zoo_models import ZOO, zoo_adamw, zoo_ddp_reference

STEPS = 3
CONFIGS = {
    "zero2_offload": dict(stage=2, offload_optimizer=True),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
}


def _train(rank, cfg):
    builder, make_batch, loss_fn = ZOO["gpt2"]
    torch.manual_seed(0)
    model = builder()
    opt = zoo_adamw(model)  # torch's defaults, as users write it
    engine = ZeroEngine(model, opt, cfg)
    losses = []
    for step in range(STEPS):
        engine.prepare_forward()
        loss = loss_fn(model, make_batch(step, rank))
        loss.backward()
        losses.append(loss.item())
        engine.step()
    fused = engine.sharded.uses_fused
    engine.restore_fp32_module()
    return {"losses": losses, "fused": fused, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _all(rank, world_size):
    out = {"ddp": zoo_ddp_reference(rank, "gpt2", STEPS)}
    for name, kw in CONFIGS.items():
        for kernel in ("user", "fused"):
            out[(name, kernel)] = _train(rank, ZeroConfig(**kw, offload_kernel=kernel))
    return out


@functools.lru_cache(maxsize=None)
def results():
    return run_distributed(_all, 2)


def _max_abs(a, b):
    return float((a - b).abs().max())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_user_kernel_offload_matches_ddp_on_gpt2(name):
    for rank, res in enumerate(results()):
        ref, got = res["ddp"], res[(name, "user")]
        assert got["fused"] is False  # the user's AdamW, not the fused swap
        close(got["losses"], ref["losses"], f"rank {rank} {name} losses")
        close(got["state"], ref["state"], f"rank {rank} {name}")
        if rank == 0:  # what the default kernel costs here (reported, not asserted: it is the documented trade)
            fused = res[(name, "fused")]
            assert fused["fused"] is True
            worst = max(_max_abs(fused["state"][k], ref["state"][k]) for k in ref["state"]
                        if ref["state"][k].is_floating_point())
            print(f"{name}: offload_kernel='fused' largest weight difference to DDP {worst:.2e} (lr 1e-2)")


def test_default_offload_states_the_kernel_swap(caplog):
    model = make_model()
    with caplog.at_level(logging.INFO, logger="lightning_zero.engine"):
        engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=2, offload_optimizer=True))
    assert engine.sharded.uses_fused
    lines = [r.getMessage() for r in caplog.records if "offload_optimizer:" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "AdamW steps with torch's fused CPU kernel (fused=True)" in lines[0]
    assert "not bit-identical to DDP" in lines[0] and "offload_kernel='user'" in lines[0]
    engine.remove()


def test_user_kernel_keeps_the_optimizer_and_says_nothing(caplog):
    model = make_model()
    opt = make_optimizer(model, "adamw")
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with caplog.at_level(logging.INFO, logger="lightning_zero.engine"):
        engine = ZeroEngine(model, opt, ZeroConfig(stage=2, offload_optimizer=True, offload_kernel="user"))
        opt.add_param_group({"params": []})  # an added group keeps the user's kernel too
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups[:2]] == before
    assert not any(g.get("fused") for g in opt.param_groups) and not opt.defaults.get("fused")
    assert "offload_optimizer:" not in caplog.text
    engine.remove()


@pytest.mark.parametrize("bad", ["Fused", "foreach", None, True])
def test_unknown_offload_kernel_is_one_clear_error(bad):
    msg = r"offload_kernel must be one of 'fused', 'user'.*got"
    with pytest.raises(ValueError, match=msg):
        ZeroConfig(stage=2, offload_optimizer=True, offload_kernel=bad)
    with pytest.raises(ValueError, match=msg):
        ZeroStrategy(stage=2, offload_optimizer=True, offload_kernel=bad)
    with pytest.raises(ValueError, match=msg):
        ZeroFabricStrategy(stage=2, offload_optimizer=True, offload_kernel=bad)


def test_strategies_and_hydra_schema_take_the_knob():
    assert ZeroStrategy(stage=3, offload_optimizer=True, offload_kernel="user").zero_config.offload_kernel == "user"
    assert ZeroFabricStrategy(stage=2, offload_optimizer=True, offload_kernel="user").zero_config.offload_kernel == "user"
    assert ZeroStrategy(stage=2).zero_config.offload_kernel == "fused"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from omegaconf import OmegaConf
    from t5_config import StrategyConf, build_strategy

    cfg = OmegaConf.merge(OmegaConf.structured(StrategyConf), {"offload_optimizer": True, "offload_kernel": "user",
                                                               "start_method": "fork"})
    assert build_strategy(cfg).zero_config.offload_kernel == "user"
