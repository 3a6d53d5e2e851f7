"""ZeRO-Infinity parameter offload: offload_params="nvme" (engine/placement/nvme_params.py).

* Exact: HF GPT-2 (from a config) at 2 ranks with gradient accumulation, norm clipping and a LambdaLR schedule:
  zero3 with the parameter shards on NVMe (optimizer on NVMe, on the host, or on the device) equals torch DDP
  (fp32 rtol 1e-5, the user's AdamW kernel on both sides) and is bit for bit the CPU parameter offload; bf16
  compute too (against the CPU parameter offload).
* Checkpoints resume across offload_params none / cpu / nvme (the normal sharded directory; no scratch file in it).
* Host memory, counted in tensor bytes: while training, the bytes held for parameter shards are the ring (its
  stated bound), the gathered units stay within the working set of the units gathered at once, and the shards
  on disk are >= 10x the ring; the reads are issued ahead of their gathers in the recorded order.
* Setup holds one unit's shard at a time (counted). The clear errors: tests/test_nvme_params_errors.py. The scratch files are removed at teardown (engine, several Trainer fits).
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_zero import checkpoint as ck
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.placement import nvme as NV
from tests.helpers.accum_runs import zoo_run, zoo_setup, zoo_steps
from tests.helpers.dist_utils import run_distributed
from tests.helpers.nvme_models import STACK_UNITS, Stack, swap_files
from tests.helpers.parity import check_parity

STEPS = 3


def _cfg(params, optimizer, path: str, stage: int = 3, **kw) -> ZeroConfig:
    on_disk = "nvme" in (params, optimizer)
    return ZeroConfig(stage=stage, offload_optimizer=optimizer, offload_params=params if stage == 3 else False,
                      nvme_path=path if on_disk else None, offload_kernel="user", bucket_mb=0.01, **kw)


# -- exact --------------------------------------------------------------------------------------------------------
OPTIMIZER_HOMES = ("nvme", True, False)


def _parity_runs(rank, world_size, path):
    out = {"ddp": zoo_run(rank, None, STEPS), "cpu": zoo_run(rank, _cfg(True, True, path), STEPS)}
    for opt_home in OPTIMIZER_HOMES:
        out["nvme", opt_home] = zoo_run(rank, _cfg("nvme", opt_home, path), STEPS)
    out["nvme", "prefetch2"] = zoo_run(rank, _cfg("nvme", "nvme", path, prefetch=2), STEPS)
    out["nvme", "noreshard"] = zoo_run(rank, _cfg("nvme", "nvme", path, reshard_after_forward=False), STEPS)
    torch.distributed.barrier()  # every rank's engines torn down
    out["left"] = swap_files(path)
    return out


@pytest.mark.timeout(600)
def test_zero3_param_nvme_offload_equals_ddp_and_the_cpu_param_offload_bit_for_bit(tmp_path):
    for r in run_distributed(_parity_runs, 2, str(tmp_path)):
        (cl, cn, cs) = r["cpu"]
        for key in [("nvme", o) for o in OPTIMIZER_HOMES] + [("nvme", "prefetch2"), ("nvme", "noreshard")]:
            check_parity(r[key], r["ddp"], f"zero3 offload_params='nvme' {key[1]}")
            nl, nn_, ns = r[key]
            assert nl == cl and nn_ == cn, f"{key}: losses / norms differ from the CPU parameter offload"
            assert all(torch.equal(ns[k], cs[k]) for k in cs), f"{key}: not the CPU parameter offload bit for bit"
        assert r["left"] == [], r["left"]




def _bf16(rank, world_size, path):
    out = {}
    for params in (True, "nvme"):
        torch.manual_seed(0)
        model = Stack(6, 16)
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            _cfg(params, "nvme", path, **STACK_UNITS), compute_dtype=torch.bfloat16)
        for step in range(3):
            engine.prepare_forward()
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).bfloat16()).backward()
            engine.step()
        out[params, "rep"] = engine.memory_report().as_dict()
        out[params] = [m.clone() for m in engine.full_master_params()]
        engine.remove()
        out[params, "module"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.timeout(180)
def test_bf16_compute_param_nvme_offload_is_the_cpu_param_offload_bit_for_bit(tmp_path):
    """bf16 shards in the file (the compute dtype), fp32 masters in the optimizer's: the same run."""
    for r in run_distributed(_bf16, 2, str(tmp_path)):
        assert all(torch.equal(a, b) for a, b in zip(r["nvme"], r[True]))
        assert all(torch.equal(a, b) for a, b in zip(r["nvme", "module"], r[True, "module"]))
        rep = r["nvme", "rep"]
        numel = sum(m.numel() for m in r["nvme"]) // 2  # this rank's shard of every parameter
        # on disk: masters + AdamW state (12 bytes) and the bf16 parameter shards (2 bytes) of each element
        assert rep["nvme"] == 14 * numel and rep["host"] == 0 and rep["ring"] > 0, rep
    assert swap_files(str(tmp_path)) == []


