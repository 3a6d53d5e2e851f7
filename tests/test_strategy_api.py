"""ZeroStrategy / ZeroPrecision API: validation messages, registry names, plugin selection, optimizer checks,
evaluation entry points and checkpoint resume across world sizes and stages (CPU, gloo, fork launcher)."""

from __future__ import annotations

import glob
import math
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import HalfPrecision
from lightning.pytorch.strategies import StrategyRegistry

from torch.utils.data import DistributedSampler

import lightning_zero
from lightning_zero import ZeroConfig, ZeroEngine, ZeroPrecision, ZeroStrategy, register_shardable_optimizer

from tests.helpers.lightning_models import ParityModule, TokenDataset, load_rank_files, trainer_kwargs
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer

SUFFIXES = {"": "popen", "_spawn": "spawn", "_fork": "fork"}


# -- constructor validation ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(stage=5), r"Allowed stages: 0, 1, 2"),
        (dict(stage=-1), r"Allowed stages: 0, 1, 2"),
        (dict(stage=True), r"Allowed stages: 0, 1, 2"),
        (dict(stage=0, offload_optimizer=True), r"Allowed: offload_optimizer with stage 1, 2"),
        (dict(stage=2, offload_params=True), r"offload_params.*stage 3"),
        (dict(stage=1, offload_params=True), r"offload_params.*stage 3"),
        (dict(bucket_mb=0), r"bucket_mb must be a positive number"),
        (dict(bucket_mb=-4.0), r"bucket_mb must be a positive number"),
        (dict(bucket_mb="25"), r"bucket_mb must be a positive number"),
        (dict(bucket_mb=True), r"bucket_mb must be a positive number"),
        (dict(reduce_dtype="int8"), r"Allowed: None, .*bf16.*fp16.*fp32"),
        (dict(start_method="thread"), r"Allowed: popen, spawn, fork, forkserver"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_constructor_rejects_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


def test_constructor_accepts_valid_combinations():
    s = ZeroStrategy(stage=1, offload_optimizer=True, bucket_mb=0.5, reduce_dtype="fp32", start_method="spawn")
    assert s.stage == 1 and s.zero_config.offload_optimizer
    assert s.zero_config.reduce_dtype is torch.float32
    assert s.zero_config.bucket_bytes == 2**19
    assert ZeroStrategy(stage=0, bucket_mb=3).zero_config.bucket_bytes == 3 * 2**20
    assert ZeroStrategy(stage=3, offload_params=True).zero_config.offload_params


# -- registry and Trainer plumbing -----------------------------------------------------------------------------------------
def test_registry_has_every_preset(tmp_path, monkeypatch):
    """Over the package's own table (engine/config.py PRESETS), so a new preset is checked the day it is added."""
    from lightning_zero.engine.config import PRESETS, ZeroConfig

    monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", str(tmp_path))  # where the *_offload_nvme presets' states go

    assert {"zero0", "zero1", "zero2", "zero3", "zero3_offload"} <= set(PRESETS)
    names = set(StrategyRegistry.available_strategies())
    for base, fields in PRESETS.items():
        want = ZeroConfig(**fields)
        for suffix, method in SUFFIXES.items():
            name = base + suffix
            assert name in names, name
            strategy = StrategyRegistry.get(name)
            assert isinstance(strategy, ZeroStrategy), name
            assert strategy.zero_config == want, name  # every field, not only stage and offload
            assert strategy._start_method == method, name


def test_trainer_zero2_fork_resolves_strategy_and_precision():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero2_fork", logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.stage == 2
    assert strategy._start_method == "fork"
    assert isinstance(strategy.precision_plugin, ZeroPrecision)
    assert strategy.precision_plugin.compute_dtype is torch.float32
    assert trainer.precision_plugin is strategy.precision_plugin
    assert strategy.num_processes == 2
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_trainer_bf16_mixed_becomes_zero_precision():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero1", precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ZeroPrecision)
    assert plugin.precision == "bf16-mixed"
    assert plugin.compute_dtype is torch.bfloat16
    assert plugin.mixed and plugin.check_finite and plugin.loss_scaler is None


def test_explicit_zero_precision_plugin_is_kept():
    mine = ZeroPrecision("16-mixed", loss_scale=128.0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero2_fork", plugins=[mine], logger=False)
    assert trainer.strategy.precision_plugin is mine
    assert mine.compute_dtype is torch.float16 and mine.loss_scale == 128.0


def test_unsupported_precision_plugin_names_allowed_values():
    with pytest.raises(ValueError, match=r"Allowed: precision='32-true', '16-mixed' or 'bf16-mixed'"):
        Trainer(accelerator="cpu", devices=2, strategy="zero2_fork", plugins=[HalfPrecision("bf16-true")], logger=False)
    with pytest.raises(ValueError, match=r"HalfPrecision"):
        Trainer(accelerator="cpu", devices=2, strategy="zero1_fork", precision="bf16-true", logger=False)


def test_zero_precision_rejects_unknown_precision():
    with pytest.raises(ValueError, match=r"Allowed: '32-true', '16-mixed', 'bf16-mixed'"):
        ZeroPrecision("64-true")


# -- shardable-optimizer check (engine level, one process without a process group) ---------------------------------------------
def _lbfgs(model):
    return torch.optim.LBFGS([p for p in model.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lbfgs_refused_with_clear_error(stage):
    model = make_model()
    with pytest.raises(ValueError, match=r"LBFGS re-evaluates the loss through a closure.*Allowed: .*AdamW"):
        ZeroEngine(model, _lbfgs(model), ZeroConfig(stage=stage))


def test_plain_optimizer_state_loads_into_engine_with_frozen_params():
    ref = make_model()
    plain = make_optimizer(ref, "adamw")  # ParityNet.frozen's weight/bias are in the param_groups, as usual
    loss_fn(ref, batch(0, 0), True).backward()
    plain.step()
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=1))
    engine.load_optimizer_state_dict(plain.state_dict())
    back = engine.optimizer_state_dict()  # positions (frozen ones included) survive the round trip
    want = plain.state_dict()
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert set(back["state"]) == set(want["state"])
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(back["state"][i][k], v)


def test_engine_optimizer_state_loads_into_plain_optimizer_with_frozen_params():
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=1))
    loss_fn(model, batch(0, 0), True).backward()
    engine.step()
    state = engine.optimizer_state_dict()
    engine.remove()
    plain = make_optimizer(make_model(), "adamw")
    plain.load_state_dict(state)
    assert len(plain.state) == len(state["state"]) > 0


