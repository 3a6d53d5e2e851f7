"""The autotuner (lightning_zero.tools.tuning) on CPU: byte budgets around the model-state floors of t5_tiny."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from lightning_zero.tools.cli import main as cli_main
from lightning_zero.tools.estimate import MiB, info_from_t5, model_state_bytes, t5_dims
from lightning_zero.tools.t5_dims import RECIPE_VOCAB
from lightning_zero.tools.tuning import tune

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
# short sequences keep the activations of one sample below the gap between two floors
EXPERIMENT = ["model=t5_tiny", "data.max_source_len=16", "data.max_target_len=8", "trainer.devices=2"]


def _floors(accumulating=True):
    info = info_from_t5(t5_dims("t5_tiny", vocab_size=RECIPE_VOCAB))  # the vocabulary tune measures
    return {s: model_state_bytes(info, s, False, 2, False, 8, accumulating)["device"] for s in (0, 1, 2, 3)}


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    import t5_config  # noqa: F401  (registers the recipe's schema)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("t5_finetune", overrides=overrides)


def _check_recipe_accepts(path: Path, stage: int, batch: int):
    from t5_config import build_strategy, validate_schema

    lines = path.read_text().split()
    cfg = _compose(lines)  # exactly what `python examples/t5_finetune.py $(cat tuned.overrides)` composes
    validate_schema(cfg)
    assert cfg.strategy.stage == stage and cfg.data.batch_size == batch and cfg.model.preset == "t5_tiny"
    assert build_strategy(cfg).stage == stage


def test_budget_between_stage2_and_stage1_floors_picks_stage2_or_3(tmp_path):
    f = _floors()
    budget = f[2] + 0.9 * (f[1] - f[2])  # stage 1 keeps full gradients while accumulating: its floor
    out = tmp_path / "tuned.overrides"
    res = tune(EXPERIMENT + ["trainer.accumulate_grad_batches=2"], memory_mb=budget / MiB, out=str(out),
               offload="no", max_batch=8, steps=2, prefilter=False)  # stages 0-1 are measured, not estimated
    by = {c.setting: c for c in res.candidates}
    assert set(by) == {"zero0", "zero1", "zero2", "zero3"}
    for name in ("zero0", "zero1"):
        assert by[name].status == "rejected" and "measured peak" in by[name].reason, by[name]
        assert by[name].probes[0][2] > budget  # the measured peak at micro-batch 1 is over the budget
    assert res.best is not None and res.best.stage in (2, 3) and res.best.max_batch >= 1
    assert res.best.peak_bytes <= budget
    _check_recipe_accepts(out, res.best.stage, res.best.max_batch)
    assert "trainer.accumulate_grad_batches=2" in out.read_text()


def test_ample_budget_picks_the_fastest_measured(tmp_path, capsys):
    out, js = tmp_path / "best.overrides", tmp_path / "tune.json"
    rc = cli_main(["tune", "--memory-mb", "64", "--out", str(out), "--json", str(js), "--max-batch", "4",
                   "--steps", "2", *EXPERIMENT, "strategy=zero3", "data.batch_size=3", "strategy.bucket_mb=5"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| rank | setting" in text and "best: " in text
    data = json.loads(js.read_text())
    rows = data["candidates"]
    assert {r["setting"] for r in rows} == {"zero0", "zero1", "zero1_offload", "zero2", "zero2_offload", "zero3",
                                            "zero3_offload"}
    assert all(r["status"] == "ranked" and r["max_batch"] == 4 for r in rows), rows
    best = max(rows, key=lambda r: r["samples_per_s"])  # the argmax of its own measured table
    assert f"best: {best['setting']} at micro-batch 4" in text
    lines = out.read_text().split()
    assert lines[-2:] == [f"strategy={best['setting']}", "data.batch_size=4"]
    assert "strategy=zero3" not in lines[:-2] and "data.batch_size=3" not in lines  # decided by the tuner
    assert "strategy.bucket_mb=5" in lines  # the user's other overrides are kept
    _check_recipe_accepts(out, best["stage"], 4)
    assert _compose(lines).strategy.bucket_mb == 5.0


@pytest.mark.parametrize("model,offload,fraction,expect", [
    ("t5_small", "no", 0.9, r"more ranks: zero3 on >= 4 ranks"),
    ("t5_small", "both", 0.95, r"more ranks: zero3_offload on >= \d+ ranks"),
    ("t5_tiny", "both", 0.5, r"more ranks alone do not help: .* need [\d.]+ MiB per rank"),
])
def test_budget_below_every_floor_says_what_would_fit(tmp_path, model, offload, fraction, expect):
    info = info_from_t5(t5_dims(model, vocab_size=RECIPE_VOCAB))
    lowest = min(model_state_bytes(info, 3, o, 2, False, 8)["device"] for o in ((False,) if offload == "no"
                                                                               else (False, True)))
    out = tmp_path / "tuned.overrides"
    overrides = [o for o in EXPERIMENT if not o.startswith("model=")] + [f"model={model}"]
    res = tune(overrides, memory_mb=fraction * lowest / MiB, out=str(out), offload=offload)
    assert res.best is None and not out.exists()
    assert all(c.status == "rejected" and "model states alone need" in c.reason for c in res.candidates)
    msg = res.message
    assert "NOTHING FITS" in msg and "on 2 rank(s)" in msg and "What would fit" in msg
    assert re.search(expect, msg), msg
    assert ("offload: zero3_offload keeps only" in msg) == (offload == "no")
    assert "a cap of >= " in msg and "bf16-mixed" in msg  # fp32 run: half precision is another way in
    rc = cli_main(["tune", "--memory-mb", f"{fraction * lowest / MiB}", "--offload", offload, "--out", str(out),
                   *overrides])
    assert rc == 1 and not out.exists()
