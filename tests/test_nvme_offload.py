"""ZeRO-Infinity: offload_optimizer="nvme" (engine/placement/nvme.py, engine/placement/nvme_states.py).

* Exact: HF GPT-2 and T5 (from configs) at 2 ranks with gradient accumulation, norm clipping and a LambdaLR schedule:
  zero2 and zero3 with the states on NVMe equal torch DDP (fp32 rtol 1e-5) with the user's AdamW kernel
  (``offload_kernel="user"``), and with torch's fused CPU AdamW on both sides; and they are bit for bit the
  CPU-offload run (the NVMe step *is* the CPU step, its states on disk between steps).
* Checkpoints: saved under one offload device (none / cpu / nvme) and stage, resumed under another, the run
  continues as the uninterrupted DDP run does.
* Host memory, counted in tensor bytes: during every step the masters and optimizer state held outside the
  ring are at most the new state of one bucket (first step) or nothing, the ring is exactly its stated bound,
  and the bytes on disk are >= 10x that bound.
* The scratch files exist per rank while training and are gone after teardown (engine and Trainer).
* Clear errors: too little free space at setup (with the bytes needed), an I/O error mid-run.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

from lightning_zero import checkpoint as ck
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.placement import nvme as NV
from lightning_zero.engine.placement import nvme_space as NS
from tests.helpers.dist_utils import run_distributed
from tests.helpers.nvme_models import swap_files
from tests.helpers.accum_runs import zoo_run, zoo_setup, zoo_steps
from tests.helpers.parity import FP32, check_parity, close

STEPS = 3


def _cfg(stage: int, offload, path: str, kernel: str = "user", **kw) -> ZeroConfig:
    return ZeroConfig(stage=stage, offload_optimizer=offload, offload_params=bool(offload) and stage == 3,
                      nvme_path=path if offload == "nvme" else None, offload_kernel=kernel, bucket_mb=0.01, **kw)


def _parity_runs(rank, world_size, path):
    out = {}
    for name in ("gpt2", "t5"):
        out[name, "ddp"] = zoo_run(rank, None, STEPS, name=name)
        out[name, "ddp_fused"] = zoo_run(rank, None, STEPS, fused=True, name=name)
        for stage in (2, 3):
            for offload in ("nvme", True):
                out[name, stage, offload] = zoo_run(rank, _cfg(stage, offload, path), STEPS, name=name)
            out[name, stage, "nvme", "fused"] = zoo_run(rank, _cfg(stage, "nvme", path, "fused"), STEPS, name=name)
    torch.distributed.barrier()  # every rank's engines torn down
    out["left"] = sorted(os.listdir(path))
    return out


@pytest.mark.timeout(600)
def test_zero2_zero3_nvme_offload_equal_ddp_and_the_cpu_offload_bit_for_bit(tmp_path):
    for rank_out in run_distributed(_parity_runs, 2, str(tmp_path)):
        for name in ("gpt2", "t5"):
            for stage in (2, 3):
                what = f"{name} zero{stage} nvme"
                check_parity(rank_out[name, stage, "nvme"], rank_out[name, "ddp"], f"{what} (user kernel)", FP32)
                check_parity(rank_out[name, stage, "nvme", "fused"], rank_out[name, "ddp_fused"], f"{what} (fused)",
                             FP32)
                (nl, nn_, ns), (cl, cn, cs) = rank_out[name, stage, "nvme"], rank_out[name, stage, True]
                assert nl == cl and nn_ == cn, f"{what}: nvme and cpu offload losses / norms differ"
                assert all(torch.equal(ns[k], cs[k]) for k in cs), f"{what}: nvme != cpu offload bit for bit"
        assert rank_out["left"] == [], rank_out["left"]  # every run's scratch files removed at teardown


# -- checkpoints across offload devices ---------------------------------------------------------------------------
RESUMES = [((2, True), (2, "nvme")), ((2, "nvme"), (2, False)), ((3, "nvme"), (2, True)), ((2, False), (3, "nvme"))]


def _resume_runs(rank, world_size, path):
    out = {"ddp": zoo_run(rank, None, 2 * STEPS)}
    for i, ((s1, o1), (s2, o2)) in enumerate(RESUMES):
        ckpt = os.path.join(path, f"ckpt{i}")
        model, opt, sched, engine = zoo_setup(_cfg(s1, o1, path))
        losses, norms = zoo_steps(rank, model, opt, sched, engine, range(STEPS))
        ck.save_engine_checkpoint(ckpt, model, engine, {"step": STEPS})
        engine.remove(hand_back=False)
        model, opt, sched, engine = zoo_setup(_cfg(s2, o2, path))
        ck.load_checkpoint_dir(ckpt, model, engine)
        for _ in range(STEPS):  # the schedule's position (not in an engine checkpoint)
            sched.step()
        more = zoo_steps(rank, model, opt, sched, engine, range(STEPS, 2 * STEPS))
        engine.restore_fp32_module()
        engine.remove(hand_back=False)
        out[i] = (losses + more[0], norms + more[1], {k: v.detach().clone() for k, v in model.state_dict().items()})
    torch.distributed.barrier()
    out["left"] = swap_files(path)
    return out


@pytest.mark.timeout(600)
def test_checkpoints_resume_across_none_cpu_nvme_and_stages(tmp_path):
    for rank_out in run_distributed(_resume_runs, 2, str(tmp_path)):
        for i, (a, b) in enumerate(RESUMES):
            check_parity(rank_out[i], rank_out["ddp"], f"zero{a[0]} offload={a[1]} -> zero{b[0]} offload={b[1]}")
        assert rank_out["left"] == []


# -- host memory bounded by the ring ------------------------------------------------------------------------------
class Stack(nn.Module):
    """40 equal layers: the states on disk are many times one bucket (one layer's shard)."""

    def __init__(self, layers: int = 40, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        return self.layers(x).pow(2).mean()


def _outside_ring_bytes(s) -> int:
    """Bytes of the masters and optimizer state that live in host memory other than the ring's slots."""
    ring = {slot.untyped_storage().data_ptr() for slot in s.states.ring}
    tensors = [m for row in s.masters for m in row]
    tensors += [v for st in s.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return sum(t.untyped_storage().nbytes() for t in tensors if t.untyped_storage().data_ptr() not in ring)


def _bounded(rank, world_size, path):
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=path, bucket_mb=0.015))
    s = engine.sharded
    seen: list[int] = []
    step_bucket = s._step_bucket

    def probe(k):  # inside the streamed step, with bucket k in its slot
        seen.append(_outside_ring_bytes(s))
        step_bucket(k)
        seen.append(_outside_ring_bytes(s))  # the first step: this bucket's new state, not yet in the slot

    s._step_bucket = probe
    first_step_max = None
    for step in range(3):
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * step + rank))).backward()
        engine.step()
        if step == 0:
            first_step_max, seen[:] = max(seen), []
    rep = engine.memory_report()
    chunk_state_bytes = max(8 * sum(m.numel() for m in row) for row in s.masters)
    files = [f for f in os.listdir(path) if f.endswith(".swap") and f"-rank{rank}-" in f]
    sizes = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    out = dict(first=first_step_max, later=max(seen), chunk_state=chunk_state_bytes, rep=rep.as_dict(),
               ring_alloc=sum(t.numel() for t in s.states.ring), ring=s.ring_bytes(), slot=s.states.slot_bytes,
               buckets=len(s.masters), files=len(files), file_size=sizes, between=_outside_ring_bytes(s))
    engine.remove()
    return out


