"""Several models under one ZeroFabricStrategy: a GAN, a student with its frozen teacher, their checkpoints.

Each model set up gets its own engine; the references are Fabric's own DDP (``Fabric(strategy="ddp")``)
running the same loops from the same seeds on forked gloo ranks (``tests/helpers/dist_utils.run_distributed``,
one job per topic holding the reference and every ZeRO variant).
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import nn

from lightning_zero import ZeroFabricPrecision, ZeroFabricStrategy
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.engine.config import PRESETS
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lightning_models import uses_sometimes
from tests.helpers.models import VOCAB, batch, make_model, make_optimizer
from tests.helpers.parity import close as _close

ITERS = 3
Z, X, HID = 5, 7, 12


class Generator(nn.Module):
    """DCGAN's shape in small: Linear (no bias before BatchNorm, as DCGAN's: its gradient would be rounding
    noise, which Adam scales up), BatchNorm (running stats: buffers that DDP broadcasts), ReLU, Linear."""

    def __init__(self, bn: bool = True) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(HID) if bn else nn.Identity()
        self.net = nn.Sequential(nn.Linear(Z, HID, bias=not bn), norm, nn.ReLU(), nn.Linear(HID, X))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(X, HID), nn.LeakyReLU(0.2), nn.Linear(HID, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def make_gan(bn: bool = True) -> tuple[Generator, Discriminator]:
    torch.manual_seed(0)
    return Generator(bn), Discriminator()


def gan_batch(it: int, ranks, part=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(real, noise) of iteration ``it`` for ``ranks`` (one rank's, or several ranks' concatenated);
    ``part=(i, n)``: the i-th of n equal pieces of it (a resharded resume on more ranks)."""
    ranks = [ranks] if isinstance(ranks, int) else ranks
    g = [torch.Generator().manual_seed(100 * it + r) for r in ranks]
    real = torch.cat([torch.randn(6, X, generator=gi) * 0.5 + 1.0 for gi in g])
    noise = torch.cat([torch.randn(6, Z, generator=gi) for gi in g])
    if part is not None:
        real, noise = real.chunk(part[1])[part[0]], noise.chunk(part[1])[part[0]]
    return real, noise


def _fabric(strategy, precision="32-true") -> Fabric:
    """``precision``: a flag, or a precision plugin (``ZeroFabricPrecision("16-mixed", ...)``)."""
    plugin = not isinstance(precision, str)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size(),
                    precision=None if plugin else precision, plugins=[precision] if plugin else None)
    fabric.launch()
    return fabric


def _state(fabric, *models) -> dict[str, torch.Tensor]:
    """Every model's state dict (parameters and buffers), whole, under "<i>.<name>"."""
    gathered = getattr(fabric.strategy, "gathered_params", None)  # stage 3: whole only in there
    with gathered() if gathered is not None else contextlib.nullcontext():
        return {f"{i}.{k}": v.detach().clone().float() for i, m in enumerate(models)
                for k, v in m.state_dict().items()}


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.02, betas=(0.5, 0.999))


# -- the GAN loop, as DCGAN's example writes it ------------------------------------------------------------------
def gan_loop(fabric, g, d, opt_g, opt_d, rank, iters, start=0, zero_grad="module", ranks=None, part=None):
    """D on real then on detached fakes (the first backward under no_backward_sync, accumulated), clipped,
    stepped; G through D (its backward also fills D's gradients, dropped by D's zero_grad next time).
    ``zero_grad``: "module" (``d.zero_grad()``, DCGAN's), "optimizer" (``opt_d.zero_grad()``) or "frozen d"
    (module zero_grad, and D's parameters frozen for G's step, as CycleGAN's ``set_requires_grad(D, False)``:
    D's engine is in that backward without a gradient). ``ranks``, ``part``: the batch of a resharded
    resume (:func:`gan_batch`)."""
    bce = nn.functional.binary_cross_entropy_with_logits
    losses = []
    for it in range(start, start + iters):
        real, noise = gan_batch(it, rank if ranks is None else ranks, part)
        (opt_d if zero_grad == "optimizer" else d).zero_grad()
        with fabric.no_backward_sync(d):
            out = d(real)
            err_real = bce(out, torch.ones_like(out))
            fabric.backward(err_real)
        fake = g(noise)
        out = d(fake.detach())
        err_fake = bce(out, torch.zeros_like(out))
        fabric.backward(err_fake)
        fabric.clip_gradients(d, opt_d, max_norm=0.5)
        opt_d.step()
        (opt_g if zero_grad == "optimizer" else g).zero_grad()
        d.requires_grad_(zero_grad != "frozen d")
        out = d(fake)
        err_g = bce(out, torch.ones_like(out))
        fabric.backward(err_g)
        opt_g.step()
        d.requires_grad_(True)
        losses += [err_real.item(), err_fake.item(), err_g.item()]
    return losses


