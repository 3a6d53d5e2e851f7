"""bench/seed_table.py's low-precision state variants, run as a user types them: under a cap the model states
fill, bf16 moments + bf16 masters leave room for a larger micro-batch than fp32 states at zero3_bf16, and none
at zero3_offload_bf16, whose states live on the host (the table's cap is on device bytes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("zero3_bf16", "zero3_bf16_bf16moments_bf16masters", "zero3_offload_bf16",
           "zero3_offload_bf16_bf16moments_bf16masters")


@pytest.mark.timeout(300)
def test_seed_table_low_precision_states_fit_a_larger_batch(tmp_path):
    out = tmp_path / "seed.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "seed_table.py"), "--budget-mb", "2.5", "--methods", ",".join(METHODS),
           "--max-batch", "64", "--train-samples", "4", "--eval-samples", "4", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["raw"]["methods"]
    assert all("error" not in r and r["max_batch"] for r in rows.values()), rows
    fp32, low = rows["zero3_bf16"]["max_batch"], rows["zero3_bf16_bf16moments_bf16masters"]["max_batch"]
    assert low >= 1.3 * fp32, (fp32, low)
    assert rows["zero3_offload_bf16_bf16moments_bf16masters"]["max_batch"] == rows["zero3_offload_bf16"]["max_batch"]
    assert f"| {METHODS[-1]} |" in p.stdout  # the method column fits the longest name
