"""Run a test script under ``python -m torch.distributed.run`` as a user would, in a session of its own (a
hung job's workers are killed with torchrun), with the pytest process's distributed environment removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
_DIST_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "NODE_RANK")


def torchrun(script: Path, args: Sequence[str], cwd: Path, launcher: Sequence[str], timeout: float,
             what: str) -> subprocess.CompletedProcess:
    """``torchrun <launcher> script args`` (``launcher``: --nproc-per-node, rendezvous, restarts ...); a job
    still running after ``timeout`` s is killed and reported (``what`` names it) as a hang."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for k in _DIST_ENV:
        env.pop(k, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(cwd),
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun {what} hung for {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