def test_register_shardable_optimizer_admits_custom_class():
    class SignSGD(torch.optim.Optimizer):  # elementwise: each element's update uses its own gradient only
        def __init__(self, params, lr=0.01):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-g["lr"])

    class MyAdamW(torch.optim.AdamW):  # a subclass may override step(): admitted only once registered
        pass

    model = make_model()
    with pytest.raises(ValueError, match=r"SignSGD cannot run on parameter shards.*register_shardable_optimizer"):
        ZeroEngine(model, SignSGD(model.parameters()), ZeroConfig(stage=2))
    with pytest.raises(ValueError, match=r"MyAdamW cannot run on parameter shards.*register_shardable_optimizer"):
        ZeroEngine(model, MyAdamW(model.parameters()), ZeroConfig(stage=2))
    register_shardable_optimizer(MyAdamW)
    ZeroEngine(model, MyAdamW(model.parameters()), ZeroConfig(stage=2)).remove()

    assert register_shardable_optimizer(SignSGD) is SignSGD  # usable as a decorator
    model, ref = make_model(), make_model()
    engine = ZeroEngine(model, SignSGD(model.parameters(), lr=0.1), ZeroConfig(stage=1))
    ref_opt = SignSGD(ref.parameters(), lr=0.1)
    for step in range(2):
        loss_fn(model, batch(step, 0), True).backward()
        engine.step()
        loss_fn(ref, batch(step, 0), True).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    engine.remove()


# -- fits (fork launcher) ----------------------------------------------------------------------------------------------------
forked = pytest.mark.timeout(300)  # the rank processes are forked from this one