def _gan_run(strategy, rank, zero_grad="module", build="setup", precision="32-true"):
    fabric = _fabric(strategy, precision)
    g, d = make_gan()
    if build == "setup":
        g, opt_g = fabric.setup(g, _adam(g))
        d, opt_d = fabric.setup(d, _adam(d))
    else:  # setup_module for both, then each optimizer over its set-up model, in one setup_optimizers call
        g, d = fabric.setup_module(g), fabric.setup_module(d)
        opt_g, opt_d = fabric.setup_optimizers(_adam(g), _adam(d))
    dtypes = {p.dtype for m in (g, d) for p in m.parameters()}
    losses = gan_loop(fabric, g, d, opt_g, opt_d, rank, ITERS, zero_grad=zero_grad)
    out = {"losses": losses, "state": _state(fabric, g, d), "dtypes": dtypes}
    if isinstance(fabric.strategy, ZeroFabricStrategy):
        engines = [fabric.strategy.engine_of(m) for m in (g, d)]
        out["engines"] = len({id(e) for e in engines}), [e.config.stage for e in engines]
        out["loss scale"] = fabric.strategy.precision.loss_scale
        fabric.strategy.teardown()
        out["after teardown"] = _state(fabric, g, d)  # both handed back whole (stage 3), fp32
    return out


def _gan_job(rank, world_size):
    out = {("ddp", z): _gan_run("ddp", rank, zero_grad=z) for z in ("module", "optimizer", "frozen d")}
    for name in PRESETS:
        out[name, "module"] = _gan_run(name, rank)
    for name in ("zero2", "zero3"):
        out[name, "optimizer"] = _gan_run(name, rank, zero_grad="optimizer")
    for name in ("zero1", "zero3", "zero3_offload"):
        out[name, "frozen d"] = _gan_run(name, rank, zero_grad="frozen d")
    out["zero3 separate", "module"] = _gan_run(ZeroFabricStrategy(stage=3), rank, build="separate")
    out["bf16"] = _gan_run("zero3", rank, precision="bf16-mixed")  # each module's own input casts
    # fp16: one dynamic loss scaler for both engines, updated at every optimizer.step() (Fabric's GradScaler)
    out["fp16"] = _gan_run("zero2", rank, precision=ZeroFabricPrecision("16-mixed", initial_scale_power=8,
                                                                        loss_scale_window=2))
    return out


@pytest.mark.timeout(300)
def test_gan_two_models_equal_fabric_ddp():
    """A generator and a discriminator, each fabric.setup with its own Adam (and both via setup_module +
    setup_optimizers): at every stage 0-3 (+offload) the per-iteration losses and final weights and
    BatchNorm statistics equal Fabric DDP's, with ``d.zero_grad()`` (module), ``opt_d.zero_grad()`` and D
    frozen for G's step, D's gradients accumulated under no_backward_sync(d) and clipped, and G's loss
    through D; teardown hands both back whole."""
    res = run_distributed(_gan_job, 2)
    zero = [k for k in res[0] if k[0] != "ddp" and k not in ("bf16", "fp16")]
    assert len(zero) == len(PRESETS) + 6
    for rank, r in enumerate(res):
        for key in zero:
            ref = r["ddp", key[1]]
            assert r[key]["engines"][0] == 2, key  # one engine per model
            _close(r[key]["losses"], ref["losses"], f"rank {rank} {key} losses")
            assert set(r[key]["state"]) == set(ref["state"])
            for k, v in ref["state"].items():
                _close(r[key]["state"][k], v, f"rank {rank} {key} {k}")
                torch.testing.assert_close(r[key]["after teardown"][k], r[key]["state"][k], rtol=0, atol=0)
        ref = torch.tensor(r["ddp", "module"]["losses"])
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            assert r[key]["dtypes"] == {dtype}  # both modules themselves in half precision, fp32 masters
            rel = ((torch.tensor(r[key]["losses"]) - ref).abs() / ref.abs()).max().item()
            assert rel < 3e-2, f"{key}: max relative loss gap {rel:.4f} to fp32 DDP"
        # 2 steps per iteration, the scale doubling every 2 steps without overflow: 2**8 * 2**ITERS
        assert r["fp16"]["loss scale"] == 2.0 ** (8 + ITERS)
        # it trained, and the two zero_grad patterns are the same loop
        assert not torch.allclose(r["ddp", "module"]["state"]["1.net.0.weight"], make_gan()[1].net[0].weight)
        _close(r["ddp", "optimizer"]["losses"], r["ddp", "module"]["losses"], "ddp zero_grad patterns")
        # freezing D for G's step changes nothing either (D's gradients from it were dropped anyway)
        _close(r["ddp", "frozen d"]["losses"], r["ddp", "module"]["losses"], "ddp frozen d")


