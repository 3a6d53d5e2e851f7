"""Process groups are destroyed at exit whatever the backend (``destroy_groups_at_exit``, engine/layout/elastic.py).

A gloo group left to the interpreter's own teardown aborts the process now and then after training
finished ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489) — a torchrun
job then reports a failed worker after a complete run (seen in CI on tests/test_lifecycle.py). The abort
itself is a race too rare to provoke on demand, so this asserts its precondition away: by the time the
user's own first atexit handler runs, under torchrun, after a Trainer fit and after a Fabric loop, no
process group is left. Before the fix (Lightning registers its teardown for NCCL only) both rank files
said ``initialized=True``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_zero.tools.launch import free_port
from tests.helpers.torchrun import torchrun

SCRIPT = Path(__file__).parent / "scripts" / "exit_teardown.py"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_a_torchrun_job_leaves_no_process_group_to_the_interpreter_teardown(tmp_path, api):
    launcher = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                "--rdzv-backend", "static"]
    proc = torchrun(SCRIPT, [tmp_path, api], tmp_path, launcher, 120, api)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in range(2):
        assert (tmp_path / f"exit_rank{rank}.txt").read_text() == "initialized=False", \
            f"rank {rank} left its process group to the interpreter's teardown"