@pytest.mark.timeout(300)
def test_host_memory_for_the_states_is_bounded_by_the_ring(tmp_path):
    for r in run_distributed(_bounded, 2, str(tmp_path)):
        rep = r["rep"]
        assert r["buckets"] >= 20
        assert r["ring_alloc"] == r["ring"] == 3 * r["slot"]  # the stated bound is what is allocated
        # on disk: every master and state byte of this rank, at least 10x the ring
        assert rep["nvme"] == rep["master"] + rep["optimizer_state"] >= 10 * r["ring"], r
        assert rep["host"] == 0 and rep["ring"] == r["ring"]
        assert r["files"] == 1 and r["file_size"] >= rep["nvme"]
        assert r["between"] == 0  # nothing held between steps
        assert r["later"] == 0  # later steps: the states pass through the ring only
        assert 0 < r["first"] <= r["chunk_state"]  # first step: one bucket's state as the optimizer makes it
    assert os.listdir(tmp_path) == []


# -- errors -------------------------------------------------------------------------------------------------------
def _engine(path, **kw):
    torch.manual_seed(0)
    model = Stack(4, 16)
    return model, ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(
        stage=1, offload_optimizer="nvme", nvme_path=path, **kw))


def test_too_little_free_space_is_refused_at_setup_with_the_bytes_needed(tmp_path, monkeypatch):
    real = NS.shutil.disk_usage
    monkeypatch.setattr(NS.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    numel = sum(p.numel() for p in Stack(4, 16).parameters())
    with pytest.raises(ValueError, match=r"has 1,000 bytes free; rank 0's fp32 masters and optimizer state \(12 "
                                         r"bytes per element\) need ([\d,]+) bytes") as err:
        _engine(str(tmp_path))
    needed = int(err.value.args[0].split(" need ")[1].split(" bytes")[0].replace(",", ""))
    assert 12 * numel <= needed <= 12 * numel + 4096 * 8  # the states, page-aligned per bucket
    assert os.listdir(tmp_path) == []  # nothing was created


def test_an_io_error_mid_run_stops_the_step_with_one_error_and_the_saved_checkpoint_is_intact(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    model, engine = _engine(str(scratch))
    model(torch.randn(2, 16)).backward()
    engine.step()
    ck.save_engine_checkpoint(tmp_path / "good", model, engine, {"step": 1})
    saved = [m.clone() for m in engine.full_master_params()]

    def full_disk(self, buf, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(NV.ScratchFile, "write", full_disk)
    model(torch.randn(2, 16)).backward()
    with pytest.raises(RuntimeError, match=r"offload_optimizer='nvme': on rank 0, the write of .*\.swap failed: .*No "
                                           r"space left.*The run stops on every rank"):
        engine.step()
    monkeypatch.undo()
    engine.remove(hand_back=False)
    assert os.listdir(scratch) == []
    fresh, again = _engine(str(scratch))  # the checkpoint written before the failure loads whole
    ck.load_checkpoint_dir(tmp_path / "good", fresh, again)
    close(again.full_master_params(), saved, "masters from the checkpoint saved before the failure")
    again.remove()


def _one_rank_fails(rank, world_size, path):
    model, engine = _engine(path)
    model(torch.randn(2, 16)).backward()
    engine.step()
    if rank == 0:  # only rank 0's disk fills up
        NV.ScratchFile.write = lambda self, buf, offset: (_ for _ in ()).throw(OSError(errno.ENOSPC, "disk full"))
    model(torch.randn(2, 16)).backward()
    try:
        engine.step()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_an_io_error_on_one_rank_stops_every_rank_with_one_error(tmp_path):
    first, second = run_distributed(_one_rank_fails, 2, str(tmp_path))
    assert first is not None and "on rank 0, the write of" in first and "disk full" in first, first
    assert second == first, second  # every rank raises the failing rank's own words
    assert all("The run stops on every rank" in m for m in (first, second))


def test_the_engine_is_spent_after_teardown(tmp_path):
    model, engine = _engine(str(tmp_path))
    model(torch.randn(2, 16)).backward()
    engine.step()
    assert len(os.listdir(tmp_path)) == 1
    engine.remove()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="the engine was torn down .*Save a checkpoint before remove"):
        engine.sharded.make_resident()


def test_memory_report_between_steps(tmp_path):
    model, engine = _engine(str(tmp_path))
    model(torch.randn(2, 16)).backward()
    engine.step()
    rep = engine.memory_report()
    numel = sum(p.numel() for p in model.parameters())
    assert rep.master == 4 * numel and rep.optimizer_state == 8 * numel
    assert rep.nvme == 12 * numel and rep.host == 0 and rep.ring == engine.sharded.ring_bytes() > 0
    close(engine.full_master_params(), [p.detach() for p in engine.bucket_params], "masters read back")
    rep = engine.memory_report()  # read back for the view: in host memory until the next step streams them out
    assert rep.nvme == 0 and rep.host == 12 * numel
    model(torch.randn(2, 16)).backward()
    engine.step()
    assert engine.memory_report().nvme == 12 * numel
    engine.remove()


# -- Lightning: the registered preset, nvme_path from the environment ------------------------------------------
@pytest.mark.timeout(300)
def test_trainer_preset_zero2_offload_nvme_trains_as_zero2_offload_and_cleans_up(tmp_path, monkeypatch):
    from lightning.pytorch import Callback, Trainer

    from tests.helpers.lightning_models import ParityModule, load_rank_files, trainer_kwargs

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv(NV.NVME_PATH_ENV, str(scratch))  # inherited by the forked ranks
    class CountScratchFiles(Callback):  # in the ranks: this rank's scratch file exists while training
        def on_train_batch_end(self, trainer, *args):
            mine = [f for f in os.listdir(scratch) if f"-rank{trainer.global_rank}-" in f]
            (tmp_path / f"seen{trainer.global_rank}").write_text(str(len(mine)))

    res = {}
    for name in ("zero2_offload_nvme_fork", "zero2_offload_fork"):
        trainer = Trainer(strategy=name, callbacks=[CountScratchFiles()],
                          **trainer_kwargs(devices=2, max_steps=3, accum=2, clip=0.5))
        assert trainer.strategy.zero_config.nvme_path == (str(scratch) if "nvme" in name else None)
        trainer.fit(ParityModule(str(tmp_path), tag=name))
        res[name] = load_rank_files(str(tmp_path), name, "train", 2)
        assert [(tmp_path / f"seen{r}").read_text() for r in (0, 1)] == (["1", "1"] if "nvme" in name else ["0", "0"])
        assert os.listdir(scratch) == []  # removed at the strategy's teardown
    for nvme, cpu in zip(res["zero2_offload_nvme_fork"], res["zero2_offload_fork"]):
        assert nvme["losses"] == cpu["losses"]
        assert all(torch.equal(nvme["params"][k], cpu["params"][k]) for k in cpu["params"])


def _mixed(rank, world_size, path):
    out = {}
    for stage in (2, 3):
        for offload in (True, "nvme"):
            torch.manual_seed(0)
            model = Stack(6, 16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            engine = ZeroEngine(model, opt, _cfg(stage, offload, path), compute_dtype=torch.bfloat16)
            for step in range(3):
                engine.prepare_forward()
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).bfloat16()
                model(x).float().backward()
                engine.step()
            out[stage, offload, "rep"] = engine.memory_report().as_dict()  # before the view reads them back
            out[stage, offload] = [m.clone() for m in engine.full_master_params()]
            engine.remove(hand_back=False)
    return out


@pytest.mark.timeout(120)
def test_bf16_compute_nvme_offload_is_the_cpu_offload_bit_for_bit(tmp_path):
    """Mixed precision: the fp32 masters are separate from the bf16 parameters (and unit shards), so at stage 3
    they go to the file too; the NVMe run is the CPU-offload run."""
    for res in run_distributed(_mixed, 2, str(tmp_path)):
        for stage in (2, 3):
            assert all(torch.equal(a, b) for a, b in zip(res[stage, "nvme"], res[stage, True])), stage
            assert len(res[stage, True]) == 12
            rep = res[stage, "nvme", "rep"]
            assert rep["master"] > 0 and rep["nvme"] == rep["master"] + rep["optimizer_state"], rep


def _unfreeze(rank, world_size, path):
    out = {}
    for offload in (True, "nvme"):
        torch.manual_seed(0)
        model = Stack(4, 16)
        model.layers[3].requires_grad_(False)  # unfrozen after the first step (Lightning's BaseFinetuning)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        engine = ZeroEngine(model, opt, _cfg(2, offload, path))
        for step in range(3):
            if step == 1:
                model.layers[3].requires_grad_(True)
                opt.add_param_group({"params": list(model.layers[3].parameters()), "lr": 5e-3})
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))).backward()
            engine.step()
        rep = engine.memory_report().as_dict()  # before the view below reads the states back
        out[offload] = ([m.clone() for m in engine.full_master_params()], rep)
        engine.remove(hand_back=False)
    return out


