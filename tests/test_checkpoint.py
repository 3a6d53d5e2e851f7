"""Sharded (DCP) checkpoints: atomic save, exact resume, resharding across world sizes and stages,
consolidation, clear errors. Engine-level cases run on forked gloo ranks; Lightning cases use the fork
launcher. The model has a real tied-weight alias (``head.weight`` is ``emb.weight``), a frozen layer,
a never-used and a sometimes-used layer, a 1-element parameter and a buffer."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero  # noqa: F401
from lightning_zero import ZeroConfig, ZeroEngine, ZeroPrecision, ZeroStrategy
from lightning_zero import checkpoint as ck
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.tools.cli import main as cli_main
from tests.helpers.ckpt_models import TiedNet, TiedParityModule, make_tied, run_forked, train
from tests.helpers.lightning_models import load_rank_files, trainer_kwargs
from tests.helpers.models import make_optimizer

pytestmark = pytest.mark.timeout(300)
RTOL, ATOL = 1e-5, 1e-6


class _S(ZeroStrategy):  # kept as a name for the tests below; ZeroStrategy carries the checkpoint mixin
    pass


def _strategy(stage: int) -> _S:
    return _S(stage=stage, start_method="fork")


# -- engine-level ranks ---------------------------------------------------------------------------------------------
def _engine(model, stage: int) -> ZeroEngine:
    # stage 3: 'frozen' is a unit of frozen parameters (saved from its unit shard, not from a master)
    units = dict(unit_classes=["fc1", "fc2", "frozen"], persist_numel=0) if stage == 3 else {}
    return ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=stage, bucket_mb=0.0005, **units))


def _snapshot(model, engine) -> dict:
    """Full fp32 parameters (+ buffers, frozen) and the consolidated optimizer state (rank 0)."""
    with engine.gathered_params():  # stage 3: nothing is whole in the module otherwise
        params = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    for n, f in zip(engine.param_names(), engine.full_master_params()):
        params[n] = f.clone()
    return {"params": params, "opt": copy.deepcopy(engine.optimizer_state_dict())}  # stage 0: live tensors


def _save_runs(rank, world_size, jobs, crash_dir=None):
    out = {}
    for stage, path in jobs:
        model = make_tied()
        engine = _engine(model, stage)
        train(model, engine, rank, world_size, range(3))
        ck.save_engine_checkpoint(path, model, engine, {"global_step": 3})
        out[path] = _snapshot(model, engine)
        train(model, engine, rank, world_size, range(3, 4))  # the reference for "training continues"
        out[path]["next"] = _snapshot(model, engine)["params"]
        if crash_dir is not None and stage == 2:
            out["crash"] = _crash_during_save(rank, world_size, model, engine, crash_dir)
    return out


def _crash_during_save(rank, world_size, model, engine, path):
    """A save that dies after writing part of the temporary directory leaves the previous checkpoint intact."""
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 4})
    good = _snapshot(model, engine)["params"]
    train(model, engine, rank, world_size, range(4, 5))
    real = ck.dcp.save

    def dying_save(state, checkpoint_id, **kw):  # dcp.save(..., process_group=...)
        (Path(checkpoint_id) / f"__{rank}_0.distcp").write_bytes(b"half a shard")
        raise OSError("simulated crash in the middle of a save")

    ck.dcp.save = dying_save
    try:
        with pytest.raises(ck.CheckpointWriteError, match="simulated crash"):
            ck.save_engine_checkpoint(path, model, engine, {"global_step": 5})
    finally:
        ck.dcp.save = real
    torch.distributed.barrier()
    res = {"tmp_left": os.path.isdir(str(path) + ck._TMP)}
    fresh = make_tied(9)
    meta = ck.load_checkpoint_dir(path, fresh, None)  # the previous checkpoint, whole
    same = all(torch.equal(fresh.state_dict()[k].float(), v) for k, v in good.items())
    res.update(step=meta["global_step"], same=same)
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 5})  # the next save cleans up and succeeds
    res["tmp_after"] = os.path.isdir(str(path) + ck._TMP)
    res["step_after"] = torch.load(Path(path) / ck.META_FILE)["global_step"]
    return res


def _load_runs(rank, world_size, jobs):
    out = {}
    for stage, path in jobs:
        model = make_tied(7)  # other initial weights: everything must come from the checkpoint
        engine = _engine(model, stage)
        meta = ck.load_checkpoint_dir(path, model, engine)
        snap = _snapshot(model, engine)
        train(model, engine, rank, world_size, range(3, 4))
        snap["next"] = _snapshot(model, engine)["params"]
        snap["step"] = meta["global_step"]
        out[(stage, path)] = snap
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    paths = {k: str(d / f"{k}.ckpt") for k in ("zero2_ws2", "zero0_ws2", "zero1_ws1", "zero3_ws2")}
    res2 = run_forked(_save_runs, 2, [(2, paths["zero2_ws2"]), (0, paths["zero0_ws2"]), (3, paths["zero3_ws2"])],
                      str(d / "crash.ckpt"))[0]
    res1 = run_forked(_save_runs, 1, [(1, paths["zero1_ws1"])])[0]
    return {"dir": d, "paths": paths, **{k: {**res2, **res1}[p] for k, p in paths.items()}, "crash": res2["crash"]}


def _assert_same_params(got, want, rtol=0.0, atol=0.0, what=""):
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")


def _assert_same_opt(got, want):
    assert [len(g["params"]) for g in got["param_groups"]] == [len(g["params"]) for g in want["param_groups"]]
    for g, w in zip(got["param_groups"], want["param_groups"]):
        for k in ("lr", "weight_decay", "betas", "eps"):
            assert g[k] == w[k], k
    assert set(got["state"]) == set(want["state"])  # 'unused' had no state and still has none
    for i, w in want["state"].items():
        assert set(got["state"][i]) == set(w)
        for k, v in w.items():  # Adam moments and step, bit for bit
            torch.testing.assert_close(got["state"][i][k].reshape(v.shape), v, rtol=0, atol=0, msg=f"{i}.{k}")


def test_directory_layout_and_crash_during_save(saved):
    p = Path(saved["paths"]["zero2_ws2"])
    assert {".metadata", ck.META_FILE, ck.INFO_FILE} <= set(os.listdir(p))
    info = json.loads((p / ck.INFO_FILE).read_text())
    assert info["world_size"] == 2 and info["stage"] == 2 and info["version"] == ck.VERSION
    assert info["aliases"] == {"head.weight": "emb.weight"}
    assert info["tensors"]["fc1.weight"] == {"shape": [13, 6], "dtype": "float32", "flat": True}
    assert info["tensors"]["gain"]["flat"] is False and info["tensors"]["frozen.weight"]["flat"] is False
    assert "unused.weight" not in info["optimizer_state"]  # never had a gradient, so no state
    assert info["optimizer_state"]["tiny"] == ["exp_avg", "exp_avg_sq", "step"]
    meta = torch.load(p / ck.META_FILE)
    assert meta["optimizer_states"][0]["param_groups"][0]["params"][0] == "emb.weight"  # keyed by name
    for path in saved["paths"].values():  # no temporary or previous directory left behind
        assert not os.path.exists(path + ck._TMP) and not os.path.exists(ck.aside_path(path))
    crash = saved["crash"]
    # the dying save wrote into the temporary directory (so it existed); its failure removed it
    assert not crash["tmp_left"], "a failed save leaves no partial .zero-tmp behind"
    assert crash["step"] == 4 and crash["same"], "the previous checkpoint survived the crash intact"
    assert not crash["tmp_after"] and crash["step_after"] == 5


# saved on N ranks at stage a -> loaded on M ranks at stage b
RESHARD = {1: [("zero2_ws2", 1), ("zero3_ws2", 2)], 2: [("zero1_ws1", 2), ("zero0_ws2", 2), ("zero2_ws2", 0),
                                                        ("zero1_ws1", 3)],
           4: [("zero2_ws2", 1), ("zero3_ws2", 3)]}


def test_reshard_across_world_sizes_and_stages(saved):
    for world_size, cases in RESHARD.items():
        jobs = [(stage, saved["paths"][src]) for src, stage in cases]
        res = run_forked(_load_runs, world_size, jobs)[0]
        for (src, stage), job in zip(cases, jobs):
            got, want, what = res[job], saved[src], f"{src} -> zero{stage} on {world_size}"
            assert got["step"] == 3
            _assert_same_params(got["params"], want["params"], what=what)
            _assert_same_opt(got["opt"], want["opt"])
            # training continues as if never interrupted (same global batch; reduction order differs)
            _assert_same_params(got["next"], want["next"], rtol=RTOL, atol=ATOL, what=what + " next step")


def test_load_into_plain_model_without_process_group(saved):
    model = make_tied(3)
    ck.load_model_state(saved["paths"]["zero2_ws2"], model)
    _assert_same_params({k: v.float() for k, v in model.state_dict().items()}, saved["zero2_ws2"]["params"])
    assert model.head.weight is model.emb.weight


# -- consolidation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_consolidate_loads_strict_into_plain_model(saved, tmp_path, suffix):
    out = tmp_path / f"model{suffix}"
    assert cli_main(["consolidate", saved["paths"]["zero2_ws2"], str(out)]) == 0
    if suffix == ".pt":
        sd = torch.load(out, weights_only=True)
    else:
        safetensors = pytest.importorskip("safetensors.torch")
        sd = safetensors.load_file(str(out))
    assert list(sd) == list(TiedNet().state_dict())  # every name, aliases included, in module order
    assert all(v.dtype == torch.float32 for v in sd.values())
    model = TiedNet()
    model.load_state_dict(sd, strict=True)
    _assert_same_params({k: v.float() for k, v in model.state_dict().items()}, saved["zero2_ws2"]["params"])


_PEAK_SCRIPT = textwrap.dedent("""
    import json, os, sys, types
    # the torch-only checkpoint package, without the package __init__ (which imports Lightning)
    pkg = types.ModuleType("lightning_zero"); pkg.__path__ = [os.path.dirname(os.path.dirname(sys.argv[1]))]
    sys.modules["lightning_zero"] = pkg
    import lightning_zero.checkpoint.consolidate as consolidate_mod

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    res = {}
    for out in sys.argv[3:]:
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
        before = status("VmRSS:")
        info = consolidate_mod.consolidate(sys.argv[2], out)
        res[out] = {"peak_delta": status("VmHWM:") - before, "weights": info["bytes"]}
    print(json.dumps(res))
