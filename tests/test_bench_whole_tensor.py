"""bench/whole_tensor.py in its tiniest setting, run as a user types it: every default method trains, and the
bytes it reports are exact counts (the owner-rank step moves whole-tensor state onto owners without adding or
losing any, Muon keeps one buffer where AdamW keeps two) rather than estimates."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--vocab", "128", "--seq", "16", "--batch", "2",
        "--steps", "1", "--rounds", "1", "--warmup", "1"]


@pytest.mark.timeout(120)
def test_whole_tensor_bench_runs_every_method_and_counts_state_exactly(tmp_path):
    out = tmp_path / "whole_tensor.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "whole_tensor.py"), *TINY, "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    defaults = ("ddp/adamw", "ddp/muon", "ddp/adafactor", "zero1/adamw", "zero1/muon", "zero2/adamw", "zero2/muon",
                "zero3/adamw", "zero3/muon", "zero3_offload/adamw", "zero3_offload/muon", "zero2/adafactor",
                "zero3/adafactor")
    assert tuple(s) == defaults
    for m in defaults:
        assert f"| {m} |" in p.stdout
        assert s[m]["median_ms"] > 0 and s[m]["ratio_vs_ddp"] > 0

    # Muon keeps a momentum where AdamW keeps two moments: on the same split, 2 x Muon + AdamW's rest = all-AdamW
    ddp_muon = s["ddp/muon"]["state_by_optimizer_per_rank"][0]
    assert 2 * ddp_muon["Muon"] + ddp_muon["AdamW"] == s["ddp/adamw"]["state_bytes_per_rank"][0]

    # whole-tensor state lives whole on its owner: the ranks' bytes add up to one DDP rank's, to the byte
    for m in ("zero1/muon", "zero2/muon", "zero3/muon", "zero3_offload/muon"):
        assert sum(r["Muon"] for r in s[m]["state_by_optimizer_per_rank"]) == ddp_muon["Muon"], m
    for m in ("zero2/adafactor", "zero3/adafactor"):
        assert sum(s[m]["state_bytes_per_rank"]) == s["ddp/adafactor"]["state_bytes_per_rank"][0], m

    # the owner step's gather and scatter are all-to-alls on top of the elementwise traffic; AdamW has none
    for m, r in s.items():
        whole = m.split("/")[1] != "adamw" and not m.startswith("ddp")
        assert (min(r["owner_wire_bytes_per_rank"]) > 0) == whole, m
        assert (max(r["owner_whole_bytes_per_rank"]) > 0) == whole, m
        if whole:
            adamw = s[m.split("/")[0] + "/adamw"] if m.split("/")[0] + "/adamw" in s else None
            assert adamw is None or max(r["wire_bytes_per_rank"]) > max(adamw["wire_bytes_per_rank"]), m

    # the same optimizer trains the same model under DDP and ZeRO (Adafactor: fp32 throughout; Muon's
    # Newton-Schulz runs in bf16, where a last-bit gradient difference shows)
    for m, r in s.items():
        base = s["ddp/" + m.split("/")[1]]["final_loss"]
        rtol = 1e-6 if m.endswith("adafactor") or m.endswith("adamw") else 1e-4
        assert abs(r["final_loss"] - base) <= rtol * abs(base), (m, r["final_loss"], base)