# -- a student distilled from a frozen teacher set up without an optimizer ------------------------------------
def _distill_run(strategy, rank, build="setup"):
    fabric = _fabric(strategy)
    teacher = make_model(seed=1).requires_grad_(False).eval()
    original = {k: v.clone() for k, v in teacher.state_dict().items()}
    if not isinstance(fabric.strategy, ZeroFabricStrategy):
        teacher = teacher.to(fabric.device)  # DDP refuses a model without trainable parameters
    else:
        teacher = fabric.setup(teacher)  # no optimizer: an evaluation engine (stage 3 partitions it)
    student = make_model(seed=0)
    if build == "setup":
        student, opt = fabric.setup(student, make_optimizer(student, "adamw"))
    else:
        student = fabric.setup_module(student)
        opt = fabric.setup_optimizers(make_optimizer(student, "adamw"))
    losses = []
    for step in range(ITERS):
        tokens = batch(step, rank)
        with torch.no_grad():
            target = torch.softmax(teacher(tokens[:, :-1]), -1)
        logits = student(tokens[:, :-1], uses_sometimes(rank, step)).reshape(-1, VOCAB)
        loss = (nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
                + nn.functional.cross_entropy(logits, target.reshape(-1, VOCAB)))  # the data + the teacher
        fabric.backward(loss)
        fabric.clip_gradients(student, opt, max_norm=0.1)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "student": _state(fabric, student)}
    if isinstance(fabric.strategy, ZeroFabricStrategy):
        engine = fabric.strategy.engine_of(teacher)
        out["teacher partitioned"] = engine is not None and engine.partitions_params
        out["teacher local numel"] = sum(p.untyped_storage().nbytes() // p.element_size() for p in teacher.parameters())
        fabric.strategy.teardown()  # hands the teacher back whole
    out["teacher unchanged"] = all(torch.equal(v, original[k]) for k, v in teacher.state_dict().items())
    return out


def _gpt2_distill_run(strategy, rank):
    """HF GPT-2 (built from configs): a 32-wide frozen teacher set up without an optimizer, a 16-wide student."""
    from tests.helpers import zoo_models as Z

    fabric = _fabric(strategy)
    torch.manual_seed(1)
    teacher = Z.gpt2(width=32).requires_grad_(False).eval()
    teacher = fabric.setup(teacher) if isinstance(fabric.strategy, ZeroFabricStrategy) else teacher
    torch.manual_seed(0)
    student = Z.gpt2(width=16)
    student, opt = fabric.setup(student, torch.optim.AdamW(student.parameters(), lr=0.01))
    losses = []
    for step in range(ITERS):
        ids = Z._tokens(step, rank)
        with torch.no_grad():
            target = torch.softmax(teacher(input_ids=ids).logits, -1)
        out = student(input_ids=ids, labels=ids)
        loss = out.loss + nn.functional.cross_entropy(out.logits.reshape(-1, Z.VOCAB), target.reshape(-1, Z.VOCAB))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "student": _state(fabric, student)}
    if isinstance(fabric.strategy, ZeroFabricStrategy):
        fabric.strategy.teardown()
    return out


def _distill_job(rank, world_size):
    out = {"ddp": _distill_run(DDPStrategy(find_unused_parameters=True), rank)}  # ParityNet has unused ones
    for stage in range(4):
        out[f"zero{stage}"] = _distill_run(ZeroFabricStrategy(stage=stage), rank)
    out["zero3 separate"] = _distill_run(ZeroFabricStrategy(stage=3), rank, build="separate")
    out["zero3_offload"] = _distill_run("zero3_offload", rank)
    out["gpt2"] = {name: _gpt2_distill_run(name, rank) for name in ("ddp", "zero2", "zero3")}
    return out


