"""Whole-tensor optimizers (Muon + AdamW, Adafactor) under Lightning's Trainer at ZeRO stages 1-3, against
Lightning's DDP with the same seed and data (fork launcher, gloo, 2 ranks).

Muon's Newton-Schulz runs in bf16 in torch: the fp32 rtol 1e-5 comparisons patch an fp32 copy of it into both
runs (tests/helpers/whole_tensor_lightning.py); torch's own bf16 Muon is compared at bf16 precision. The
add_param_group test compares with one process on the global batch: DDP never reduces parameters unfrozen
after it wrapped the module (tests/test_param_groups.py says why).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from tests.helpers import whole_tensor_lightning as W
from tests.helpers.dist_utils import run_distributed

RTOL, ATOL = 1e-5, 1e-6
MUON_STEPS = 6  # Lightning counts both optimizers' steps: 3 batches


def _ddp():
    return DDPStrategy(start_method="fork", find_unused_parameters=True)


def _close(got: list[dict], ref: list[dict], rtol: float = RTOL, atol: float = ATOL, keys=("losses", "norms")):
    for rank, (z, d) in enumerate(zip(got, ref)):
        for key in keys:
            torch.testing.assert_close(torch.tensor(z[key]), torch.tensor(d[key]), rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} {key}: {m}")
        assert set(z["params"]) == set(d["params"])
        for name, v in d["params"].items():
            torch.testing.assert_close(z["params"][name], v, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.fixture(scope="module")
def fp32_muon():
    with pytest.MonkeyPatch.context() as mp:  # the forked ranks inherit it
        mp.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", W.fp32_newton_schulz)
        yield


@pytest.fixture(scope="module")
def ddp_muon(tmp_path_factory, fp32_muon):
    ref = W.fit(W.MuonAdamW(str(tmp_path_factory.mktemp("ddp_muon")), "ddp_"), _ddp(), max_steps=MUON_STEPS)
    first = W.MuonAdamW("unused", "").net
    assert not torch.equal(ref[0]["params"]["net.fc1.weight"], first.fc1.weight.detach())  # Muon's
    assert not torch.equal(ref[0]["params"]["net.emb.weight"], first.emb.weight.detach())  # AdamW's
    assert all(n > W.CLIP for n in ref[0]["norms"])  # clipping acts on every step
    return ref


# -- item 1: the split users write, manual optimization, one global-norm clip as DDP does it ------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero1_fork", "zero2_fork", "zero3_fork", "zero3_offload_fork"])
def test_muon_adamw_manual_optimization_matches_ddp(tmp_path, ddp_muon, strategy):
    got = W.fit(W.MuonAdamW(str(tmp_path), "zero_"), strategy, max_steps=MUON_STEPS)
    _close(got, ddp_muon)
    for z, d in zip(got, ddp_muon):
        assert z["step_counts"] == d["step_counts"] == [3, 3]  # each optimizer's own step(), once per batch
        assert z["lrs"] == d["lrs"]  # both LR schedules stepped
        assert z["logged"] == pytest.approx(d["logged"], rel=RTOL)  # the logged (synced) loss


@pytest.mark.timeout(300)
def test_torch_bf16_muon_matches_ddp_at_bf16_precision(tmp_path):
    ref = W.fit(W.MuonAdamW(str(tmp_path), "ddp_"), _ddp(), max_steps=MUON_STEPS)
    got = W.fit(W.MuonAdamW(str(tmp_path), "zero_"), "zero2_fork", max_steps=MUON_STEPS)
    _close(got, ref, rtol=1.6e-2, atol=1e-3)  # a gradient's last bit moves a bf16 Newton-Schulz result


class _PartClip(W.MuonAdamW):
    def training_step(self, batch, batch_idx):
        loss = W.loss_fn(self.net, batch[0], False)
        self.manual_backward(loss)
        torch.nn.utils.clip_grad_norm_(self.net.fc1.parameters(), W.CLIP)  # part of Muon's and AdamW's


class _BoundClip(W.MuonAdamW):
    def training_step(self, batch, batch_idx):
        loss = W.loss_fn(self.net, batch[0], False)
        self.manual_backward(loss)
        W.torch_clip_bound_at_import(self.parameters(), W.CLIP)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("module, error", [
    (_PartClip, r"got part of the parameters of Muon \(optimizer 0; 3 of its parameters left out\).*Allowed: "),
    (_BoundClip, r"a copy bound before the engine existed.*torch.nn.utils.clip_grad_norm_\(...\)"),
], ids=["part_of_an_optimizer", "copy_bound_at_import"])
def test_torch_clip_never_returns_a_local_norm(tmp_path, module, error):
    with pytest.raises(Exception, match=error):  # raised in the forked rank, re-raised here
        W.fit(module(str(tmp_path), "zero_"), "zero2_fork", max_steps=2)


# -- item 1 (automatic optimization) and 3a: Adafactor, gradient_clip_val, accumulate_grad_batches=4 -----------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero2_fork", "zero3_fork"])
def test_adafactor_clip_and_accumulation_step_once_per_optimizer_step(tmp_path, strategy):
    kw = dict(max_steps=3, accumulate_grad_batches=4, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    ref = W.fit(W.AdafactorAuto(str(tmp_path), "ddp_"), _ddp(), **kw)
    got = W.fit(W.AdafactorAuto(str(tmp_path), "zero_"), strategy, **kw)
    _close(got, ref, keys=("losses",))
    for z, d in zip(got, ref):
        assert len(z["losses"]) == 12 and z["global_step"] == 3
        assert z["step_counts"] == d["step_counts"] == [3]  # DeepSpeed #8600: one step per 4 micro-batches
    # Adafactor's own count, in the state of the parameters each rank owns ("sometimes" skips unused steps)
    assert max(ref[0]["state_steps"]) == 3.0
    assert sorted(set(got[0]["state_steps"]) | set(got[1]["state_steps"])) == ref[0]["state_steps"]


# -- 3b: the model built in configure_model at stage 3 (deferred init) ------------------------------------
@pytest.mark.timeout(300)
def test_muon_trains_a_model_built_in_configure_model_at_stage3(tmp_path, fp32_muon):
    got = W.fit(W.MuonAdamW(str(tmp_path), "zero_", deferred=True), "zero3_fork", max_steps=MUON_STEPS)
    ref = W.fit(W.MuonAdamW(str(tmp_path), "ddp_", deferred=True), _ddp(), max_steps=MUON_STEPS)
    assert got[0]["meta"] is True and ref[0]["meta"] is False
    _close(got, ref)
    torch.manual_seed(0)
    eager = W.MuonNet()
    for name in ("fc1.weight", "fc2.weight"):  # Muon's matrices moved (DeepSpeed #8438: they stayed put)
        assert (got[0]["params"][f"net.{name}"] - eager.get_parameter(name).detach()).abs().max() > 1e-3


# -- 3d: add_param_group after setup: BaseFinetuning unfreezing into Adafactor ------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero2_fork", "zero3_fork"])
def test_base_finetuning_unfreezes_into_adafactor(tmp_path, strategy):
    def run(tag, strat, devices, batch_size):
        module = W.AdafactorFinetuned(str(tmp_path), tag, batch_size)
        return W.fit(module, strat, devices=devices, max_steps=-1, max_epochs=3, callbacks=[W.UnfreezeFc1()])

    ref = run("ref_", "auto", 1, 8)[0]  # one process, the global batch of 2 ranks x 4
    got = run("zero_", strategy, 2, 4)
    mean = (torch.tensor(got[0]["losses"]) + torch.tensor(got[1]["losses"])) / 2
    torch.testing.assert_close(mean, torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
    for z in got:
        for name, v in ref["params"].items():
            torch.testing.assert_close(z["params"][name], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    first = W.AdafactorFinetuned("unused", "", 4).net.fc1.weight.detach()
    assert not torch.equal(ref["params"]["net.fc1.weight"], first)  # unfrozen, then trained


# -- 3e: fit, validate, fit again, validate, in the same processes (torchrun's way: launched ranks) -----------
@pytest.mark.timeout(300)
def test_fit_validate_fit_in_one_process_matches_ddp(tmp_path, fp32_muon):
    got = run_distributed(W.fit_validate_fit, 2, "zero3", str(tmp_path))
    ref = run_distributed(W.fit_validate_fit, 2, "ddp", str(tmp_path))
    for z, d in zip(got, ref):
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(z[key]), torch.tensor(d[key]), rtol=RTOL, atol=ATOL)
        for k in ("weights1", "weights2"):
            for name, v in d[k].items():
                torch.testing.assert_close(z[k][name], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{k} {name}: {m}")
        for a, b in zip(z["metrics"], d["metrics"]):
            assert a[0]["val_loss"] == pytest.approx(b[0]["val_loss"], rel=RTOL)
        assert z["step_counts"] == d["step_counts"] == [2, 2, 2, 2]  # two fits, each with its own optimizers
        assert z["torch_clip_restored"]  # torch's clip_grad_norm_ is its own again once the engine let go


# -- checkpoints: the consolidated Lightning file carries the owners' state ---------------------------------
def _fit_epochs(out, tag, strategy, ckpt_dir=None, ckpt_path=None):
    import glob
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint

    module = W.MuonAdamW(out, tag)
    kw = dict(max_steps=-1, max_epochs=2)
    if ckpt_dir is not None:
        kw.update(enable_checkpointing=True, default_root_dir=ckpt_dir,
                  callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)])
    os.environ.pop("MASTER_PORT", None)
    from lightning.pytorch import Trainer

    from tests.helpers.lightning_models import load_rank_files, trainer_kwargs

    Trainer(strategy=strategy, **{**trainer_kwargs(devices=2), **kw}).fit(module, ckpt_path=ckpt_path)
    return load_rank_files(out, tag, "train", 2), sorted(glob.glob(os.path.join(ckpt_dir or out, "epoch=0*")))


@pytest.mark.timeout(300)
def test_consolidated_lightning_file_carries_the_owners_state_and_resumes_under_ddp(tmp_path, fp32_muon):
    """A zero3 Muon + AdamW fit checkpoints each epoch; ``lightning-zero consolidate DIR OUT --lightning
    --optimizer`` on the first gathers every hidden matrix's Muon momentum whole, parameter-shaped, from the rank
    that owned it, beside AdamW's moments; plain DDP resumes from that file and ends where the zero3 run ends."""
    from lightning_zero.tools.cli import main as cli_main

    whole, first = _fit_epochs(str(tmp_path), "a_", "zero3_fork", ckpt_dir=str(tmp_path / "ckpt"))
    single = str(tmp_path / "consolidated.ckpt")
    assert cli_main(["consolidate", first[0], single, "--lightning", "--optimizer", "--quiet"]) == 0
    ckpt = torch.load(single, weights_only=False)
    muon_state, adamw_state = ckpt["optimizer_states"]
    module = W.MuonAdamW("unused", "")
    names = {id(p): n for n, p in module.named_parameters()}
    hidden = [names[id(p)] for p in lightning_zero.muon_split(module)[0]]
    shapes = dict(module.named_parameters())
    # every hidden matrix that ever had a gradient (net.unused never does: no state, as under DDP)
    assert [hidden[i] for i in sorted(muon_state["state"])] == [n for n in hidden if n != "net.unused.weight"]
    for i, st in muon_state["state"].items():
        assert st["momentum_buffer"].shape == shapes[hidden[i]].shape, hidden[i]
    assert all(set(st) == {"step", "exp_avg", "exp_avg_sq"} for st in adamw_state["state"].values())
    resumed, _ = _fit_epochs(str(tmp_path), "b_", _ddp(), ckpt_path=single)
    _close(resumed, whole, keys=())


@pytest.mark.timeout(300)
def test_fit_resumes_a_zero3_checkpoint_directory_at_zero2_with_ckpt_path(tmp_path, fp32_muon):
    """The user's own ``fit(ckpt_path=DIR)`` on the sharded directory a zero3 Muon + AdamW fit wrote during its
    first epoch, in the same process, at another stage: the owners change (new buckets), each takes its
    parameters' momentum from the directory, and the run ends where the uninterrupted zero3 run ends."""
    whole, first = _fit_epochs(str(tmp_path), "a_", "zero3_fork", ckpt_dir=str(tmp_path / "ckpt"))
    resumed, _ = _fit_epochs(str(tmp_path), "c_", "zero2_fork", ckpt_path=first[0])
    _close(resumed, whole, keys=())