# -- checkpoints across parameter offload devices -----------------------------------------------------------------
RESUMES = [((False, False), ("nvme", "nvme")), (("nvme", "nvme"), (True, True)), ((True, True), ("nvme", False)),
           (("nvme", True), (False, False))]


def _resume_runs(rank, world_size, path):
    out = {"ddp": zoo_run(rank, None, 2 * STEPS)}
    for i, (a, b) in enumerate(RESUMES):
        ckpt = os.path.join(path, f"ckpt{i}")
        model, opt, sched, engine = zoo_setup(_cfg(*a, path))
        losses, norms = zoo_steps(rank, model, opt, sched, engine, range(STEPS))
        ck.save_engine_checkpoint(ckpt, model, engine, {"step": STEPS})
        engine.remove(hand_back=False)
        model, opt, sched, engine = zoo_setup(_cfg(*b, path))
        ck.load_checkpoint_dir(ckpt, model, engine)
        for _ in range(STEPS):  # the schedule's position (not in an engine checkpoint)
            sched.step()
        more = zoo_steps(rank, model, opt, sched, engine, range(STEPS, 2 * STEPS))
        engine.restore_fp32_module()
        engine.remove(hand_back=False)
        torch.distributed.barrier()
        out[i, "ckpt_files"] = sorted(f for _, _, fs in os.walk(ckpt) for f in fs)
        out[i] = (losses + more[0], norms + more[1], {k: v.detach().clone() for k, v in model.state_dict().items()})
    out["left"] = swap_files(path)
    return out


@pytest.mark.timeout(600)
def test_checkpoints_resume_across_param_offload_none_cpu_nvme(tmp_path):
    for r in run_distributed(_resume_runs, 2, str(tmp_path)):
        for i, (a, b) in enumerate(RESUMES):
            check_parity(r[i], r["ddp"], f"offload (params, optimizer) {a} -> {b}")
            assert not [f for f in r[i, "ckpt_files"] if f.endswith(".swap")]
        assert r["left"] == []


# -- host memory bounded by the ring ------------------------------------------------------------------------------
def _shard_host_bytes(part) -> int:
    """Host bytes held for parameter shards: the shards' own storages (0 while on disk) and the ring's buffers."""
    return (sum(u.shard.untyped_storage().nbytes() for u in part.units if u.shard is not None)
            + sum(s.buf.numel() for s in part.store.ring))


def _bounded(rank, world_size, path):
    torch.manual_seed(0)
    model = Stack()
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                        _cfg("nvme", "nvme", path, nvme_buffer_count=2, **STACK_UNITS))
    part, store = engine.partitioner, engine.partitioner.store
    seen = {"shards": [], "gathered": []}

    def probe(*_):
        seen["shards"].append(_shard_host_bytes(part))
        seen["gathered"].append(part.gathered_bytes())

    for layer in model.layers:  # after the engine's hooks: in forward, with the unit gathered
        layer.register_forward_pre_hook(probe)
    pre_backward = part._pre_backward

    def probed_pre_backward(u):  # in backward, with the unit gathered again
        pre_backward(u)
        probe()

    part._pre_backward = probed_pre_backward
    counts = []
    for step in range(3):
        engine.prepare_forward()
        model(torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))).backward()
        engine.step()
        counts.append((store.reads_ahead, store.reads_waited, store.bytes_read, store.bytes_written))
        probe()  # between steps
    rep = engine.memory_report().as_dict()
    unit_full = max(u.full_bytes for u in part.units)
    files = [f for f in swap_files(path) if f"-params-rank{rank}-" in f]
    last = part.units[part._order[-1]]  # stays gathered from its forward into its backward: read once a step
    out = dict(last_shard=last.shard.numel() * last.shard.element_size(), seen=seen, rep=rep, ring=store.ring_bytes, slots=len(store.ring), slot=store.slot_bytes,
               unit_full=unit_full, units=len(part.units), counts=counts, shard_bytes=part.shard_bytes(),
               file=os.path.getsize(os.path.join(path, files[0])) if files else 0, files=len(files))
    engine.remove()
    return out