@pytest.mark.timeout(300)
def test_student_with_frozen_teacher_set_up_without_optimizer():
    """fabric.setup(teacher) (no optimizer, frozen) beside fabric.setup(student, opt): the student's losses
    and weights equal Fabric DDP's (whose teacher is a plain module: DDP refuses one without trainable
    parameters) at stages 0-3, also for HF GPT-2 teacher and student; at stage 3 the teacher is
    partitioned, and teardown hands it back unchanged."""
    res = run_distributed(_distill_job, 2)
    whole = sum(p.numel() for p in make_model(seed=1).parameters())
    for rank, r in enumerate(res):
        gpt2 = r.pop("gpt2")
        for name in ("zero2", "zero3"):
            _close(gpt2[name]["losses"], gpt2["ddp"]["losses"], f"rank {rank} gpt2 {name} losses")
            for k, v in gpt2["ddp"]["student"].items():
                _close(gpt2[name]["student"][k], v, f"rank {rank} gpt2 {name} {k}")
        ref = r["ddp"]
        for key in [k for k in r if k != "ddp"]:
            _close(r[key]["losses"], ref["losses"], f"rank {rank} {key} losses")
            for k, v in ref["student"].items():
                _close(r[key]["student"][k], v, f"rank {rank} {key} {k}")
            assert r[key]["teacher unchanged"], key
            partitioned = key.startswith("zero3")
            assert r[key]["teacher partitioned"] == partitioned, key
            assert (r[key]["teacher local numel"] < whole) == partitioned, key
        assert not torch.allclose(ref["student"]["0.fc1.weight"], make_model(seed=0).fc1.weight)


def _critic_run(strategy, rank):
    """G trained through a frozen critic set up without an optimizer (a reward model, a perceptual loss):
    the loss flows through the critic's units in every backward, none of its parameters gets a gradient."""
    fabric = _fabric(strategy)
    g, critic = make_gan(bn=False)
    critic.requires_grad_(False)
    if isinstance(fabric.strategy, ZeroFabricStrategy):
        critic = fabric.setup(critic)
    g, opt = fabric.setup(g, _adam(g))
    losses, held = [], []
    for it in range(ITERS):
        _, noise = gan_batch(it, rank)
        loss = -critic(g(noise)).mean()
        fabric.backward(loss)
        engine = fabric.strategy.engine_of(critic) if isinstance(fabric.strategy, ZeroFabricStrategy) else None
        if engine is not None and engine.partitions_params:
            held.append(engine.partitioner.gathered_bytes())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "g": _state(fabric, g), "held after backward": held}
    if isinstance(fabric.strategy, ZeroFabricStrategy):
        engine = fabric.strategy.engine_of(critic)
        # each backward's end seen: the unit order recorded once (it would grow at every forward otherwise)
        out["critic order"] = engine.partitioner.order_state.name if engine is not None else None
        fabric.strategy.teardown()
    return out


def _critic_job(rank, world_size):
    out = {"ddp": _critic_run("ddp", rank)}
    for name in ("zero1", "zero3"):
        out[name] = _critic_run(name, rank)
    return out


@pytest.mark.timeout(300)
def test_generator_through_frozen_critic_without_optimizer():
    """The loss of G goes through a frozen critic set up without an optimizer: G equals Fabric DDP's
    (a plain critic there), and at stage 3 the critic's units gathered for each backward are released at
    its end (no gradient of the critic's engine fires to end it)."""
    res = run_distributed(_critic_job, 2)
    for rank, r in enumerate(res):
        for key in ("zero1", "zero3"):
            _close(r[key]["losses"], r["ddp"]["losses"], f"rank {rank} {key} losses")
            for k, v in r["ddp"]["g"].items():
                _close(r[key]["g"][k], v, f"rank {rank} {key} {k}")
        assert r["zero3"]["held after backward"] == [0] * ITERS
        assert r["zero3"]["critic order"] == "RECORDED" and r["zero1"]["critic order"] is None


# -- save both, load into fresh models, continue -----------------------------------------------------------------
SAVE_AT = 2


def _setup_gan(strategy):
    fabric = _fabric(strategy)
    g, d = make_gan(bn=False)  # no BatchNorm: one rank on two ranks' batches is then the same step
    g, opt_g = fabric.setup(g, _adam(g))
    d, opt_d = fabric.setup(d, _adam(d))
    return fabric, g, d, opt_g, opt_d


