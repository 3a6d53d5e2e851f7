"""The estimator and the memory model under ``optimizer_state_dtype`` / ``master_dtype`` (bf16 moments, bf16 masters
with their compensation term): bytes counted by hand here from the model's sizes, the CLI's rows, the refusals."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
from torch import nn

from lightning_zero.engine import ZeroConfig
from lightning_zero.engine.plan import ShardingPlan
from lightning_zero.tools.cli import main as cli_main
from lightning_zero.tools.estimate import estimate_model_states
from lightning_zero.tools.model_sizes import ModelInfo

N = 2
ADAM = 8  # fp32 bytes of Adam's two moments per element


def _model() -> nn.Module:
    # every parameter's size even: the engine's per-parameter padding to a multiple of N = 2 adds nothing
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


PSI = 64 * 256 + 256 + 256 * 64 + 64  # 33,088
LARGEST = 256 * 64  # one parameter is never split across buckets


def _by_hand(stage: int, where: str, states: str, master: str) -> dict:
    """Bytes per rank, mixed precision (bf16 params and grads), Adam, N = 2, no accumulation (stage 1 holds
    gradient shards), counted from the table of the issue: params 2, grads 2, master fp32 4 | bf16 on the device
    2 (its compensation; the bf16 parameter is the master) | bf16 offloaded 2 + 2 (under NVMe the master in the
    file, its compensation in host memory), moments 8 | 4."""
    moments = ADAM if states == "fp32" else ADAM // 2
    master_b = 4 if master == "fp32" else (2 if where == "device" else 4)
    share = PSI / N
    params = 2 * (share if stage == 3 else PSI)
    grads = 2 * (PSI if stage == 0 else share)
    optim = (master_b + moments) * (PSI if stage == 0 else share)
    off = {"device": 0.0, "host": 0.0, "nvme": 0.0}
    off[where] += optim
    if where == "nvme" and master == "bf16":
        off["nvme"] -= 2 * share  # the compensation term: host memory
        off["host"] += 2 * share
    if stage == 3:
        off[where] += params  # the presets offload stage 3's parameter shards with the optimizer
    device = params + grads + optim - (off["host"] + off["nvme"])
    return {"device": device, "host": off["host"], "nvme": off["nvme"]}


SETTINGS = {"zero0": (0, "device"), "zero1": (1, "device"), "zero2": (2, "device"), "zero3": (3, "device"),
            "zero1_offload": (1, "host"), "zero2_offload": (2, "host"), "zero3_offload": (3, "host"),
            "zero2_offload_nvme": (2, "nvme"), "zero3_offload_nvme": (3, "nvme")}
VARIANTS = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]


@pytest.mark.parametrize("states,master", VARIANTS)
def test_model_states_per_setting_are_the_hand_counted_bytes(states, master):
    est = estimate_model_states(_model(), world_size=N, precision="bf16-mixed", optimizer="adamw",
                                optimizer_state_dtype=states, master_dtype=master)
    assert {r.setting for r in est.rows} == set(SETTINGS)
    for row in est.rows:
        stage, where = SETTINGS[row.setting]
        want = _by_hand(stage, where, states, master)
        got = {k: row.states[k] for k in want}
        assert got == pytest.approx(want, abs=0), (row.setting, states, master)
    # the target: stage 0 holds 16 bytes per parameter in mixed precision, 12 with bf16 moments, 10 with
    # bf16 masters too
    zero0 = est.row("zero0").states["device"] / PSI
    assert zero0 == {("fp32", "fp32"): 16, ("bf16", "fp32"): 12, ("bf16", "bf16"): 10}[(states, master)]


def test_the_comparison_rows_are_every_setting_at_each_dtype_pair():
    est = estimate_model_states(_model(), world_size=N, precision="bf16-mixed")
    got = {(r.setting, r.variant): r.states for r in est.state_dtype_rows}
    labels = {("fp32", "fp32"): "fp32", ("bf16", "fp32"): "bf16 moments", ("bf16", "bf16"): "bf16 moments+masters"}
    assert len(got) == len(SETTINGS) * 3
    for setting, (stage, where) in SETTINGS.items():
        for states, master in VARIANTS:
            want = _by_hand(stage, where, states, master)
            assert {k: got[setting, labels[states, master]][k] for k in want} == want, (setting, states, master)


def test_rows_carry_the_plan_the_run_builds_with_both_knobs():
    est = estimate_model_states(10**6, world_size=N, precision="bf16-mixed", optimizer_state_dtype="bf16",
                                master_dtype="bf16", settings=["zero2", "zero3_offload"])
    for row, knobs in zip(est.rows, (dict(stage=2), dict(stage=3, offload_optimizer=True, offload_params=True))):
        cfg = ZeroConfig(**knobs, optimizer_state_dtype="bf16", master_dtype="bf16")
        assert row.plan == ShardingPlan.of(cfg)
        assert (row.plan.optimizer_state_dtype, row.plan.master_dtype) == ("bf16", "bf16")


def test_the_step_transient_is_one_bucket_slice_widened_to_fp32():
    """Stages 0-2: the bucket is the cap or the largest parameter (never split), cut over N at stages 1-2; stage 3:
    the largest unit's row (or the root's). bf16 moments widen to 8 bytes per element, a bf16 master to 4 more."""
    bucket_mb = 0.05  # 13,107 fp32 elements: the largest parameter (16,384) is a bucket of its own
    base = estimate_model_states(_model(), world_size=N, precision="bf16-mixed", bucket_mb=bucket_mb)
    for states, master, per_element in (("bf16", "fp32", 8), ("bf16", "bf16", 12)):
        est = estimate_model_states(_model(), world_size=N, precision="bf16-mixed", bucket_mb=bucket_mb,
                                    optimizer_state_dtype=states, master_dtype=master)
        for row, ref in zip(est.rows, base.rows):
            stage, where = SETTINGS[row.setting]
            if stage == 3:
                continue  # units: below, with sizes given by hand
            elements = LARGEST if stage == 0 else LARGEST // N
            transient = per_element * elements
            if where == "device":
                assert row.buffers["step"] - ref.buffers["step"] == transient, row.setting
            else:  # the step runs on the host: its transient is host memory beside the (smaller) states
                assert _host_besides_states(row) - _host_besides_states(ref) == transient, row.setting
                assert row.buffers["step"] == ref.buffers["step"], row.setting
        by_variant = {(r.setting, r.variant): r for r in est.state_dtype_rows}
        label = "bf16 moments" if master == "fp32" else "bf16 moments+masters"
        assert by_variant["zero2", label].transient == per_element * LARGEST // N
        assert by_variant["zero2", "fp32"].transient == 0
    units = ModelInfo(numel=10_000, trainable=10_000, largest_param=1_000, largest_unit=3_000, root_unit=1_000)
    est = estimate_model_states(units, world_size=N, precision="bf16-mixed", settings=["zero3", "zero3_offload"],
                                optimizer_state_dtype="bf16", master_dtype="bf16")
    base = estimate_model_states(units, world_size=N, precision="bf16-mixed", settings=["zero3", "zero3_offload"])
    assert est.rows[0].buffers["step"] - base.rows[0].buffers["step"] == 12 * 3_000 // N
    assert _host_besides_states(est.rows[1]) - _host_besides_states(base.rows[1]) == 12 * 3_000 // N


def _host_besides_states(row) -> float:
    """A row's host bytes but its model states and the NVMe ring streaming them (both smaller in bf16)."""
    return row.host_per_rank - row.states["host"] - row.nvme_ring