@pytest.mark.timeout(300)
def test_host_memory_for_parameter_shards_is_bounded_by_the_ring(tmp_path):
    for r in run_distributed(_bounded, 2, str(tmp_path)):
        rep, seen = r["rep"], r["seen"]
        assert r["units"] >= 40 and r["slots"] == 1 + 2  # prefetch 1 + nvme_buffer_count 2
        assert r["ring"] == r["slots"] * r["slot"]
        # the shards on disk: all of this rank's, >= 10x the ring
        assert rep["nvme"] >= r["shard_bytes"] >= 10 * r["ring"], r
        assert r["files"] == 1 and r["file"] >= r["shard_bytes"]
        # in forward, backward and between steps: the host bytes for parameter shards are the ring, no more ...
        assert len(seen["shards"]) >= 3 * 2 * 40 and max(seen["shards"]) <= r["ring"], (max(seen["shards"]), r["ring"])
        # ... and what is gathered is the working set: the unit in use and the one prefetched
        assert max(seen["gathered"]) <= 2 * r["unit_full"], (max(seen["gathered"]), r["unit_full"])
        assert rep["ring"] >= r["ring"] and rep["host"] == 0  # the optimizer's ring and this one; nothing else
        # reads ahead once the order is recorded: after the first step nearly every gather finds its shard read
        (a1, w1, rd1, wr1), (a2, w2, rd2, wr2) = r["counts"][0], r["counts"][1]
        assert a2 - a1 >= 2 * 40 - 4 and w2 - w1 <= 4, r["counts"]
        # per step: every shard read for forward and again for backward but the last unit's (kept between the
        # two), written once by the step
        assert 0 < r["last_shard"] < r["shard_bytes"], r
        assert rd2 - rd1 == 2 * r["shard_bytes"] - r["last_shard"] and wr2 - wr1 == r["shard_bytes"], r["counts"]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optimizer", ["nvme", True])
