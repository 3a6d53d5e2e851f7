"""bench/pool_step_time.py in its tiniest setting, run as a user types it (both trees this checkout): every
method is timed in every child, and no ZeRO row holds a communication buffer after its backward."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_pool_step_time_bench_times_both_trees(tmp_path):
    out = tmp_path / "pool.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "pool_step_time.py"), "--before", str(ROOT), "--model", "t5_tiny",
           "--reps", "1", "--steps", "1", "--warmup", "1", "--batch", "1", "--src-len", "8", "--tgt-len", "4",
           "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=380)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    for tree in ("before", "after"):
        for m in ("fsdp2", "zero1", "zero2", "zero3"):
            row = s[tree][m]
            assert row["median_ms"] > 0 and row["vs_fsdp2"] > 0, (tree, m, row)
            assert row["comm_buffers"] == 0 and row["state_bytes"] > 0, (tree, m, row)
        assert s[tree]["zero3"]["state_bytes"] <= s[tree]["fsdp2"]["state_bytes"]
    assert "| zero3 |" in p.stdout