def test_floor_reads_the_plan_dtypes():
    """``model_state_floor`` (the table's exact Psi / N) takes the knobs as ZeroConfig spells them."""
    from lightning_zero.engine import model_state_floor

    f = model_state_floor(3, 4000, 4, True, 8, optimizer_state_dtype="bf16", master_dtype="bf16")
    assert f["device"] == (2 + 2 + 2 + 4) * 4000 / 4 and f["optimizer"] == (2 + 4) * 4000 / 4
    f = model_state_floor(2, 4000, 4, True, 8, offload_optimizer=True, optimizer_state_dtype="bf16",
                          master_dtype="bf16")
    assert f["device"] == 2 * 4000 + 2 * 4000 / 4 and f["host"] == (2 + 2 + 4) * 4000 / 4
    with pytest.raises(ValueError, match=r"master_dtype='bf16' needs bf16 compute"):
        model_state_floor(2, 4000, 4, False, 8, master_dtype="bf16")
    with pytest.raises(ValueError, match=r"optimizer_state_dtype must be 'fp32' \(default\) or 'bf16'; got 'bfloat'"):
        model_state_floor(2, 4000, 4, True, 8, optimizer_state_dtype="bfloat")


def _table(out: str, header: str) -> dict:
    """``{(setting, states label): cells}`` of the table whose header line starts with ``header``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        rows[cells[0], cells[1]] = cells[2:]
    return rows


def test_cli_estimate_shows_the_state_dtype_rows(capsys):
    assert cli_main(["estimate", "--params", "1e9", "--ranks", "2", "--precision", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    rows = _table(out, "| setting            | states")
    assert len(rows) == 27
    # B/param device, host, NVMe at N = 2 without accumulation (stage 1 holds gradient shards)
    assert rows["zero0", "fp32"][:3] == ["16.00", "0.00", "0.00"]
    assert rows["zero0", "bf16 moments"][:3] == ["12.00", "0.00", "0.00"]
    assert rows["zero0", "bf16 moments+masters"][:3] == ["10.00", "0.00", "0.00"]
    assert rows["zero2", "bf16 moments+masters"][:3] == ["6.00", "0.00", "0.00"]  # 2 + 1 + (2 + 4) / 2
    assert rows["zero3", "bf16 moments+masters"][:3] == ["5.00", "0.00", "0.00"]  # (2 + 2 + 2 + 4) / 2
    assert rows["zero2_offload", "bf16 moments+masters"][:3] == ["3.00", "4.00", "0.00"]  # host: (2 + 2 + 4) / 2
    assert rows["zero3_offload_nvme", "bf16 moments"][:3] == ["1.00", "0.00", "5.00"]  # NVMe: 1 + (4 + 4) / 2
    assert rows["zero2", "fp32"][-1] == "-" and rows["zero2", "bf16 moments"][-1].endswith(" device")
    assert rows["zero2_offload", "bf16 moments"][-1].endswith(" host")
    # the main table takes the knobs: zero2's device states 6 bytes per parameter = 5.59 GiB
    assert cli_main(["estimate", "--params", "1e9", "--ranks", "2", "--precision", "bf16-mixed", "--settings", "zero2",
                     "--optimizer-state-dtype", "bf16", "--master-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "optimizer_state_dtype bf16, master_dtype bf16" in out
    main = _table(out, "| setting ")
    assert main["zero2", "2"][4] == "5.59"
    # fp32 compute: no bf16-master rows, and the reason
    assert cli_main(["estimate", "--params", "1e9", "--ranks", "2", "--settings", "zero2"]) == 0
    out = capsys.readouterr().out
    assert set(_table(out, "| setting | states")) == {("zero2", "fp32"), ("zero2", "bf16 moments")}
    assert "bf16 moments+masters: needs bf16 compute (--precision bf16-mixed)" in out


@pytest.mark.parametrize("argv,message", [
    (["--master-dtype", "bf16"], r"master_dtype='bf16' \(--master-dtype\) needs bf16 compute; got precision "
                                 r"'32-true'\. Allowed: --master-dtype bf16 with --precision bf16-mixed"),
    (["--master-dtype", "bf16", "--precision", "16-mixed"], r"needs bf16 compute; got precision '16-mixed'"),
])
def test_cli_refuses_what_the_run_refuses(capsys, argv, message):
    assert cli_main(["estimate", "--params", "1e6", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_offers_fp32_and_bf16_only(capsys):
    with pytest.raises(SystemExit):
        cli_main(["estimate", "--params", "1e6", "--optimizer-state-dtype", "fp16"])
    assert "--optimizer-state-dtype: invalid choice: 'fp16' (choose from" in capsys.readouterr().err


def test_whole_tensor_optimizers_take_neither_knob():
    with pytest.raises(ValueError, match=r"whole-tensor optimizer \(muon, adafactor\) .* the run refuses them"):
        estimate_model_states("t5_tiny", optimizer="muon", precision="bf16-mixed", optimizer_state_dtype="bf16")
    with pytest.raises(ValueError, match=r"optimizer_state_dtype \(--optimizer-state-dtype\) must be 'fp32' "
                                         r"\(default\) or 'bf16'; got 'fp16'"):
        estimate_model_states(10**6, optimizer_state_dtype="fp16")
    est = estimate_model_states("t5_tiny", optimizer="muon", precision="bf16-mixed", settings=["zero2"])
    assert est.state_dtype_rows == [] and "the run refuses bf16 states or masters with it" in str(est)


def test_dtype_rows_replace_only_the_dtypes():
    est = estimate_model_states(10**6, world_size=N, precision="bf16-mixed", settings=["zero3_offload"])
    plans = {r.variant: r.plan for r in est.state_dtype_rows}
    assert plans["fp32"] == est.rows[0].plan
    assert plans["bf16 moments+masters"] == dataclasses.replace(est.rows[0].plan, optimizer_state_dtype="bf16",
                                                                master_dtype="bf16")


# -- against the engine: what a rank really holds (memory_report counts tensor bytes) ---------------------------------
MEASURED = [(name, states, master) for name in SETTINGS for states, master in VARIANTS[1:]]


def _measure(rank, world_size):
    import tempfile

    import torch

    from lightning_zero.engine import ZeroEngine
    from lightning_zero.engine.config import PRESETS

    out = {}
    for name, states, master in MEASURED:
        torch.manual_seed(0)
        model = _model()
        nvme = "nvme" in (PRESETS[name].get("offload_optimizer"), PRESETS[name].get("offload_params"))
        cfg = ZeroConfig(**PRESETS[name], bucket_mb=0.05, nvme_path=tempfile.gettempdir() if nvme else None,
                         optimizer_state_dtype=states, master_dtype=master)
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg, compute_dtype=torch.bfloat16)
        x = torch.randn(8, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rank))
        model(x).float().pow(2).mean().backward()
        engine.step()  # creates the (bf16) moments
        with engine.no_sync():  # stages 0-1 hold full gradients through accumulation
            model(x).float().pow(2).mean().backward()
        rep = engine.memory_report().as_dict()
        out[name, states, master] = {"device": rep["model_states"] - rep["host"] - rep["nvme"], "host": rep["host"],
                                     "nvme": rep["nvme"]}
        masters = [m for s in engine.shardeds for row in s.masters for m in row]
        out[name, states, master, "master dtypes"] = {str(m.dtype) for m in masters}
        engine.remove(hand_back=False)
    return out


@functools.lru_cache(maxsize=None)
def _measured() -> list:
    from tests.helpers.dist_utils import run_distributed

    return run_distributed(_measure, N)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", MEASURED, ids="-".join)
def test_estimate_is_what_the_engine_holds_with_bf16_states(case):
    """Every preset at bf16 moments and at bf16 moments + masters, 2 gloo ranks, bf16 compute, accumulating: the
    estimator's device / host / NVMe bytes are the engine's tensor bytes (the bf16 master aliased to the bf16
    parameter beside device states, a copy of its own with its compensation where the step runs on the host)."""
    name, states, master = case
    est = estimate_model_states(_model(), world_size=N, precision="bf16-mixed", grad_accumulation=2,
                                optimizer_state_dtype=states, master_dtype=master, settings=[name])
    for per_rank in _measured():
        got = per_rank[case]
        assert got == {k: est.rows[0].states[k] for k in got}, case


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_bf16_masters_are_bf16_between_steps(name):
    """What the rows count: between steps a bf16 master is a bf16 tensor (its fp32 value is rebuilt only inside its
    bucket's step, and for checkpoints)."""
    for per_rank in _measured():
        assert per_rank[name, "bf16", "bf16", "master dtypes"] == {"torch.bfloat16"}, name
