"""ZeroFabricStrategy under Lightning Fabric against Fabric's own DDP, and its checkpoints against the Trainer's.

Every distributed job runs on forked gloo ranks (``tests/helpers/dist_utils.run_distributed``) with the process
group already initialized, so each rank builds several ``Fabric`` objects in a row (Fabric sees an
externally launched job and reuses the group): the DDP reference and every ZeRO variant in one job.
"""

from __future__ import annotations

import contextlib
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

import lightning_zero
from lightning_zero import ZeroFabricPrecision, ZeroFabricStrategy, ZeroStrategy
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.config import PRESETS
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lightning_models import TokenDataset, trainer_kwargs, uses_sometimes
from tests.helpers.models import DIM, VOCAB, batch, loss_fn, make_model, make_optimizer
from tests.helpers.parity import close as _close

STEPS = 3


def _fabric(strategy, precision="32-true", plugins=None) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size(),
                    precision=None if plugins else precision, plugins=plugins)
    fabric.launch()
    return fabric


def _params(fabric, model) -> dict[str, torch.Tensor]:
    gathered = getattr(fabric.strategy, "gathered_params", None)  # stage 3: whole only in there
    with gathered() if gathered is not None else contextlib.nullcontext():
        return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def _train(fabric, model, opt, rank, steps, start=0, accum=1, clip=None, clip_val=None, sometimes=True,
           reductions=None):
    """The loop; ``reductions`` (a list) gets the gradient reductions issued inside no_backward_sync."""
    losses = []
    for step in range(start, start + steps):
        for micro in range(accum):
            before = collectives.stats.calls.copy()
            with fabric.no_backward_sync(model, enabled=micro < accum - 1):
                loss = loss_fn(model, batch(step, rank, micro), sometimes and uses_sometimes(rank, step))
                fabric.backward(loss)
            if micro < accum - 1 and reductions is not None:
                # the gradient reductions: gloo's "auto" reduce-scatters through an all-to-all
                reductions.append(sum(n for op, n in (collectives.stats.calls - before).items()
                                      if "reduce" in op or op == "all_to_all"))
            losses.append(loss.item())
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip)
        if clip_val is not None:
            fabric.clip_gradients(model, opt, clip_val=clip_val)
        opt.step()
        opt.zero_grad()
    return losses


