"""bench/checkpoint_stall.py in its tiniest setting, run as a user types it: every (method, mode) row of the table
is filled from measurements (the save stalls, steps, loops, background writes and peak RSS vary from save to save
and run to run; no figure is a constant), the checkpoints were really written, and a wrong mode is one clear error
before any rank starts."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("zero1", "zero3_offload")
MODES = ("none", "sync", "async")
STEPS, EVERY, ROUNDS = 4, 2, 2
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def bench(*argv, timeout=360):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "checkpoint_stall.py"), *argv],
                          capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.mark.timeout(400)
def test_checkpoint_stall_bench_measures_every_row(tmp_path):
    out = tmp_path / "stall.json"
    p = bench("--model", "t5_tiny", "--steps", str(STEPS), "--every", str(EVERY), "--rounds", str(ROUNDS),
              "--batch", "1", "--src-len", "8", "--tgt-len", "4", "--methods", ",".join(METHODS),
              "--modes", ",".join(MODES), "--ckpt-root", str(tmp_path), "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    s, runs = data["summary"], data["runs"]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| zero")]
    assert [tuple(c.strip() for c in r.split("|")[1:3]) for r in rows] == [(m, mode) for m in METHODS for mode in MODES]
    assert not any("FAILED" in r for r in rows), rows
    saves = STEPS // EVERY
    for m in METHODS:
        for mode in MODES:
            row, reps = s[m][mode], runs[m][mode]
            assert row["rounds"] == ROUNDS and len(reps) == ROUNDS, (m, mode, row)
            for key in ("step_s", "step_after_save_s", "loop_s", "peak_rss"):
                assert math.isfinite(row[key]) and row[key] > 0, (m, mode, key, row)
            for r in reps:
                assert len(r["steps_s"]) == STEPS and len(set(r["steps_s"])) == STEPS, r  # every step timed
                assert r["after_save"] == list(range(EVERY, STEPS, EVERY))
            assert len({r["peak_rss"] for r in reps}) == ROUNDS  # read from each run's own process
            if mode == "none":
                assert row["saves"] == 0 and all(r["stalls_s"] == [] for r in reps)
                continue
            stalls = [x for r in reps for x in r["stalls_s"]]
            assert len(stalls) == row["saves"] == saves * ROUNDS and len(set(stalls)) == len(stalls), stalls
            assert 0 < row["stall_s"] <= row["stall_max_s"] == max(stalls)
            # async: the strategy's saver recorded each save's wait and its write in the background; sync: none
            for key in ("waited_s", "written_s"):
                got = [x for r in reps for x in r[key]]
                assert len(got) == (len(stalls) if mode == "async" else 0), (mode, key, got)
            if mode == "async":
                assert all(0 <= w <= s for r in reps for w, s in zip(r["waited_s"], r["stalls_s"]))
                assert len(set(r["written_s"][0] for r in reps)) == ROUNDS and row["written_s"] > 0
            # every save was a complete directory, measured (the runs' directories are removed afterwards)
            assert all(r["saves"] == [f"step{i}" for i in range(EVERY, STEPS + 1, EVERY)] for r in reps)
            assert row["ckpt_bytes"] > 0
            assert math.isfinite(row["overhead_per_save_s"])
            assert all(r["loop_s"] > sum(r["stalls_s"]) for r in reps)  # the loop holds its saves' stalls
    assert not list(tmp_path.glob("stall-*"))  # no checkpoint left behind


def test_checkpoint_stall_bench_refuses_a_wrong_mode_before_starting_ranks():
    p = bench("--modes", "sync,later", timeout=120)
    assert p.returncode == 2
    assert "--modes 'sync,later': unknown ['later']; allowed: none, sync, async" in p.stderr
    assert "round 1/" not in p.stderr  # no run started