""")


def _big_checkpoint(rank, world_size, path):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # 50 MB of fp32 weights
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=2))
    model(torch.randn(2, 1024)).sum().backward()
    engine.step()
    ck.save_engine_checkpoint(path, model, engine)
    return sum(p.numel() * 4 for p in model.parameters())


def test_consolidation_peak_memory_stays_near_weights(tmp_path):
    path = str(tmp_path / "big.ckpt")
    weights = run_forked(_big_checkpoint, 2, path)[0]
    on_disk = sum(f.stat().st_size for f in Path(path).iterdir())
    assert on_disk > 2.9 * weights  # weights + Adam's two moments
    outs = [str(tmp_path / f"m{suffix}") for suffix in (".pt", ".safetensors")]
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, ck.__file__, path, *outs],
                          capture_output=True, text=True, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["weights"] == weights for r in res.values())
    peaks = {Path(o).suffix: res[o]["peak_delta"] for o in outs}
    print(f"consolidation peak above baseline: torch.save {peaks['.pt'] / 2**20:.1f} MiB, safetensors "
          f"{peaks['.safetensors'] / 2**20:.1f} MiB; weights {weights / 2**20:.1f} MiB, "
          f"checkpoint {on_disk / 2**20:.1f} MiB")
    assert peaks[".pt"] < 1.25 * weights  # all weights held for torch.save, never the optimizer state
    assert peaks[".safetensors"] < 0.4 * weights  # streamed tensor by tensor (largest tensor: 8% of weights)


# -- errors -----------------------------------------------------------------------------------------------------------
class _OtherNet(TiedNet):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 14)
        self.extra = torch.nn.Linear(2, 2)
        del self.tiny


def test_checkpoint_from_another_model_lists_the_differences(saved):
    with pytest.raises(ValueError, match=r"does not match this model") as info:
        ck.load_model_state(saved["paths"]["zero1_ws1"], _OtherNet())
    text = str(info.value)
    assert "2 missing key(s): extra.weight, extra.bias" in text
    assert "1 unexpected key(s): tiny" in text
    assert "fc1.weight: checkpoint (13, 6), model (14, 6)" in text and "fc1.bias: checkpoint (13,), model (14,)" in text


def test_incomplete_or_corrupt_directory_is_a_clear_error(saved, tmp_path):
    src = saved["paths"]["zero1_ws1"]
    with pytest.raises(FileNotFoundError, match=r"Checkpoint directory not found"):
        ck.read_info(tmp_path / "nope.ckpt")
    assert cli_main(["consolidate", str(tmp_path / "nope.ckpt"), str(tmp_path / "out.pt")]) == 2
    for victim, exc, match in [
        (ck.INFO_FILE, ValueError, r"not a complete lightning_zero checkpoint: zero_checkpoint.json is missing"),
        (ck.DCP_METADATA, FileNotFoundError, r"Incomplete or corrupt checkpoint .*\.metadata is missing"),
        (ck.META_FILE, FileNotFoundError, r"Incomplete or corrupt checkpoint .*meta.pt is missing"),
    ]:
        broken = tmp_path / f"no_{victim.strip('.')}.ckpt"
        shutil.copytree(src, broken)
        os.remove(broken / victim)
        with pytest.raises(exc, match=match):
            ck.load_model_state(broken, make_tied())
        with pytest.raises(exc, match=match):
            consolidate(broken, tmp_path / "out.pt")
    broken = tmp_path / "truncated.ckpt"
    shutil.copytree(src, broken)
    shard = next(broken.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"distcp is truncated or altered"):
        ck.load_model_state(broken, make_tied())
    (broken / ck.INFO_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=r"Corrupt checkpoint .*not valid json"):
        ck.read_info(broken)


# -- Lightning: ModelCheckpoint (top-k, save_last link), exact resume, reshard, evaluation ---------------------------
FIT = dict(max_steps=6, limit_train_batches=3, enable_checkpointing=True)  # 2 epochs of 3 steps


def _fit(out, tag, strategy, devices=2, ckpt_path=None, callbacks=(), **module_kw):
    Trainer(strategy=strategy, callbacks=list(callbacks), **trainer_kwargs(devices=devices, **FIT)).fit(
        TiedParityModule(out, tag=tag, **module_kw), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return load_rank_files(out, tag, "train", devices)


def _assert_same_run(got, want, what):
    for r, (a, b) in enumerate(zip(got, want)):
        assert a["global_step"] == b["global_step"]
        torch.testing.assert_close(a["losses"], b["losses"], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} rank {r}: {m}")
        _assert_same_params(a["params"], b["params"], RTOL, ATOL, f"{what} rank {r}")


def test_lightning_fit_resume_exact_topk_link_reshard_and_validate(tmp_path):
    out = str(tmp_path)
    every, top = tmp_path / "every", tmp_path / "top"

    def ddp():
        return DDPStrategy(start_method="fork", find_unused_parameters=True)

    # the reference: Lightning's ddp, uninterrupted and resuming from its own epoch-0 checkpoint
    ddp_full = _fit(out, "ddp_", ddp(), callbacks=[ModelCheckpoint(dirpath=tmp_path / "ddp", filename="{epoch}",
                                                                   save_top_k=-1, every_n_epochs=1)])
    ddp_resumed = _fit(out, "ddpres_", ddp(), ckpt_path=tmp_path / "ddp" / "epoch=0.ckpt")

    callbacks = [
        ModelCheckpoint(dirpath=every, filename="{epoch}", save_top_k=-1, every_n_epochs=1),
        ModelCheckpoint(dirpath=top, filename="{step}", monitor="step", mode="max", save_top_k=1,
                        save_last="link", every_n_epochs=1),
    ]
    full = _fit(out, "full_", _strategy(2), callbacks=callbacks)
    _assert_same_run(full, ddp_full, "uninterrupted zero2 vs ddp")

    assert sorted(os.listdir(every)) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    assert sorted(os.listdir(top)) == ["last.ckpt", "step=6.ckpt"], "top-k removed the older directory"
    assert os.path.islink(top / "last.ckpt") and os.readlink(top / "last.ckpt") == "step=6.ckpt"
    assert all(ck.is_checkpoint_dir(every / n) for n in os.listdir(every))
    meta = torch.load(every / "epoch=0.ckpt" / ck.META_FILE, weights_only=False)
    assert meta["global_step"] == 3 and meta["epoch"] == 0
    assert {"loops", "lr_schedulers", "callbacks", "pytorch-lightning_version", "optimizer_states"} <= set(meta)
    assert "state_dict" not in meta

    # resume exactly: the remaining steps equal ddp's resuming from its own checkpoint (Lightning replays
    # the data after an epoch-end resume differently from an uninterrupted run, so that is the reference)
    _assert_same_run(_fit(out, "res_", _strategy(2), ckpt_path=every / "epoch=0.ckpt"), ddp_resumed, "resume dir")

    # reshard through Lightning: zero2 on 2 ranks -> zero1 on 1 rank; training goes on
    consolidate(every / "epoch=0.ckpt", tmp_path / "epoch0.pt")
    at_save = torch.load(tmp_path / "epoch0.pt")
    end = _fit(out, "one_", _strategy(1), devices=1, ckpt_path=every / "epoch=0.ckpt", save_opt_state_on_start=True)[0]
    start = load_rank_files(out, "one_", "start", 1)[0]
    assert start["global_step"] == 3 and end["global_step"] == 6
    _assert_same_params(start["params"], at_save)
    assert len(start["opt_state"]["state"]) == 8 and all(torch.isfinite(torch.tensor(end["losses"])))

    # evaluation loads from a directory (here through save_last's symlink) on 2 ranks, no optimizer state
    Trainer(strategy=_strategy(2), **trainer_kwargs(devices=2, limit_val_batches=1.0)).validate(
        TiedParityModule(out, tag="val_"), ckpt_path=str(top / "last.ckpt"))
    for r, res in enumerate(load_rank_files(out, "val_", "val", 2)):
        assert not res["has_engine"]
        _assert_same_params(res["params"], full[0]["params"], what=f"validate rank {r}")


def test_lightning_zero3_fit_resume_and_reshard(tmp_path):
    """Stage 3 through the Trainer: uninterrupted equals ddp; its directory resumes exactly under zero3 and
    under zero2 on one rank; a zero2 directory resumes under zero3."""
    out = str(tmp_path)
    z3 = dict(unit_classes=["net.fc1", "net.fc2", "net.frozen"], persist_numel=0)  # 'sometimes' stays in the root

    def zero3(**kw):
        return _S(stage=3, start_method="fork", **z3, **kw)

    def ddp():
        return DDPStrategy(start_method="fork", find_unused_parameters=True)

    ddp_full = _fit(out, "d_", ddp(), callbacks=[ModelCheckpoint(dirpath=tmp_path / "ddp", filename="{epoch}",
                                                                 save_top_k=-1, every_n_epochs=1)])
    ddp_resumed = _fit(out, "dr_", ddp(), ckpt_path=tmp_path / "ddp" / "epoch=0.ckpt")
    every = tmp_path / "z3"
    full = _fit(out, "z3_", zero3(), callbacks=[ModelCheckpoint(dirpath=every, filename="{epoch}", save_top_k=-1,
                                                                  every_n_epochs=1)])
    _assert_same_run(full, ddp_full, "uninterrupted zero3 vs ddp")
    info = ck.read_info(every / "epoch=0.ckpt")
    assert info["stage"] == 3 and info["tensors"]["net.frozen.weight"]["flat"] is True  # from its unit shard
    _assert_same_run(_fit(out, "z3r_", zero3(), ckpt_path=every / "epoch=0.ckpt"), ddp_resumed, "zero3 -> zero3")
    # the single-file format also round-trips under stage 3 (gathered on save, re-sliced on load)
    single = _fit(out, "z3f_", zero3(checkpoint_format="full"),
                  callbacks=[ModelCheckpoint(dirpath=tmp_path / "z3f", filename="{epoch}", save_top_k=-1,
                                             every_n_epochs=1)])
    _assert_same_run(single, ddp_full, "zero3 full-format run")
    _assert_same_run(_fit(out, "z3fr_", zero3(), ckpt_path=tmp_path / "z3f" / "epoch=0.ckpt"), ddp_resumed,
                     "zero3 single file -> zero3")
    end = _fit(out, "z3to2_", _strategy(2), devices=1, ckpt_path=every / "epoch=0.ckpt")[0]
    assert end["global_step"] == 6 and all(torch.isfinite(torch.tensor(end["losses"])))


def test_lightning_fp16_resume_restores_loss_scaler_and_fp32_masters(tmp_path):
    """fp16 (separate fp32 masters, dynamic loss scaler): resuming from a directory equals resuming from the
    consolidated single-file format, and the loss scaler continues from its saved state."""
    out = str(tmp_path)

    def run(tag, fmt, ckpt_path=None, callbacks=()):
        strategy = _strategy(2)
        strategy.checkpoint_format = fmt
        prec = ZeroPrecision("16-mixed", initial_scale_power=6, loss_scale_window=2)
        Trainer(strategy=strategy, plugins=[prec], callbacks=list(callbacks), **trainer_kwargs(devices=2, **FIT)).fit(
            TiedParityModule(out, tag=tag), ckpt_path=None if ckpt_path is None else str(ckpt_path))
        return load_rank_files(out, tag, "train", 2)

    def saver(fmt):
        return [ModelCheckpoint(dirpath=tmp_path / fmt, filename="{epoch}", save_top_k=-1, every_n_epochs=1)]

    sharded = run("sharded_", "sharded", callbacks=saver("sharded"))
    _assert_same_run(sharded, run("file_", "full", callbacks=saver("full")), "fp16 runs")
    d, f = tmp_path / "sharded" / "epoch=0.ckpt", tmp_path / "full" / "epoch=0.ckpt"
    assert d.is_dir() and f.is_file()
    # the directory holds the fp32 masters: consolidated, they equal the single file's (full) state dict
    consolidate(d, tmp_path / "d.pt")
    single = torch.load(f, weights_only=False)["state_dict"]
    _assert_same_params(torch.load(tmp_path / "d.pt"), {k: v.float() for k, v in single.items()})
    saved_scaler = torch.load(d / ck.META_FILE, weights_only=False)["ZeroPrecision"]["loss_scaler"]
    assert saved_scaler["scale"] != 2.0**6, "the scale moved during the first epoch"

    from_dir = run("resd_", "sharded", ckpt_path=d)
    for r in range(2):
        assert torch.load(tmp_path / f"resd_precision_rank{r}.pt")["loss_scaler"] == saved_scaler
    _assert_same_run(from_dir, run("resf_", "full", ckpt_path=f), "fp16 resume dir vs file")