class MetaNet(torch.nn.Module):
    """Every parameter owned by a module with ``reset_parameters`` (what a meta-device build needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.fc1, self.fc2 = torch.nn.Linear(DIM, 13), torch.nn.Linear(13, VOCAB)

    def forward(self, tokens, use_sometimes=False):
        return self.fc2(torch.tanh(self.fc1(self.emb(tokens))))


def _meta_net() -> MetaNet:
    torch.manual_seed(0)
    return MetaNet()


def _run(strategy, rank, precision="32-true", plugins=None, build="setup", net=make_model, **loop):
    """One training run; ``build``: "setup" (fabric.setup(model, opt)), "separate" (setup_module, then the
    optimizer over the set-up module, then setup_optimizers) or "meta" / "meta_separate" (built under
    ``fabric.init_module(empty_init=True)``)."""
    fabric = _fabric(strategy, precision, plugins)
    if build.startswith("meta"):
        with fabric.init_module(empty_init=True):
            model = net()
        assert all(p.is_meta for p in model.parameters())
    else:
        model = net()
    if build in ("separate", "meta_separate"):
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(make_optimizer(model, "adamw"))
    else:
        model, opt = fabric.setup(model, make_optimizer(model, "adamw"))
    dtypes = {p.dtype for p in model.parameters()}
    reductions: list[int] = []
    losses = _train(fabric, model, opt, rank, STEPS, reductions=reductions, **loop)
    out = {"losses": losses, "params": _params(fabric, model), "dtypes": dtypes, "reductions": reductions}
    if isinstance(fabric.strategy, ZeroFabricStrategy):
        out["loss_scale"] = fabric.strategy.precision.loss_scale
        act = fabric.strategy.engine.activations
        out["checkpointed"] = len(act.checkpointed) if act is not None else 0
        out["offloaded_bytes"] = act.offloaded_bytes if act is not None else 0
        fabric.strategy.teardown()
    return out


def _parity_job(rank, world_size):
    ddp = lambda: DDPStrategy(find_unused_parameters=True)  # noqa: E731
    loops = {"accum_clip": dict(accum=2, clip=0.05), "clip_val": dict(clip_val=0.02)}
    out = {}
    for what, loop in loops.items():
        out[what, "ddp"] = _run(ddp(), rank, **loop)
        stages = {n: n for n in PRESETS} if what == "accum_clip" else {"zero2": "zero2"}
        if what == "accum_clip":
            stages["zero0"] = ZeroFabricStrategy(stage=0)
        for name, strategy in stages.items():  # registered names (zero1 ... zero3_offload) and an instance
            out[what, name] = _run(strategy, rank, **loop)
    out["accum_clip", "zero3 separate"] = _run(ZeroFabricStrategy(stage=3), rank, build="separate",
                                               **loops["accum_clip"])
    # activation checkpointing + offload through the Fabric strategy's kwargs: the same numbers
    out["accum_clip", "zero3 ckpt+offload"] = _run(
        ZeroFabricStrategy(stage=3, activation_checkpointing=["Linear"], offload_activations=True), rank,
        **loops["accum_clip"])
    # the stage-2 publish overlapped with the next forward: still exact
    out["accum_clip", "zero2 overlap"] = _run(ZeroFabricStrategy(stage=2, overlap_publish=True), rank,
                                              **loops["accum_clip"])
    out["quantized"] = _run(ZeroFabricStrategy(stage=3, quantize_weights=True, quantize_grads=True), rank,
                            **loops["accum_clip"])
    out["meta", "ddp"] = _run(ddp(), rank, net=_meta_net, **loops["accum_clip"])
    for build in ("meta", "meta_separate"):
        out["meta", f"zero3 {build}"] = _run(ZeroFabricStrategy(stage=3), rank, build=build, net=_meta_net,
                                             **loops["accum_clip"])
    out["bf16"] = _run("zero2", rank, precision="bf16-mixed", **loops["accum_clip"])
    fp16 = ZeroFabricPrecision("16-mixed", initial_scale_power=8)  # on CPU Fabric's "16-mixed" flag means bf16
    out["fp16"] = _run(ZeroFabricStrategy(stage=3), rank, plugins=[fp16], **loops["accum_clip"])
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the *_offload_nvme presets' nvme_path, inherited by the ranks
        mp.setenv("LIGHTNING_ZERO_NVME_PATH", str(tmp_path_factory.mktemp("nvme")))
        return run_distributed(_parity_job, 2)


@pytest.mark.timeout(240)
def test_every_stage_equals_fabric_ddp(parity):
    """zero0 ... zero3_offload, zero2/3_offload_nvme (names and an instance), setup_module + setup_optimizers, and a stage-3 model
    built on meta: the same per-micro-batch losses and final weights as Fabric DDP, with gradient
    accumulation (no_backward_sync) and clipping by norm (and by value)."""
    keys = [k for k in parity[0] if isinstance(k, tuple) and k[1] != "ddp"]
    assert len(keys) == len(PRESETS) + 6
    for rank, res in enumerate(parity):
        for what, name in keys:
            ref = res[what, "ddp"]
            _close(res[what, name]["losses"], ref["losses"], f"rank {rank} {what} {name} losses")
            assert set(res[what, name]["params"]) == set(ref["params"])
            for k, v in ref["params"].items():
                _close(res[what, name]["params"][k], v, f"rank {rank} {what} {name} {k}")
        # no_backward_sync: stages 0-1 reduce nothing before the boundary; stage 2+ reduces every micro-batch
        # into its gradient shard (as DeepSpeed does)
        for name in ("zero0", "zero1", "zero1_offload"):
            assert res["accum_clip", name]["reductions"] == [0] * STEPS, name
        ckpt = res["accum_clip", "zero3 ckpt+offload"]
        assert ckpt["checkpointed"] >= 2 and ckpt["offloaded_bytes"] > 0  # the options were in force
        assert all(n > 0 for n in res["accum_clip", "zero2"]["reductions"])
        for what, net in (("accum_clip", make_model), ("meta", _meta_net)):  # it trained
            assert not torch.equal(res[what, "ddp"]["params"]["fc1.weight"], net().fc1.weight.detach())
    # the clipping was active: without it the run ends elsewhere
    with_clip, without = parity[0]["accum_clip", "ddp"]["params"], parity[0]["clip_val", "ddp"]["params"]
    assert not torch.allclose(with_clip["fc1.weight"], without["fc1.weight"])


@pytest.mark.timeout(240)
def test_mixed_precision_true_low_precision_module(parity):
    """bf16-mixed / 16-mixed: the module itself in bf16 / fp16 (fp32 masters in the optimizer), fp16 with
    a growing loss scale; losses within bf16 tolerance of fp32 Fabric DDP."""
    for res in parity:
        ref = torch.tensor(res["accum_clip", "ddp"]["losses"])
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            assert res[key]["dtypes"] == {dtype}
            rel = ((torch.tensor(res[key]["losses"]) - ref).abs() / ref.abs()).max().item()
            assert rel < 2e-2, f"{key}: max relative loss gap {rel:.4f} to fp32 DDP"
        assert res["bf16"]["loss_scale"] == 1.0 and res["fp16"]["loss_scale"] == 2.0**8


@pytest.mark.timeout(240)
def test_quantized_collectives_through_the_fabric_strategy(parity):
    """ZeroFabricStrategy(quantize_weights=True, quantize_grads=True): int8 gathers and reductions are in
    force (the losses move off DDP's) and stay within int8's error of Fabric DDP."""
    for res in parity:
        ref = torch.tensor(res["accum_clip", "ddp"]["losses"])
        got = torch.tensor(res["quantized"]["losses"])
        rel = ((got - ref).abs() / ref.abs()).max().item()
        assert 0 < rel < 1e-2, f"quantized: max relative loss gap {rel:.2e} to fp32 DDP"


# -- checkpoints ---------------------------------------------------------------------------------------------
class Lit(pl.LightningModule):
    """ParityNet as ``self.net``: the same parameter names under Fabric and the Trainer. Under the Trainer
    step ``offset + global_step`` trains on ``batch(step, rank)``, the batches of the Fabric loop."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.net, self.offset, self.losses = make_model(), offset, []

    def forward(self, tokens, use_sometimes=False):
        return self.net(tokens, use_sometimes)

    def training_step(self, _batch, _idx):
        loss = loss_fn(self.net, batch(self.offset + self.global_step, self.global_rank), False)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        return DataLoader(TokenDataset(64), batch_size=4)

    def configure_optimizers(self):
        return make_optimizer(self.net, "adamw")


class Counter:
    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _setup_lit(strategy, offset=0):
    fabric = _fabric(strategy)
    model = Lit(offset)
    model, opt = fabric.setup(model, make_optimizer(model.net, "adamw"))
    return fabric, model, opt


def _trainer(strategy, steps):
    return Trainer(strategy=strategy, **trainer_kwargs(devices=torch.distributed.get_world_size(), max_steps=steps))


def _trainer_params(trainer):
    return {k: v.detach().clone().float() for k, v in trainer.lightning_module.state_dict().items()}


def _checkpoint_job(rank, world_size, root):
    out = {}
    fabric, model, opt = _setup_lit("zero2")
    counter = Counter(7)
    out["before"] = _train(fabric, model, opt, rank, 2, sometimes=False)
    out["at save"] = _params(fabric, model)
    fabric.save(os.path.join(root, "fabric.ckpt"), {"model": model, "optimizer": opt, "step": 2, "counter": counter})
    full = fabric.load(os.path.join(root, "fabric.ckpt"))  # no state: everything, consolidated, as saved
    out["full"] = {k: (v if k != "optimizer" else sorted(v["state"])) for k, v in full.items()}
    out["after"] = _train(fabric, model, opt, rank, 2, start=2, sometimes=False)
    out["uninterrupted"] = _params(fabric, model)
    fabric.strategy.teardown()

    # resume under Fabric at another stage: the same continuation, the other entries restored
    fabric, model, opt = _setup_lit(ZeroFabricStrategy(stage=3))
    state = {"model": model, "optimizer": opt, "step": 0, "counter": Counter()}
    out["remainder"] = fabric.load(os.path.join(root, "fabric.ckpt"), state)
    out["restored"] = (state["step"], state["counter"].n)
    out["resumed"] = _train(fabric, model, opt, rank, 2, start=state["step"], sometimes=False)
    out["resumed params"] = _params(fabric, model)
    fabric.strategy.teardown()

    # a single file from Fabric's own DDP loads into the engine (stage 3)
    fabric, model, opt = _setup_lit(DDPStrategy(find_unused_parameters=True))
    _train(fabric, model, opt, rank, 2, sometimes=False)
    fabric.save(os.path.join(root, "ddp.ckpt"), {"model": model, "optimizer": opt, "step": 2})
    fabric, model, opt = _setup_lit(ZeroFabricStrategy(stage=3))
    state = {"model": model, "optimizer": opt, "step": 0}
    out["ddp remainder"] = fabric.load(os.path.join(root, "ddp.ckpt"), state)
    out["from ddp"] = _train(fabric, model, opt, rank, 2, start=state["step"], sometimes=False)
    out["from ddp params"] = _params(fabric, model)
    fabric.strategy.teardown()

    # the Fabric checkpoint resumes under the Trainer (stage 1)
    lit = Lit(offset=2)
    trainer = _trainer(ZeroStrategy(stage=1), 2)
    trainer.fit(lit, ckpt_path=os.path.join(root, "fabric.ckpt"))
    out["trainer resumed"], out["trainer params"] = lit.losses, _trainer_params(trainer)

    # a Trainer checkpoint (stage 3) resumes under Fabric (stage 2)
    lit = Lit()
    trainer = _trainer(ZeroStrategy(stage=3), 2)
    trainer.fit(lit)
    trainer.save_checkpoint(os.path.join(root, "trainer.ckpt"))
    out["trainer before"] = lit.losses
    fabric, model, opt = _setup_lit("zero2")
    out["trainer remainder"] = fabric.load(os.path.join(root, "trainer.ckpt"), {"model": model, "optimizer": opt})
    out["from trainer"] = _train(fabric, model, opt, rank, 2, start=2, sometimes=False)
    out["from trainer params"] = _params(fabric, model)
    fabric.strategy.teardown()
    return out


def _reshard_job(rank, world_size, root):
    """One rank, stage 3, resuming the 2-rank stage-2 checkpoint: both ranks' batches in one (equal sizes:
    the mean of the two losses is DDP's averaged gradient)."""
    fabric, model, opt = _setup_lit(ZeroFabricStrategy(stage=3))
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(os.path.join(root, "fabric.ckpt"), state, strict=False)
    losses = []
    for step in range(state["step"], state["step"] + 2):
        per_rank = [loss_fn(model, batch(step, r), False) for r in range(2)]
        fabric.backward((per_rank[0] + per_rank[1]) / 2)
        losses.append([x.item() for x in per_rank])
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": _params(fabric, model)}


@pytest.mark.timeout(300)
def test_save_load_resume_reshard_and_trainer_interop(tmp_path):
    """fabric.save / fabric.load write and read the Trainer's sharded directories: a resume continues
    exactly as the uninterrupted run, at another stage (2 -> 3) and world size (2 ranks -> 1), under the
    Trainer (Fabric -> Trainer) and back (Trainer -> Fabric)."""
    res = run_distributed(_checkpoint_job, 2, str(tmp_path))
    for rank, r in enumerate(res):
        assert r["restored"] == (2, 7)
        assert r["remainder"] == {} and r["ddp remainder"] == {}  # every entry went back into the state
        assert sorted(r["full"]) == ["counter", "model", "optimizer", "step"]
        assert r["full"]["step"] == 2 and r["full"]["counter"] == {"n": 7} and r["full"]["optimizer"]
        for k, v in r["at save"].items():
            torch.testing.assert_close(r["full"]["model"][k], v, rtol=0, atol=0, msg=k)
        _close(r["from ddp"], r["after"], f"rank {rank} Fabric DDP file -> ZeRO-3 losses")
        _close(r["resumed"], r["after"], f"rank {rank} Fabric resume losses")
        _close(r["trainer resumed"], r["after"], f"rank {rank} Fabric -> Trainer losses")
        _close(r["trainer before"], r["before"], f"rank {rank} Trainer losses")
        _close(r["from trainer"], r["after"], f"rank {rank} Trainer -> Fabric losses")
        assert r["trainer remainder"]["global_step"] == 2 and "loops" in r["trainer remainder"]
        for k, v in r["uninterrupted"].items():
            _close(r["resumed params"][k], v, f"rank {rank} Fabric resume {k}")
            _close(r["from trainer params"][k], v, f"rank {rank} Trainer -> Fabric {k}")
            _close(r["from ddp params"][k], v, f"rank {rank} Fabric DDP file -> ZeRO-3 {k}")
            _close(r["trainer params"][k], v, f"rank {rank} Fabric -> Trainer {k}")
    one = run_distributed(_reshard_job, 1, str(tmp_path))[0]
    for rank in range(2):
        _close([pair[rank] for pair in one["losses"]], res[rank]["after"], f"1-rank reshard losses of rank {rank}")
    for k, v in res[0]["uninterrupted"].items():
        _close(one["params"][k], v, f"1-rank reshard {k}")


# -- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_bad_input_names_what_is_allowed(tmp_path):
    for precision in ("bf16-true", "16-true", "64-true"):
        with pytest.raises(ValueError, match=rf"precision={precision!r}.*Allowed: precision='32-true', '16-mixed'"):
            Fabric(strategy="zero2", accelerator="cpu", devices=1, precision=precision)
    with pytest.raises(TypeError, match="unknown argument.*find_unused_parameters. Allowed: stage, offload_optimizer"):
        ZeroFabricStrategy(stage=2, find_unused_parameters=True)
    with pytest.raises(ValueError, match="Unknown start_method 'thread'. Allowed: popen, spawn, fork"):
        ZeroFabricStrategy(start_method="thread")
    with pytest.raises(ValueError, match="Unknown ZeRO stage 4"):
        ZeroFabricStrategy(stage=4)

    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2), accelerator="cpu", devices=1)
    fabric.launch()
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model, "sgd"))
    with pytest.raises(ValueError, match="already set up with its optimizer.*Allowed: one fabric.setup"):
        fabric.setup(model.module, make_optimizer(model.module, "sgd"))
    fabric.backward(loss_fn(model, batch(0, 0), False))
    with pytest.raises(ValueError, match="norm_type=1.*Allowed: norm_type=2"):
        fabric.clip_gradients(model, opt, max_norm=1.0, norm_type=1)
    with pytest.raises(ValueError, match="filter=.*not supported"):
        fabric.save(tmp_path / "x.ckpt", {"model": model}, filter={"model": lambda k, v: True})
    with pytest.raises(ValueError, match="needs the model in the state"):
        fabric.save(tmp_path / "x.ckpt", {"optimizer": opt})
    fabric.save(tmp_path / "w.ckpt", {"model": model})  # weights only: the optimizer cannot come back strictly
    with pytest.raises(KeyError, match="holds no state for optimizer 0"):
        fabric.load(tmp_path / "w.ckpt", {"model": model, "optimizer": opt})
    with pytest.raises(KeyError, match="'step' that does not exist"):
        fabric.load(tmp_path / "w.ckpt", {"model": model, "step": 0})
    fabric.strategy.teardown()