def test_setup_holds_one_unit_shard_at_a_time(tmp_path, monkeypatch, dtype, optimizer):
    """Setup, counted at every scratch-file read / write and every master taken: the host bytes of parameter
    shards never exceed the largest unit's fp32 shard (cut, then spilled; read back for its masters; read back
    for the cast to the compute dtype), though this rank's shards are 40 units."""
    from lightning_zero.engine.optim.optimizer import ShardedOptimizer
    from lightning_zero.engine.placement import nvme_params as NP

    units, seen = [], []

    def held() -> int:
        return sum(u.shard.untyped_storage().nbytes() for u in units if u.shard is not None)

    real_init = NP.NvmeParams.__init__

    def init(self, us, *a, **kw):
        units.extend(us)
        real_init(self, us, *a, **kw)

    def sampled(fn):
        def wrapper(*a, **kw):
            seen.append(held())
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(NP.NvmeParams, "__init__", init)
    for cls, name in ((NV.ScratchFile, "read"), (NV.ScratchFile, "write"), (ShardedOptimizer, "_make_master")):
        monkeypatch.setattr(cls, name, sampled(getattr(cls, name)))
    torch.manual_seed(0)
    model = Stack()
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                        _cfg("nvme", optimizer, str(tmp_path), **STACK_UNITS), compute_dtype=dtype)
    seen.append(held())
    store = engine.partitioner.store
    unit_fp32 = max(u.layout.shard_numel for u in units if u.params) * 4
    total_fp32 = sum(u.layout.shard_numel for u in units if u.params) * 4
    monkeypatch.undo()
    assert len(seen) >= 40 * 2 and total_fp32 >= 40 * unit_fp32 * 0.9, (len(seen), total_fp32)
    assert max(seen) <= unit_fp32, (max(seen), unit_fp32, total_fp32)
    assert seen[-1] == 0 and store.on_disk_bytes() == engine.partitioner.shard_bytes()
    # the fp32 staging regions given back once every shard is cast
    assert os.path.getsize(store.file.path) == store.file_bytes
    for step in range(2):  # and the run is the same as one set up whole (bit for bit: the CPU parameter offload)
        engine.prepare_forward()
        model(torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).to(dtype)).backward()
        engine.step()
    torch.manual_seed(0)
    ref_model = Stack()
    ref = ZeroEngine(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-3),
                     _cfg(True, optimizer, str(tmp_path), **STACK_UNITS), compute_dtype=dtype)
    for step in range(2):
        ref.prepare_forward()
        ref_model(torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).to(dtype)).backward()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(engine.full_master_params(), ref.full_master_params()))
    engine.remove()
    ref.remove()
    assert swap_files(str(tmp_path)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_param_group_after_setup_takes_masters_from_the_shards_on_disk(tmp_path, dtype):
    """A group added between steps gets its masters from shards that are only in the file: read back one unit
    at a time, the same run as with the shards on the host."""
    out = {}
    for params in (True, "nvme"):
        torch.manual_seed(0)
        model = Stack(4, 16)
        opt = torch.optim.AdamW([p for layer in model.layers[:2] for p in layer.parameters()], lr=1e-2)
        engine = ZeroEngine(model, opt, _cfg(params, "nvme", str(tmp_path), **STACK_UNITS), compute_dtype=dtype)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": [p for layer in model.layers[2:] for p in layer.parameters()]})
            engine.prepare_forward()
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(dtype)).backward()
            engine.step()
        out[params] = [m.clone() for m in engine.full_master_params()]
        engine.remove()
    assert len(out["nvme"]) == 8 and all(torch.equal(a, b) for a, b in zip(out["nvme"], out[True]))
    assert swap_files(str(tmp_path)) == []


# -- Lightning: the preset, several fits in one process -----------------------------------------------------------
@pytest.mark.timeout(400)
def test_trainer_preset_zero3_offload_nvme_offloads_params_and_equals_zero3_offload(tmp_path, monkeypatch):
    from lightning.pytorch import Callback, Trainer

    from tests.helpers.lightning_models import ParityModule, load_rank_files, trainer_kwargs

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv(NV.NVME_PATH_ENV, str(scratch))  # inherited by the forked ranks

    class SeeScratchFiles(Callback):  # in the ranks: this rank's files while training (optimizer, parameters)
        def on_train_batch_end(self, trainer, *args):
            mine = sorted(f.split("-")[1] for f in os.listdir(scratch) if f"-rank{trainer.global_rank}-" in f)
            (tmp_path / f"seen{trainer.global_rank}").write_text(",".join(mine))

    res = {}
    for name in ("zero3_offload_nvme_fork", "zero3_offload_fork", "zero3_offload_nvme_fork"):  # two nvme fits
        trainer = Trainer(strategy=name, callbacks=[SeeScratchFiles()],
                          **trainer_kwargs(devices=2, max_steps=3, accum=2, clip=0.5))
        z = trainer.strategy.zero_config
        assert (z.offload_params, z.offload_optimizer) == (("nvme", "nvme") if "nvme" in name else (True, True))
        trainer.fit(ParityModule(str(tmp_path), tag=name))
        res.setdefault(name, []).append(load_rank_files(str(tmp_path), name, "train", 2))
        want = "optimizer,params" if "nvme" in name else ""
        assert [(tmp_path / f"seen{r}").read_text() for r in (0, 1)] == [want, want]
        assert os.listdir(scratch) == []  # removed at the strategy's teardown
    for runs in (res["zero3_offload_nvme_fork"][0], res["zero3_offload_nvme_fork"][1]):
        for nvme, cpu in zip(runs, res["zero3_offload_fork"][0]):
            assert nvme["losses"] == cpu["losses"]
            assert all(torch.equal(nvme["params"][k], cpu["params"][k]) for k in cpu["params"])