@forked
def test_optimizers_sharing_a_parameter_is_a_clear_error(tmp_path):
    model = ParityModule(str(tmp_path), n_optimizers=2)  # AdamW and SGD over the same parameters
    trainer = Trainer(strategy=ZeroStrategy(stage=1, start_method="fork"), **trainer_kwargs(devices=1, max_steps=1))
    with pytest.raises(Exception) as info:  # raised in the forked rank, re-raised by torch.multiprocessing
        trainer.fit(model)
    text = str(info.value)
    assert "ValueError" in text or isinstance(info.value, ValueError)
    assert "is in optimizer 0 and optimizer 1" in text and "disjoint parameter sets" in text


@forked
def test_fit_then_validate_test_predict_use_distributed_sampler(tmp_path):
    out = str(tmp_path)
    model = ParityModule(out, tag="eval_")
    kw = trainer_kwargs(devices=2, max_steps=3, limit_val_batches=1.0)
    trainer = Trainer(strategy="zero2_fork", **kw)
    trainer.fit(model)
    fit = load_rank_files(out, "eval_", "train", 2)
    for rank, res in enumerate(fit):
        assert res["global_step"] == 3 and res["has_engine"]
        assert res["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}
        # Lightning always shuffles the training sampler (DistributedSampler, seed 0), whatever shuffle= says
        expected = list(DistributedSampler(TokenDataset(), num_replicas=2, rank=rank, shuffle=True, seed=0))
        assert res["seen"]["train"] == expected[: 3 * 4]
    assert not set(fit[0]["seen"]["train"]) & set(fit[1]["seen"]["train"])
    # the parent got rank 0's trained weights back
    for name, v in model.state_dict().items():
        torch.testing.assert_close(v.float(), fit[0]["params"][name], rtol=0, atol=0)

    trainer.validate(model)
    trainer.test(model)
    trainer.predict(model)  # predictions are not returned through a process launcher; the files say it all
    for what, n in (("val", 20), ("test", 22), ("predict", 18)):
        per_rank = load_rank_files(out, "eval_", what, 2)
        for rank, res in enumerate(per_rank):
            assert not res["has_engine"], f"{what} must not build a ZeRO engine (there is no optimizer)"
            assert res["world_size"] == 2
            assert sorted(res["seen"][what]) == list(range(rank, n, 2)), (what, rank, res["seen"][what])
            for name, v in fit[0]["params"].items():  # evaluation runs on the trained weights
                torch.testing.assert_close(res["params"][name], v, rtol=0, atol=0)
        assert sorted(per_rank[0]["seen"][what] + per_rank[1]["seen"][what]) == list(range(n))


@forked
def test_checkpoint_zero2_two_ranks_resumes_zero1_one_rank(tmp_path):
    out = str(tmp_path)
    ckpt_dir = os.path.join(out, "ckpt")
    saver = ParityModule(out, tag="save_")
    kw = trainer_kwargs(devices=2, max_steps=3, enable_checkpointing=True)
    callback = ModelCheckpoint(dirpath=ckpt_dir, filename="zero2-{step}", every_n_train_steps=3, save_top_k=-1)
    # the single-file format; the resumes below run with the default (sharded) format and still read it
    save_strategy = ZeroStrategy(stage=2, start_method="fork", checkpoint_format="full")
    Trainer(strategy=save_strategy, callbacks=[callback], **kw).fit(saver)
    saved = load_rank_files(out, "save_", "train", 2)
    paths = glob.glob(os.path.join(ckpt_dir, "*.ckpt"))
    assert len(paths) == 1, paths
    ckpt = torch.load(paths[0], weights_only=False)
    assert ckpt["global_step"] == 3
    opt_saved = ckpt["optimizer_states"][0]
    # the checkpoint holds the full (consolidated) parameters and optimizer state
    for name, v in saved[0]["params"].items():
        torch.testing.assert_close(ckpt["state_dict"][name].float(), v, rtol=0, atol=0)
    n_managed = sum(p.requires_grad for p in saver.net.parameters())
    # positions as in a plain optimizer over the same param_groups (frozen parameters included)
    assert sum(len(g["params"]) for g in opt_saved["param_groups"]) == len(list(saver.net.parameters()))
    assert len(opt_saved["state"]) >= n_managed - 2  # 'unused' never gets a gradient, so no state
    for st in opt_saved["state"].values():
        assert st["exp_avg"].shape == st["exp_avg_sq"].shape

    def resume(strategy, tag):
        model = ParityModule(out, tag=tag, save_opt_state_on_start=True)
        Trainer(strategy=strategy, **trainer_kwargs(devices=1, max_steps=6)).fit(model, ckpt_path=paths[0])
        return load_rank_files(out, tag, "start", 1)[0], load_rank_files(out, tag, "train", 1)[0]

    start, end = resume(ZeroStrategy(stage=1, start_method="fork"), "res1_")
    # loaded: the saved weights and the saved optimizer state, re-sliced for one rank
    assert start["global_step"] == 3
    for name, v in ckpt["state_dict"].items():
        torch.testing.assert_close(start["params"][name], v.float(), rtol=0, atol=0)
    _assert_opt_state_equal(start["opt_state"], opt_saved)
    # training went on
    assert end["global_step"] == 6 and end["world_size"] == 1
    assert len(end["losses"]) == 3 and all(math.isfinite(x) for x in end["losses"])
    assert not torch.equal(end["params"]["net.fc1.weight"], start["params"]["net.fc1.weight"])

    # the same checkpoint resumed at stage 0 (whole-parameter optimizer state) continues identically
    start0, end0 = resume(ZeroStrategy(stage=0, start_method="fork"), "res0_")
    _assert_opt_state_equal(start0["opt_state"], opt_saved)
    torch.testing.assert_close(end0["losses"], end["losses"], rtol=1e-5, atol=1e-6)
    for name, v in end0["params"].items():
        torch.testing.assert_close(end["params"][name], v, rtol=1e-5, atol=1e-6, msg=name)


def _assert_opt_state_equal(got: dict, want: dict) -> None:
    assert len(got["param_groups"]) == len(want["param_groups"])
    for g, w in zip(got["param_groups"], want["param_groups"]):
        assert g["params"] == w["params"]
        for k in ("lr", "weight_decay", "betas", "eps", "initial_lr"):
            assert g[k] == w[k], k
    assert set(got["state"]) == set(want["state"])
    for i, w in want["state"].items():
        g = got["state"][i]
        assert set(g) == set(w), i
        for k, v in w.items():
            torch.testing.assert_close(torch.as_tensor(g[k]).reshape(torch.as_tensor(v).shape), torch.as_tensor(v),
                                       rtol=0, atol=0, msg=f"state[{i}][{k}]")


def test_package_exports():
    """Every public name resolves, is documented, and is the object its defining module holds."""
    import importlib

    assert len(set(lightning_zero.__all__)) == len(lightning_zero.__all__)
    for name in lightning_zero.__all__:
        obj = getattr(lightning_zero, name)
        if name == "__version__":
            assert isinstance(obj, str) and obj.count(".") == 2
            continue
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
        home = importlib.import_module(obj.__module__)
        assert getattr(home, obj.__qualname__.split(".")[0]) is obj, name
    # the old import paths, kept as aliases
    assert importlib.import_module("lightning_zero.strategy").ZeroStrategy is lightning_zero.ZeroStrategy
    assert importlib.import_module("lightning_zero.precision").ZeroPrecision is lightning_zero.ZeroPrecision


def test_pytorch_lightning_distribution_gets_no_names():
    """Only the ``lightning`` distribution is supported (README): the separate ``pytorch_lightning`` copy has its
    own classes, so half-registered adapters there trained with checks silently missing. It gets no names."""
    pl = pytest.importorskip("pytorch_lightning")
    assert not [n for n in pl.strategies.StrategyRegistry.available_strategies() if n.startswith("zero")]


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_evaluation_leaves_the_model_fp32(stage):
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), precision="bf16-mixed",
                      logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)
    trainer.validate(model)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32, k
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