@pytest.mark.timeout(120)
def test_zero_grad_goes_through_the_engine():
    """``optimizer.zero_grad()`` on Fabric's wrapper clears the engine's gradient shards: a discarded
    backward leaves nothing for the next step (torch's zero_grad would clear only the masters' .grad)."""
    fabric = Fabric(strategy="zero2", accelerator="cpu", devices=1)
    fabric.launch()
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model, "sgd"))
    before = _params(fabric, model)
    fabric.backward(loss_fn(model, batch(0, 0), False))
    opt.zero_grad()
    opt.step()  # no gradient left: SGD leaves every parameter as it was
    for k, v in _params(fabric, model).items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    assert lightning_zero.ZeroFabricStrategy is ZeroFabricStrategy
    fabric.strategy.teardown()


@pytest.mark.timeout(120)
def test_loss_scale_survives_save_and_load(tmp_path):
    """fp16: the dynamic loss scale and the skipped-step count come back with the checkpoint (the Trainer's
    precision key, so a Trainer resume restores them too)."""
    plugin = lambda: ZeroFabricPrecision("16-mixed", initial_scale_power=4, loss_scale_window=1)  # noqa: E731
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2), accelerator="cpu", devices=1, plugins=[plugin()])
    fabric.launch()
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model, "adamw"))
    _train(fabric, model, opt, 0, 3, sometimes=False)
    saved = fabric.strategy.precision.state_dict()
    assert saved["loss_scaler"]["scale"] > 2.0**4  # it grew, so a fresh scaler would differ
    fabric.save(tmp_path / "fp16.ckpt", {"model": model, "optimizer": opt})
    fabric.strategy.teardown()

    fabric = Fabric(strategy=ZeroFabricStrategy(stage=3), accelerator="cpu", devices=1, plugins=[plugin()])
    fabric.launch()
    model = make_model()
    model, opt = fabric.setup(model, make_optimizer(model, "adamw"))
    assert fabric.load(tmp_path / "fp16.ckpt", {"model": model, "optimizer": opt}) == {}
    assert fabric.strategy.precision.state_dict() == saved
    fabric.strategy.teardown()
