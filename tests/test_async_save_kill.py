"""A process killed (SIGKILL, every rank) while a background checkpoint write is in progress leaves the previous
checkpoint complete, ``last.ckpt`` naming it, and a resume from it equal to the uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_zero import checkpoint as ck
from tests.helpers.lightning_models import load_rank_files

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, mode: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.async_kill", str(out), mode], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _finish(proc: subprocess.Popen) -> None:
    output = proc.communicate(timeout=240)[0].decode(errors="replace")
    assert proc.returncode == 0, output[-4000:]


def _kill_mid_write(tmp_path, mode):
    proc = _run(tmp_path, mode)
    deadline = time.monotonic() + 180
    while not (tmp_path / "writing").exists():
        assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")[-4000:]
        assert time.monotonic() < deadline, "the step-4 write never began"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both forked ranks, mid-write
    proc.wait(timeout=60)
    (tmp_path / "writing").unlink()


def _same_as_reference(tmp_path, tag):
    reference = load_rank_files(str(tmp_path), "reference_", "train", 2)
    resumed = load_rank_files(str(tmp_path), tag, "train", 2)
    for r, (got, want) in enumerate(zip(resumed, reference)):
        assert got["global_step"] == want["global_step"] == 6
        torch.testing.assert_close(got["losses"], want["losses"][2:], rtol=0, atol=0, msg=lambda m: f"rank {r}: {m}")
        for k, v in want["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=0, atol=0, msg=lambda m: f"rank {r} {k}: {m}")


def test_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    _finish(_run(tmp_path, "reference"))
    _kill_mid_write(tmp_path, "killed")

    ckpt = tmp_path / "ckpt"
    names = sorted(os.listdir(ckpt))
    assert "step=4.ckpt" not in names, names  # never visible: only its temporary was being written
    assert {"step=2.ckpt", "last.ckpt"} <= set(names), names
    for name in ("step=2.ckpt", "last.ckpt"):
        ck.read_info(ckpt / name)  # complete: every listed file present, sizes and CRC-32 as written
        assert ck.read_meta(ckpt / name, trust_checkpoint=True)["global_step"] == 2

    _finish(_run(tmp_path, "resume"))
    _same_as_reference(tmp_path, "resume_")
    assert not any(n.endswith(".zero-tmp") for n in os.listdir(ckpt)), "the next saves removed the temporary"

    # save_last="link": Lightning repointed last.ckpt at the unwritten step=4.ckpt; ckpt_path="last" still finds
    # the previous last checkpoint (its twin, lightning/async_saves.py keep_last_links) and resumes from it
    _kill_mid_write(tmp_path, "killed_link")
    ckpt = tmp_path / "ckpt_link"
    assert os.readlink(ckpt / "last.ckpt") == "step=4.ckpt" and not (ckpt / "step=4.ckpt").exists()
    assert os.readlink(ckpt / "last.zero-prev.ckpt") == "step=2.ckpt"
    _finish(_run(tmp_path, "resume_link"))
    _same_as_reference(tmp_path, "resume_link_")
    assert os.readlink(ckpt / "last.ckpt") == "step=6.ckpt"
    assert sorted(n for n in os.listdir(ckpt) if "zero" in n) == [], "the twin goes once a save is complete"