@pytest.mark.timeout(120)
def test_add_param_group_after_setup_joins_the_nvme_file(tmp_path):
    for res in run_distributed(_unfreeze, 2, str(tmp_path)):
        (cpu, _), (nvme, rep) = res[True], res["nvme"]
        assert len(nvme) == len(cpu) == 8
        assert all(torch.equal(a, b) for a, b in zip(nvme, cpu))
        # every master and state byte on disk, the added group's too (12 bytes per element of this rank's slices)
        assert rep["nvme"] == rep["master"] + rep["optimizer_state"] == 12 * sum(m.numel() for m in nvme) // 2, rep


def _direct(rank, world_size, path):
    return {direct: zoo_run(rank, _cfg(2, "nvme", path, nvme_direct=direct), 2) for direct in (False, True)}


@pytest.mark.timeout(120)
def test_o_direct_scratch_files_train_the_same(tmp_path):
    """nvme_direct=True (page-aligned ring, O_DIRECT): the same run bit for bit as through the page cache."""
    for res in run_distributed(_direct, 2, str(tmp_path)):
        (dl, dn, ds), (pl, pn, ps) = res[True], res[False]
        assert dl == pl and dn == pn and all(torch.equal(ds[k], ps[k]) for k in ps)



def test_memory_summary_table_has_the_nvme_rows(tmp_path):
    from lightning_zero.lightning.memory_summary import ddp_numbers, format_table, rank_numbers

    model, engine = _engine(str(tmp_path))
    model(torch.randn(2, 16)).backward()
    engine.step()
    mine = rank_numbers(engine)
    numel = sum(p.numel() for p in model.parameters())
    assert mine["nvme"] == 12 * numel and mine["host"] == 0 and mine["device"] == 4 * numel + mine["grads"]
    table = format_table(engine.config, 1, [mine], ddp_numbers(engine, [mine]))
    assert "offload optimizer (NVMe)" in table.splitlines()[0]
    rows = {ln.split("  ")[1].strip(): ln for ln in table.splitlines()[1:] if ln.startswith("  ")}
    assert "NVMe (offloaded)" in rows and "host NVMe ring" in rows, table
    engine.remove()
