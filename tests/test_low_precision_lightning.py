"""bf16 optimizer states under the Trainer and Fabric: ``ZeroStrategy(stage=s, optimizer_state_dtype="bf16",
master_dtype="bf16")`` with ``precision="bf16-mixed"`` fits with Lightning's defaults and equals a one-process
reference of the algorithm (tests/helpers/low_precision.py: Kahan-compensated bf16 masters, bf16 moments),
written from its definition; ``fit -> save_checkpoint -> fit(ckpt_path=...)`` continues bit for bit as the
uninterrupted run; a Fabric run the same."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer

from lightning_zero import ZeroFabricStrategy, ZeroStrategy
from tests.helpers.dist_utils import run_distributed
from tests.helpers.low_precision import (
    ACCUM, BF16, CLIP, WORLD, LowPrecisionModule, make_net, make_optimizer, master_dtypes, micro_batch,
    micro_batch_items, reference, run_state)

EPOCHS, STEPS = 2, 4  # two epochs of two optimizer steps each: the resumed fit runs the second epoch
SAVED_AT = STEPS // 2  # the Trainer's default ModelCheckpoint saves at the end of the first epoch
KNOBS = dict(optimizer_state_dtype="bf16", master_dtype="bf16")
STAGES = {  # name -> ZeroStrategy arguments; the tiny net is two stage-3 units (nothing persistent)
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3, unit_classes=["net.fc1", "net.fc2"], persist_numel=0),
    "zero3_offload": dict(stage=3, unit_classes=["net.fc1", "net.fc2"], persist_numel=0, offload_optimizer=True,
                          offload_params=True),
}


def _fit(root: str, stage: str, tag: str, epochs: int, ckpt_path=None) -> Trainer:
    """One ``Trainer.fit`` on this rank of an already launched job (Lightning's defaults otherwise: its
    ModelCheckpoint saves at each epoch's end)."""
    trainer = Trainer(accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(**STAGES[stage], **KNOBS),
                      precision="bf16-mixed", max_epochs=epochs, accumulate_grad_batches=ACCUM,
                      gradient_clip_val=CLIP, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root)
    trainer.fit(LowPrecisionModule(root, tag), ckpt_path=ckpt_path)
    return trainer


def _trainer_job(rank: int, world_size: int, stage: str, root: str, resume: bool) -> dict:
    """The uninterrupted fit; with ``resume``, also fit -> save_checkpoint -> a new Trainer's fit(ckpt_path=...)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    _fit(root, stage, "whole_", EPOCHS)
    if resume:
        first = _fit(root, stage, "first_", EPOCHS // 2)
        ckpt = os.path.join(root, "half.ckpt")
        first.save_checkpoint(ckpt)
        _fit(root, stage, "resumed_", EPOCHS, ckpt_path=ckpt)
    return {tag: torch.load(os.path.join(root, f"{tag}rank{rank}.pt"), weights_only=False)
            for tag in ("whole_", "resumed_") if resume or tag == "whole_"}


def _check_against_reference(runs: list[dict], stage: str, what: str) -> None:
    """Every rank's data, losses and the run's final state against the reference, bit for bit; the norms the
    run clipped with against the reference's own to fp32 rounding (tests/helpers/low_precision.py)."""
    steps = runs[0]["global_step"]
    kw = dict(norms=runs[0]["norms"], fused=bool(STAGES[stage].get("offload_optimizer")))
    ref = reference(STAGES[stage]["stage"], steps, **kw)
    torch.testing.assert_close(runs[0]["norms"], ref["norms"], rtol=1e-6, atol=0)
    assert max(ref["norms"]) > CLIP, ref["norms"]  # the clipping acted
    for r, run in enumerate(runs):
        # between steps no fp32 master (the bf16 parameter is the master): up to the first checkpoint save,
        # which widens them until the next step ([Note: low-precision optimizer states], lifecycle)
        before_save = [d for step, d in run["master_dtypes"] if step < SAVED_AT]
        assert before_save and all(d == {BF16} for d in before_save), (what, r, run["master_dtypes"])
        assert run["seen"] == [micro_batch_items(r, n) for n in range(steps * ACCUM)]  # the reference's data
        assert run["losses"] == ref["losses"][r], (what, r)
    assert not _differs(runs[0], ref), (what, _differs(runs[0], ref))
    # the comparison discriminates: a plain bf16 master, or fp32 moments, would be caught
    for defect in (dict(compensation=False), dict(bf16_moments=False)):
        assert _differs(runs[0], reference(STAGES[stage]["stage"], steps, **kw, **defect)), (what, defect)


def _differs(run: dict, ref: dict) -> list[str]:
    """The entries of the run's state (bf16 parameters, fp32 masters, the moments) not equal to ``ref``'s."""
    bad = [f"param {n}" for n, v in ref["params"].items() if not (run["params"][n].dtype == BF16
                                                                  and torch.equal(run["params"][n], v))]
    bad += [f"master {n}" for n, v in ref["masters"].items() if not torch.equal(run["masters"][n], v)]
    return bad + [f"{n}.{k}" for n, st in ref["moments"].items() for k, v in st.items()
                  if not torch.equal(run["moments"][n][k].float(), v.float())]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", list(STAGES))
def test_trainer_bf16_states_equal_reference(tmp_path, stage):
    whole = [r["whole_"] for r in run_distributed(_trainer_job, WORLD, stage, str(tmp_path), False)]
    assert whole[0]["global_step"] == STEPS
    _check_against_reference(whole, stage, stage)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", list(STAGES))
def test_trainer_bf16_states_resume_bit_for_bit(tmp_path, stage):
    runs = run_distributed(_trainer_job, WORLD, stage, str(tmp_path), True)
    whole, resumed = [r["whole_"] for r in runs], [r["resumed_"] for r in runs]
    assert whole[0]["global_step"] == resumed[0]["global_step"] == STEPS
    for r in range(WORLD):  # the resumed fit ran the second epoch only, with the uninterrupted fit's bits
        assert resumed[r]["losses"] == whole[r]["losses"][len(whole[r]["losses"]) // 2:], (stage, r)
    assert not _differs(resumed[0], whole[0]), _differs(resumed[0], whole[0])


@pytest.mark.timeout(300)
def test_trainer_bf16_masters_narrow_after_a_checkpoint_save(tmp_path):
    """The Trainer's default ModelCheckpoint saves at the first epoch's end; the next micro-batch's forward and
    backward should not hold the fp32 masters (4 bytes per element more at the activations' peak)."""
    run = run_distributed(_trainer_job, WORLD, "zero2", str(tmp_path), False)[0]["whole_"]
    assert any(step == SAVED_AT for step, _ in run["master_dtypes"])
    assert all(d == {BF16} for _, d in run["master_dtypes"]), run["master_dtypes"]


# -- Fabric ---------------------------------------------------------------------------------------------------
def _fabric_steps(fabric, model, opt, sched, rank: int, start: int, stop: int, out: dict) -> None:
    """Fabric's loop of the Trainer's fit: ACCUM micro-batches (the reference's data), clip, step."""
    for step in range(start, stop):
        for micro in range(ACCUM):
            x, y = micro_batch(rank, step * ACCUM + micro)
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                with fabric.autocast():  # the loss as the Trainer's training_step computes it
                    loss = torch.nn.functional.mse_loss(model(x), y.to(BF16))
                fabric.backward(loss / ACCUM)
            out["losses"].append(loss.float().item())
            out["seen"].append(micro_batch_items(rank, step * ACCUM + micro))
        out["norms"].append(float(fabric.clip_gradients(model, opt, max_norm=CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        out["master_dtypes"].append((step + 1, master_dtypes(fabric.strategy.engine)))


def _fabric(stage: str) -> Fabric:
    """Fabric over the bare TinyNet: its stage-3 units are named without the LightningModule's ``net.``."""
    kw = {k: ([u.removeprefix("net.") for u in v] if k == "unit_classes" else v) for k, v in STAGES[stage].items()}
    fabric = Fabric(strategy=ZeroFabricStrategy(**kw, **KNOBS), accelerator="cpu", devices=WORLD,
                    precision="bf16-mixed")
    fabric.launch()
    return fabric


def _fabric_run(rank: int, world_size: int, stage: str, root: str, resume: bool) -> dict:
    fabric = _fabric(stage)
    net = make_net()
    opt, sched = make_optimizer(net.parameters())
    model, opt = fabric.setup(net, opt)
    out = {"losses": [], "seen": [], "norms": [], "master_dtypes": [], "global_step": STEPS}
    start = 0
    if resume:  # the first half, saved; then a new model and optimizer loaded from it
        _fabric_steps(fabric, model, opt, sched, rank, 0, STEPS // 2, out)
        fabric.save(f"{root}/fabric_half", {"model": model, "optimizer": opt, "scheduler": sched})
        fabric.strategy.teardown()
        fabric = _fabric(stage)
        net = make_net()
        opt, sched = make_optimizer(net.parameters())
        model, opt = fabric.setup(net, opt)
        fabric.load(f"{root}/fabric_half", {"model": model, "optimizer": opt, "scheduler": sched})
        out = {k: ([] if isinstance(v, list) else v) for k, v in out.items()}
        out["master_dtypes"] = [(0, master_dtypes(fabric.strategy.engine))]  # after the load
        start = STEPS // 2
    _fabric_steps(fabric, model, opt, sched, rank, start, STEPS, out)
    out.update(run_state(fabric.strategy.engine, model.module if hasattr(model, "module") else model,
                         fabric.strategy.gathered_params))
    fabric.strategy.teardown()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_fabric_bf16_states_equal_reference(tmp_path, stage):
    whole = run_distributed(_fabric_run, WORLD, stage, str(tmp_path), False)
    _check_against_reference(whole, stage, f"fabric {stage}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_fabric_bf16_states_resume_bit_for_bit(tmp_path, stage):
    whole = run_distributed(_fabric_run, WORLD, stage, str(tmp_path), False)
    resumed = run_distributed(_fabric_run, WORLD, stage, str(tmp_path), True)
    for r in range(WORLD):
        assert resumed[r]["losses"] == whole[r]["losses"][len(whole[r]["losses"]) // 2:], (stage, r)
    assert not _differs(resumed[0], whole[0]), _differs(resumed[0], whole[0])
