"""bench/model_states.py in its tiniest setting, run as a user types it: between steps every tensor a rank
holds is what the table reports (the engine keeps no communication buffer and no fp32 copy of a bf16 master),
stage 3 holds no more than FSDP2, and bf16 moments + masters cut the mixed-precision states to 10 bytes per
parameter element (2 param + 2 gradient + 2 compensation + 4 moments) from 16."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("fsdp2", "zero3", "zero3_bf16", "zero3_bf16_bf16moments_bf16masters",
           "zero2_offload_bf16_bf16moments_bf16masters")
# the live count also sees the last batch and loss (a few hundred bytes): nothing like a shard (~350 KiB here)
SLACK = 4096


@pytest.mark.timeout(600)
def test_model_states_bench_counts_every_tensor_a_rank_holds(tmp_path):
    out = tmp_path / "model_states.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "model_states.py"), "--model", "t5_tiny", "--steps", "1",
           "--methods", ",".join(METHODS), "--before", str(ROOT), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=580)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["raw"]["methods"]
    assert tuple(rows) == METHODS and all("error" not in r for r in rows.values()), rows
    numel = rows["zero3"]["numel"]
    for m, r in rows.items():
        assert f"| {m} |" in p.stdout
        step = r["after_step"]
        assert 0 <= step["live"] - step["total"] <= SLACK, (m, step)  # every tensor held is in the table
        if m != "fsdp2":
            assert r["after_backward"]["buffers"] == step["buffers"] == 0, m  # no pool held between phases
    # --before: the rows without the new knobs ran again in a child on the tree given (here: this one)
    assert set(data["before"]["methods"]) == {"zero3", "zero3_bf16"}
    assert data["before"]["methods"]["zero3"]["after_step"]["total"] == rows["zero3"]["after_step"]["total"]
    assert "->" in next(line for line in p.stdout.splitlines() if line.startswith("| zero3 |"))

    for pt in ("after_backward", "after_step"):
        assert rows["zero3"][pt]["total"] <= rows["fsdp2"][pt]["total"], pt
    # per element at stage 3 (everything sharded over 2 ranks): bytes per rank x 2 / Psi, within the shards' padding
    per_element = {m: rows[m]["after_backward"]["total"] * 2 / numel
                   for m in ("zero3_bf16", "zero3_bf16_bf16moments_bf16masters")}
    assert per_element["zero3_bf16"] == pytest.approx(16, abs=0.05)  # 2 + 2 + 4 master + 8 moments
    assert per_element["zero3_bf16_bf16moments_bf16masters"] == pytest.approx(10, abs=0.05)  # 2 + 2 + 2 + 4
    offload = rows["zero2_offload_bf16_bf16moments_bf16masters"]["after_step"]
    assert offload["host"] > 0 and offload["device"] + offload["host"] == offload["total"]
