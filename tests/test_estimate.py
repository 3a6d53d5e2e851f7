"""The memory estimator (lightning_zero.tools.estimate) against what the engine really holds, and its CLI."""

from __future__ import annotations

import functools
import tempfile
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zero.tools.cli import main as cli_main
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.tools.estimate import SETTINGS, estimate_model_states, info_from_module, model_state_bytes, t5_dims
from lightning_zero.tools.t5_dims import t5_presets
from tests.helpers.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))


CASES = [(stage, offload, dtype) for (stage, offload) in SETTINGS for dtype in ("float32", "bfloat16")]


def _measure(rank, world_size, stage, offload, dtype_name):
    dtype = getattr(torch, dtype_name)
    model = _model()
    info = info_from_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the presets' rule: zero3_offload_nvme keeps the parameter shards on NVMe too
    params = (offload if offload == "nvme" else bool(offload)) if stage == 3 else False
    cfg = ZeroConfig(stage=stage, offload_optimizer=offload, offload_params=params,
                     bucket_mb=0.05, nvme_path=tempfile.gettempdir() if offload == "nvme" else None)
    engine = ZeroEngine(model, opt, cfg, compute_dtype=dtype)
    x = torch.randn(8, 64, dtype=dtype, generator=torch.Generator().manual_seed(rank))
    model(x).float().pow(2).mean().backward()
    engine.step()  # creates the optimizer state
    with engine.no_sync():  # stages 0-1 hold full gradients through accumulation
        model(x).float().pow(2).mean().backward()
    rep = engine.memory_report().as_dict()
    engine.sharded.make_resident()  # offload_optimizer="nvme": the masters back from the file, to be counted
    rep["separate_master_storage"] = _separate_master_bytes(engine)
    engine.remove(hand_back=False)
    return info, rep


def _separate_master_bytes(engine) -> int:
    """fp32 master bytes counted from storages, independently of memory_report(): a master sharing storage
    with a parameter or a stage-3 unit shard costs nothing; every other storage counts once."""
    others = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    if engine.partitioner is not None:
        others |= {u.shard.untyped_storage().data_ptr() for u in engine.partitioner.units if u.shard is not None}
    seen, total = set(), 0
    for m in (m for row in engine.sharded.masters for m in row):
        ptr = m.untyped_storage().data_ptr()
        if ptr not in others and ptr not in seen:
            seen.add(ptr)
            total += m.untyped_storage().nbytes()
    return total


def _all_cases(rank, world_size):
    return {c: _measure(rank, world_size, *c) for c in CASES}


@functools.lru_cache(maxsize=None)
def _run(world_size):
    return [_all_cases(0, 1)] if world_size == 1 else run_distributed(_all_cases, world_size)


@pytest.mark.parametrize("world_size", [1, 2])
def test_model_states_match_engine_accounting(world_size):
    for per_rank in _run(world_size):
        for (stage, offload, dtype), (info, rep) in per_rank.items():
            est = model_state_bytes(info, stage, offload, world_size, dtype != "float32", state_bytes=8)
            # the engine's own count of masters is the storages' (mixed precision + stage 3 + offload_params:
            # the fp32 masters are separate from the bf16 unit shards, never counted as aliases)
            assert rep["master"] == rep["separate_master_storage"], (stage, offload, dtype, rep)
            measured = {"device": rep["model_states"] - rep["host"] - rep["nvme"], "host": rep["host"],
                        "nvme": rep["nvme"], "model_states": rep["model_states"]}
            for key, got in measured.items():
                assert abs(est[key] - got) <= 0.05 * max(got, 1), (stage, offload, dtype, key, est, rep)
            assert (est["host"] + est["nvme"] > 0) == bool(offload)
            assert (rep["nvme"] > 0) == (offload == "nvme")