def _gan_ckpt_job(rank, world_size, root):
    out = {}
    ckpt = os.path.join(root, "gan.ckpt")
    fabric, g, d, opt_g, opt_d = _setup_gan("zero2")
    gan_loop(fabric, g, d, opt_g, opt_d, rank, SAVE_AT)
    out["at save"] = _state(fabric, g, d)
    fabric.save(ckpt, {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": SAVE_AT})
    full = fabric.load(ckpt)  # no state: every model's full weights and optimizers, under the saved keys
    out["full"] = {k: (v if k in ("g", "d", "step") else sorted(v["state"])) for k, v in full.items()}
    out["after"] = gan_loop(fabric, g, d, opt_g, opt_d, rank, 2, start=SAVE_AT)
    out["uninterrupted"] = _state(fabric, g, d)
    fabric.strategy.teardown()

    # fresh models at another stage, loaded together, continue as the uninterrupted run
    fabric, g, d, opt_g, opt_d = _setup_gan(ZeroFabricStrategy(stage=3))
    state = {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": 0}
    out["remainder"] = fabric.load(ckpt, state)
    out["resumed"] = gan_loop(fabric, g, d, opt_g, opt_d, rank, 2, start=state["step"])
    out["resumed state"] = _state(fabric, g, d)
    fabric.strategy.teardown()

    # a student with its teacher set up without an optimizer (stage 3: an evaluation engine's unit shards;
    # stage 2: no engine, whole tensors), saved together and loaded into fresh ones at the other stage
    for save_stage, load_stage in ((3, 2), (2, 3)):
        path = os.path.join(root, f"distill{save_stage}.ckpt")
        fabric = _fabric(ZeroFabricStrategy(stage=save_stage))
        teacher = fabric.setup(make_model(seed=1).requires_grad_(False))
        student = make_model(seed=0)
        student, opt = fabric.setup(student, make_optimizer(student, "adamw"))
        fabric.backward(nn.functional.cross_entropy(student(batch(0, rank)[:, :-1]).reshape(-1, VOCAB),
                                                    batch(0, rank)[:, 1:].reshape(-1)))
        opt.step()
        saved = _state(fabric, student, teacher)
        fabric.save(path, {"student": student, "teacher": teacher, "opt": opt})
        fabric.strategy.teardown()
        fabric = _fabric(ZeroFabricStrategy(stage=load_stage))
        teacher = fabric.setup(make_model(seed=2).requires_grad_(False))
        student = make_model(seed=3)
        student, opt = fabric.setup(student, make_optimizer(student, "adamw"))
        fabric.load(path, {"student": student, "teacher": teacher, "opt": opt})
        out[f"distill {save_stage}->{load_stage}"] = saved, _state(fabric, student, teacher)
        fabric.strategy.teardown()
    return out


def _gan_reshard_job(rank, world_size, root):
    """The 2-rank stage-2 checkpoint resumed on one rank (stage 1: both ranks' batches at once) or on four
    (stage 3: each 2-rank batch split in two; the mean of the four losses is the same average)."""
    fabric, g, d, opt_g, opt_d = _setup_gan(ZeroFabricStrategy(stage=1 if world_size == 1 else 3))
    state = {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": 0}
    fabric.load(os.path.join(root, "gan.ckpt"), state)
    where = dict(ranks=[0, 1]) if world_size == 1 else dict(ranks=rank // 2, part=(rank % 2, 2))
    gan_loop(fabric, g, d, opt_g, opt_d, rank, 2, start=state["step"], **where)
    out = {"state": _state(fabric, g, d)}
    fabric.strategy.teardown()
    return out


@pytest.mark.timeout(300)
def test_save_both_models_load_into_fresh_ones_and_continue(tmp_path):
    """fabric.save(path, {"g", "d", "opt_g", "opt_d", "step"}) writes one directory holding each model's
    sharded checkpoint; fabric.load into fresh models (stage 2 -> 3; 2 ranks -> 1 at stage 1 and -> 4 at
    stage 3) continues exactly as the uninterrupted run; each model's directory consolidates on its own;
    a teacher (with or without an engine) is saved and loaded beside its student."""
    res = run_distributed(_gan_ckpt_job, 2, str(tmp_path))
    ckpt = tmp_path / "gan.ckpt"
    assert sorted(os.listdir(ckpt / "models")) == ["d", "g"]
    for rank, r in enumerate(res):
        assert r["remainder"] == {}
        assert sorted(r["full"]) == ["d", "g", "opt_d", "opt_g", "step"] and r["full"]["step"] == SAVE_AT
        assert r["full"]["opt_g"] and r["full"]["opt_d"]
        for i, key in enumerate(("g", "d")):
            for k, v in r["full"][key].items():
                torch.testing.assert_close(v, r["at save"][f"{i}.{k}"], rtol=0, atol=0, msg=f"{key}.{k}")
        _close(r["resumed"], r["after"], f"rank {rank} resumed losses")
        for k, v in r["uninterrupted"].items():
            _close(r["resumed state"][k], v, f"rank {rank} resumed {k}")
        for what in ("distill 3->2", "distill 2->3"):
            saved, loaded = r[what]
            assert set(saved) == set(loaded)
            for k, v in saved.items():
                torch.testing.assert_close(loaded[k], v, rtol=0, atol=0, msg=f"{what} {k}")
    with pytest.raises(ValueError, match=r"holds 2 models \(g, d\).*lightning-zero consolidate .*models/<key>"):
        consolidate(ckpt, tmp_path / "gan.pt")  # the whole directory: which model? Each consolidates alone
    consolidate(ckpt / "models" / "d", tmp_path / "d.pt")
    for k, v in torch.load(tmp_path / "d.pt").items():
        torch.testing.assert_close(v, res[0]["at save"][f"1.{k}"], rtol=0, atol=0, msg=f"consolidated d.{k}")
    for world in (1, 4):
        for rank, r in enumerate(run_distributed(_gan_reshard_job, world, str(tmp_path))):
            for k, v in res[0]["uninterrupted"].items():
                _close(r["state"][k], v, f"{world}-rank resume, rank {rank}: {k}")


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_several_models_bad_input_names_what_is_allowed(tmp_path):
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2), accelerator="cpu", devices=1)
    fabric.launch()
    g, d = make_gan()
    g, opt_g = fabric.setup(g, _adam(g))
    with pytest.raises(ValueError, match="shares 3 parameter.*Allowed: models with disjoint parameters"):
        fabric.setup(nn.Sequential(g.module.net[0], nn.ReLU(), g.module.net[3]))
    with pytest.raises(ValueError, match="holds parameters of no single model set up"):
        fabric.setup_optimizers(_adam(d))
    d, opt_d = fabric.setup(d, _adam(d))
    with pytest.raises(RuntimeError, match="2 models set up.*Allowed: fabric.strategy.engine_of"):
        fabric.strategy.engine
    with pytest.raises(ValueError, match="not an optimizer of this model"):
        fabric.clip_gradients(g, opt_d, max_norm=1.0)
    with pytest.raises(ValueError, match=r"state\['opt_d'\] is the optimizer of a model that is not in the state"):
        fabric.save(tmp_path / "x.ckpt", {"g": g, "opt_g": opt_g, "opt_d": opt_d})
    fabric.save(tmp_path / "gd.ckpt", {"g": g, "d": d})
    with pytest.raises(ValueError, match=r"holds 2 models \(g, d\). Allowed: fabric.load\(path, \{'g': ..., 'd'"):
        fabric.load_raw(tmp_path / "gd.ckpt", g)
    with pytest.raises(KeyError, match="'opt_g' that does not exist"):
        fabric.load(tmp_path / "gd.ckpt", {"g": g, "d": d, "opt_g": opt_g})
    assert fabric.load(tmp_path / "gd.ckpt", {"g": g, "opt_g": opt_g}, strict=False) == {}
    # the manifest is untrusted: a directory outside the checkpoint's models/ folder is refused before any read
    manifest = json.loads((tmp_path / "gd.ckpt" / "zero_checkpoint.json").read_text())
    manifest["models"]["g"]["dir"] = "../gd.ckpt/models/g"
    (tmp_path / "gd.ckpt" / "zero_checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"the entry of model 'g' is .*allowed: \{'dir': 'models/<plain name>'"):
        fabric.load(tmp_path / "gd.ckpt", {"g": g, "d": d})
    fabric.save(tmp_path / "g.ckpt", {"g": g, "opt_g": opt_g})  # one model: the ordinary directory
    with pytest.raises(KeyError, match="'d' that does not exist"):
        fabric.load(tmp_path / "g.ckpt", {"g": g, "d": d, "opt_g": opt_g})
    assert fabric.load(tmp_path / "g.ckpt", {"g": g, "d": d, "opt_g": opt_g}, strict=False) == {}
    fabric.strategy.teardown()
