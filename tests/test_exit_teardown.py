"""Process groups are destroyed at exit whatever the backend (``destroy_groups_at_exit``, engine/elastic.py).

A gloo group left to the interpreter's own teardown aborts the process now and then after training
finished ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489) — a torchrun
job then reports a failed worker after a complete run (seen in CI on tests/test_lifecycle.py). The abort
itself is a race too rare to provoke on demand, so this asserts its precondition away: by the time the
user's own first atexit handler runs, under torchrun, after a Trainer fit and after a Fabric loop, no
process group is left. Before the fix (Lightning registers its teardown for NCCL only) both rank files
said ``initialized=True``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.tools.launch import free_port

SCRIPT = Path(__file__).parent / "scripts" / "exit_teardown.py"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_a_torchrun_job_leaves_no_process_group_to_the_interpreter_teardown(tmp_path, api):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--rdzv-backend", "static", str(SCRIPT), str(tmp_path), api]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "NODE_RANK"):
        env.pop(k, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(tmp_path), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun ({api}) hung for 120 s:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    for rank in range(2):
        assert (tmp_path / f"exit_rank{rank}.txt").read_text() == "initialized=False", \
            f"rank {rank} left its process group to the interpreter's teardown"
