"""ZeroFabricStrategy(tensor_parallel_size=2) at stage 2 on 4 gloo ranks against Fabric's DDP on 2 ranks.

The TP2 x DP2 job cuts tests/tp_models' TinyGPT two ways (``parallelize_fn`` in ``fabric.setup_module``, and
by hand before a joint ``fabric.setup``), trains from a ``fabric.setup_dataloaders`` loader and saves with
``fabric.save``; the 2-rank job is the reference (``Fabric(strategy="ddp")``, DP rank d = DDP rank d) and then
loads that checkpoint without tensor parallelism and takes the same next step.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_zero import ZeroFabricStrategy
from lightning_zero.engine.layout import tensor_parallel as TPM
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import TP_FP32, close
from tests.helpers.tp_models import TokenRows as _Rows
from tests.helpers.tp_models import fabric_step, full_state, make_gpt, parallelize

_close = functools.partial(close, tol=TP_FP32)

STEPS, SAVE_AT = 3, 2


def _fabric(strategy) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size())
    fabric.launch()
    return fabric


def _sgd(model):
    # SGD with momentum, as the Trainer's TP test (AdamW turns TP's last-bit matmul differences into ~1e-5)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _loop(fabric, model, opt, loader, steps, save=None):
    """``steps`` optimizer steps of 2 micro-batches with clipping; ``save``: fabric.save after SAVE_AT steps."""
    losses, it, at_save = [], iter(loader), None
    for step in range(steps):
        losses += fabric_step(fabric, model, opt, it)
        if save is not None and step + 1 == SAVE_AT:
            fabric.save(save, {"model": model, "optimizer": opt, "step": SAVE_AT})
            at_save = full_state(model)
    return losses, full_state(model), at_save


def _loader(fabric, skip_steps=0):
    loader = fabric.setup_dataloaders(DataLoader(_Rows(), batch_size=4, shuffle=False))
    it = iter(loader)
    for _ in range(2 * skip_steps):  # a resumed run continues on the batches after the saved step
        next(it)
    return loader if not skip_steps else it


def _tp_job(rank, world_size, root):
    out = {}
    strategy = ZeroFabricStrategy(stage=2, tensor_parallel_size=2,
                                  parallelize_fn=lambda m, mesh: parallelize(m, mesh["tensor_parallel"]))
    fabric = _fabric(strategy)
    mesh = fabric.strategy.device_mesh
    assert mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
    model = fabric.setup_module(make_gpt())  # Fabric's convention: cut in setup_module, then the optimizer
    assert TPM.is_dtensor(model.module.block.q.weight)
    opt = fabric.setup_optimizers(_sgd(model))
    loader = _loader(fabric)
    out["sampler"] = (loader.sampler.num_replicas, loader.sampler.rank)
    out["fn"] = _loop(fabric, model, opt, loader, STEPS, save=os.path.join(root, "tp.ckpt"))
    fabric.strategy.teardown()

    # cut by hand before a joint fabric.setup(model, optimizer)
    fabric = _fabric(ZeroFabricStrategy(stage=2, tensor_parallel_size=2))
    net = parallelize(make_gpt(), fabric.strategy.device_mesh["tensor_parallel"])
    model, opt = fabric.setup(net, _sgd(net))
    out["by_hand"] = _loop(fabric, model, opt, _loader(fabric), STEPS)
    fabric.strategy.teardown()

    # parallelize_fn with an optimizer made before the cut: refused, not trained on stale parameters
    fabric = _fabric(ZeroFabricStrategy(stage=2, tensor_parallel_size=2,
                                        parallelize_fn=lambda m, mesh: parallelize(m, mesh["tensor_parallel"])))
    net = make_gpt()
    try:
        fabric.setup(net, _sgd(net))
    except RuntimeError as e:
        out["stale"] = str(e)
    fabric.strategy.teardown()
    return out


def _reference_and_load_job(rank, world_size, root):
    fabric = _fabric("ddp")
    net = make_gpt()
    model, opt = fabric.setup(net, _sgd(net))
    ref = _loop(fabric, model, opt, _loader(fabric), STEPS)

    # the TP2 x DP2 checkpoint at TP1 x DP2 (no tensor parallelism): the saved values, then the same step 3
    fabric = _fabric(ZeroFabricStrategy(stage=2))
    net = make_gpt(seed=1)
    model, opt = fabric.setup(net, _sgd(net))
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(os.path.join(root, "tp.ckpt"), state)
    loaded = full_state(model)
    resumed = _loop(fabric, model, opt, _loader(fabric, skip_steps=state["step"]), STEPS - state["step"])
    fabric.strategy.teardown()
    return ref, state["step"], loaded, resumed


@functools.lru_cache(maxsize=None)
def _results(root):
    tp = run_distributed(_tp_job, 4, root)
    ref = run_distributed(_reference_and_load_job, 2, root)
    return tp, ref


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(str(tmp_path_factory.mktemp("tp_fabric")))


@pytest.mark.timeout(180)
def test_fabric_tensor_parallel_matches_ddp(results):
    tp, ref = results
    for rank, out in enumerate(tp):
        r_losses, r_params, _ = ref[rank // 2][0]  # ranks (d, 0) and (d, 1) of the (DP, TP) mesh: DDP rank d
        assert out["sampler"] == (2, rank // 2)
        for run in ("fn", "by_hand"):
            losses, params, _ = out[run]
            _close(losses, r_losses)
            assert params.keys() == r_params.keys()
            for k in r_params:
                _close(params[k], r_params[k])
        assert "fabric.setup_module(model), then the optimizer" in out["stale"]


@pytest.mark.timeout(180)
def test_fabric_tp_checkpoint_loads_without_tp(results):
    tp, ref = results
    saved, after = tp[0]["fn"][2], tp[0]["fn"][1]
    for rank, (_, step, loaded, (losses, params, _)) in enumerate(ref):
        assert step == SAVE_AT
        for k in saved:
            _close(loaded[k], saved[k])
            _close(params[k], after[k])  # the momentum came along: the same step 3 as the TP run
        _close(losses, tp[2 * rank]["fn"][0][2 * SAVE_AT:])


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(stage=3, tensor_parallel_size=2), ValueError, "Allowed stages with tensor parallelism: 0, 1, 2"),
    (dict(stage=2, tensor_parallel_size=0), ValueError, "tensor_parallel_size must be an int >= 1"),
    (dict(stage=2, parallelize_fn=lambda m, mesh: m), ValueError, "parallelize_fn needs tensor_parallel_size=T"),
])
def test_fabric_refuses_bad_tensor_parallel_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        ZeroFabricStrategy(**kwargs)


def test_fabric_device_mesh_exists_with_tensor_parallel_only():
    with pytest.raises(AttributeError, match="ZeroFabricStrategy.device_mesh exists with tensor_parallel_size=T only"):
        ZeroFabricStrategy(stage=2).device_mesh
    with pytest.raises(RuntimeError, match=r"after fabric.launch\(\) \(Fabric\)"):
        ZeroFabricStrategy(stage=2, tensor_parallel_size=2).device_mesh  # before fabric.launch()