def test_param_count_of_presets_without_building_weights():
    from transformers import T5Config, T5ForConditionalGeneration

    for name, vocab in (("t5_tiny", 259), ("t5_small", 259), ("t5_small", None)):
        d = t5_dims(name, vocab_size=vocab)
        cfg = T5Config(**{k: v for k, v in t5_presets()[name].items() if k != "vocab_size"},
                       vocab_size=d.vocab_size, feed_forward_proj="relu", tie_word_embeddings=True)
        with torch.device("meta"):
            n = sum(p.numel() for p in T5ForConditionalGeneration(cfg).parameters())
        assert d.numel == n
    # a module and its preset give the same estimate (the preset at the recipe's default vocabulary)
    from lightning_zero.tools.t5_dims import RECIPE_VOCAB

    with torch.device("meta"):
        dims = {**t5_presets()["t5_tiny"], "vocab_size": RECIPE_VOCAB}
        m = T5ForConditionalGeneration(T5Config(**dims, feed_forward_proj="relu"))
    a = estimate_model_states(m, world_size=2).row("zero3")
    b = estimate_model_states("t5_tiny", world_size=2).row("zero3")
    assert a.states == b.states and a.buffers == b.buffers


def test_activation_formula_is_calibrated_on_t5_tiny():
    """The T5 activation formula against the harness's saved-tensor measurement (docs/tuning.md)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from t5_module import make_t5_config  # noqa: E402
    from transformers import T5ForConditionalGeneration

    from lightning_zero.tools.estimate import t5_activation_bytes
    from lightning_zero.tools.tuning.harness import SavedBytes

    for dtype, p in ((torch.float32, 0.0), (torch.bfloat16, 0.1)):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(make_t5_config("t5_tiny", dropout_rate=p, vocab_size=259)).to(dtype)
        x, y = torch.randint(2, 259, (4, 32)), torch.randint(2, 259, (4, 16))
        saved = SavedBytes(model.parameters())
        with saved.hooks():
            model(input_ids=x, attention_mask=torch.ones_like(x), labels=y).loss.backward()
        est = t5_activation_bytes(t5_dims("t5_tiny", vocab_size=259, dropout_rate=p), 4, 32, 16, dtype != torch.float32)
        assert abs(est - saved.bytes) <= 0.05 * saved.bytes, (dtype, p, est, saved.bytes)


def test_fits_and_suggestions():
    est = estimate_model_states("t5_large", world_size=8, precision="bf16-mixed", batch_size=16, src_len=512,
                                tgt_len=128, device_memory_gb=24)
    assert est.row("zero0").fits is False and est.row("zero3").fits
    text = str(est)
    assert "FITS in 24 GiB per device" in text and "Does not fit: zero0" in text
    tiny = estimate_model_states("t5_3b", world_size=1, device_memory_gb=8)
    assert tiny.fitting() == []
    text = str(tiny)
    assert "NOTHING FITS" in text and "zero3 on >= " in text and "ranks" in text


def test_cli_estimate(capsys):
    assert cli_main(["estimate", "--model", "t5_small", "--ranks", "4", "--precision", "bf16-mixed",
                     "--batch-size", "16", "--src-len", "128", "--tgt-len", "64", "--device-memory", "2"]) == 0
    out = capsys.readouterr().out
    # the recipe's 2048-token vocabulary by default: 44,189,696 at 259 tokens + (2048 - 259) x d_model 512
    assert "Psi = 45,105,664 params" in out and "| zero3_offload " in out and "FITS in 2 GiB" in out
    assert cli_main(["estimate", "--model", "t5_small", "--vocab", "259"]) == 0
    assert "Psi = 44,189,696 params" in capsys.readouterr().out
    assert cli_main(["estimate", "--params", "1.5e9", "--ranks", "16", "--nodes", "2", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "8 rank(s) per node" in out and "K = 0" in out
    assert cli_main(["estimate", "--params", "350M", "--ranks", "2", "--grad-accum", "4", "--settings", "zero1,zero2"]) == 0
    out = capsys.readouterr().out
    main_table = out.split("host/rank:")[0]  # the state-dtype table below it has rows per setting too
    rows = {line.split("|")[1].strip(): line.split("|")[5].strip() for line in main_table.splitlines() if "| zero" in line}
    assert set(rows) == {"zero1", "zero2"} and float(rows["zero1"]) > float(rows["zero2"])  # full grads while accumulating
    assert cli_main(["estimate", "--model", "t5_huge"]) == 2


def test_nvme_rows_put_the_offloaded_states_on_disk_and_state_the_bandwidth_they_need():
    est = estimate_model_states("t5_3b", world_size=8, num_nodes=1, precision="bf16-mixed", nvme_step_time=10.0)
    for stage in (2, 3):
        nvme, cpu = est.row(f"zero{stage}_offload_nvme"), est.row(f"zero{stage}_offload")
        optimizer = cpu.states["master"] + cpu.states["optimizer_state"]  # what the CPU twin keeps in host memory
        moved, per_step = optimizer, 2 * optimizer  # read + written once per step
        if stage == 3:  # the preset puts the parameter shards on NVMe too (deepspeed_stage_3_offload_nvme)
            params, kept = cpu.states["params"], 2 * (est.info.root_unit + est.info.last_unit) / 8
            moved += params
            # read for forward and backward (the root and the last decoder block once), written once
            per_step += 3 * params - kept
        assert nvme.nvme_per_rank == nvme.states["nvme"] == moved > 0
        assert nvme.nvme_moved_per_step == pytest.approx(per_step)
        assert nvme.states["device"] == cpu.states["device"] and nvme.peak_device == cpu.peak_device
        assert nvme.host_per_rank < cpu.host_per_rank  # the ring and the gradient copies, not the states
        gbs = per_step * 8 / 10.0 / 1e9  # 8 ranks on the node, a 10 s step
        assert f"zero{stage}_offload_nvme" in str(est) and f"{gbs:.2f} GB/s per node" in str(est)
    assert any(ln.startswith("| setting") and "| NVMe/rank |" in ln for ln in str(est).splitlines())


class _WithRoot(nn.Module):
    """Linear units and a parameter of the root's own (gathered once per step, kept through backward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64))
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x):
        return (self.layers(x) * self.scale).float().pow(2).mean()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_nvme_bytes_per_step_are_what_the_engine_reads_and_writes(tmp_path, monkeypatch, precision):
    """zero3_offload_nvme's bandwidth line against the bytes the engine's scratch files are asked for in a
    step (ScratchFile.read / write counted): the parameter shards read twice (the root's and the last unit's
    once) and written once, the masters + state read and written once."""
    from lightning_zero.engine.placement import nvme as NV

    model, mixed = _WithRoot(), precision != "32-true"
    dtype = torch.bfloat16 if mixed else torch.float32
    cfg = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", unit_classes=["Linear"],
                     persist_numel=0, bucket_mb=0.05, nvme_path=str(tmp_path))
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg, compute_dtype=dtype)
    moved = {"read": 0, "write": 0}
    real_read, real_write = NV.ScratchFile.read, NV.ScratchFile.write

    def counted(op, real):
        def io(self, buf, offset, *blocks):
            moved[op] += buf.numel() * buf.element_size()
            return real(self, buf, offset, *blocks)
        return io

    monkeypatch.setattr(NV.ScratchFile, "read", counted("read", real_read))
    monkeypatch.setattr(NV.ScratchFile, "write", counted("write", real_write))
    per_step = []
    for step in range(3):  # the first creates the optimizer state and records the order
        before = sum(moved.values())
        engine.prepare_forward()
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step)).to(dtype)).backward()
        engine.step()
        per_step.append(sum(moved.values()) - before)
    engine.remove(hand_back=False)
    info = info_from_module(_WithRoot(), unit_classes=["Linear"])
    assert info.root_unit == 64  # the root holds a parameter: read once per step
    assert info.last_unit == 128 * 64 + 64  # the last Linear: kept gathered into its backward, read once
    row = estimate_model_states(info, precision=precision, settings=["zero3_offload_nvme"]).rows[0]
    assert per_step[1] == per_step[2] == row.nvme_moved_per_step > 2 * row.nvme_per_rank, (per_step, row)
    line = str(estimate_model_states(info, precision=precision, settings=["zero3_offload_nvme"], nvme_step_time=1e-6))
    assert f"{per_step[2] / 1e-6 / 1e9:.2f} GB/s per node" in line


def test_every_row_is_the_plan_the_run_builds():
    """The estimator's rows come from the presets' sharding plans, placement included ([Note: placement]): the
    plan a run of each preset builds from its ZeroConfig, not a re-derivation of the stage rules."""
    from lightning_zero.engine.config import PRESETS
    from lightning_zero.engine.plan import ShardingPlan

    est = estimate_model_states(10**6, world_size=2)
    assert [r.setting for r in est.rows] == list(PRESETS)
    for row in est.rows:
        knobs = dict(PRESETS[row.setting])
        if "nvme" in (knobs.get("offload_optimizer"), knobs.get("offload_params")):
            knobs["nvme_path"] = "/on/the/training/machine"  # checked where the run starts
        assert row.plan == ShardingPlan.of(ZeroConfig.for_another_machine(**knobs)), row.setting
