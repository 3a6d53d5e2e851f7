"""NVMe space across ranks and restarts ([Note: scratch space for the node], engine/placement/nvme_space.py).

* Two ranks on one disk, each of whose files would fit alone but not both: both ranks refuse at setup with the
  same error, naming the bytes each needs, their sum and the free space; nothing is created.
* A run killed with SIGKILL leaves its scratch files; the next run on a disk sized for the job reclaims exactly
  those (a live run's files, a locked file, another host's, anything not named as ours all stay) and trains.
* ``nvme_path`` removed, or unwritable, after the config was made: one clear ValueError naming the directory,
  on every rank, with the failing rank's words.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.placement import nvme as NV
from lightning_zero.engine.placement import nvme_space as NS
from tests.helpers.dist_utils import run_distributed
from tests.helpers.nvme_models import STACK_UNITS, Stack, swap_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(path: str, stage: int = 2) -> ZeroConfig:
    return ZeroConfig(stage=stage, offload_optimizer="nvme", offload_params="nvme" if stage == 3 else False,
                      nvme_path=path, **(STACK_UNITS if stage == 3 else {}))


def _engine(cfg: ZeroConfig):
    torch.manual_seed(0)
    model = Stack(4, 64)
    return model, ZeroEngine(model, torch.optim.AdamW(model.parameters()), cfg)


# -- ranks sharing one disk ----------------------------------------------------------------------------------------
FREE = 150_000  # more than one rank's file (about 100 KB at 2 ranks), less than both


def _shared_disk(rank, world_size, path):
    real = shutil.disk_usage
    shutil.disk_usage = lambda p: real(p)._replace(free=FREE)
    try:
        _engine(_config(path))
    except ValueError as e:
        return str(e), swap_files(path)
    return None, swap_files(path)


@pytest.mark.timeout(120)
def test_ranks_sharing_a_disk_are_checked_against_their_sum_on_every_rank(tmp_path):
    (first, left0), (second, left1) = run_distributed(_shared_disk, 2, str(tmp_path))
    assert first is not None and first == second, (first, second)
    assert f"nvme_path={str(tmp_path)!r} has {FREE:,} bytes free; the 2 ranks of this node that share its disk " \
           f"need " in first and "Allowed: a directory on a disk with at least that much free space" in first, first
    per_rank = [int(n.replace(",", "")) for _, n in re.findall(r"rank (\d): ([\d,]+)", first)]
    total = int(first.split(" need ")[1].split(" bytes")[0].replace(",", ""))
    assert total == sum(per_rank) and all(n < FREE for n in per_rank)  # each alone would have passed
    assert left0 == left1 == []


# -- a killed run's files --------------------------------------------------------------------------------------------
TRAINING = """
import sys, time, torch
from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.nvme_models import STACK_UNITS, Stack
torch.manual_seed(0)
model = Stack(4, 64)
engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(
    stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=sys.argv[1], **STACK_UNITS))
model(torch.randn(2, 64)).backward()
engine.step()
print("ready", flush=True)
time.sleep(300)
"""


def _start(path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", TRAINING, path], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _of(path: str, pid: int) -> list[str]:
    return [f for f in swap_files(path) if f"-{pid}-" in f]


def _bytes_in(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


@pytest.mark.timeout(300)
def test_a_killed_runs_files_are_reclaimed_by_the_next_run_and_nothing_else(tmp_path, monkeypatch, caplog):
    scratch = str(tmp_path)
    killed, live = _start(scratch), _start(scratch)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        left = _of(scratch, killed.pid)
        assert len(left) == 2  # its optimizer and parameter files: no finalizer ran
        job = sum(os.path.getsize(os.path.join(scratch, f)) for f in left)
        # not ours to take: another host's file, a file not named as ours, a dead pid's file someone holds locked
        other_host = f"lightning_zero-optimizer-rank0-{killed.pid}-elsewhere-0123abcd.swap"
        held = f"lightning_zero-params-rank1-{killed.pid}-{NV.HOST}-89abcdef.swap"
        for name in (other_host, "notes.swap", held):
            (tmp_path / name).write_bytes(b"x" * 100)
        lock = os.open(os.path.join(scratch, held), os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)
        # a disk sized for the job: room for one more run beside what is there, if the dead one's files go
        capacity = _bytes_in(scratch) + 4096
        real = shutil.disk_usage
        monkeypatch.setattr(NS.shutil, "disk_usage", lambda p: real(p)._replace(free=capacity - _bytes_in(scratch)))
        with caplog.at_level(logging.WARNING, logger="lightning_zero.engine"):
            model, engine = _engine(_config(scratch, stage=3))
        assert _of(scratch, killed.pid) == sorted([held, other_host])  # the dead run's own two are gone
        assert len(_of(scratch, live.pid)) == 2 and os.path.exists(os.path.join(scratch, "notes.swap"))
        assert sum("a scratch file left by a process of this host that no longer exists" in r.getMessage()
                   for r in caplog.records) == 2
        model(torch.randn(2, 64)).backward()
        engine.step()  # the run trains on the reclaimed space
        mine = _of(scratch, os.getpid())
        assert sum(os.path.getsize(os.path.join(scratch, f)) for f in mine) == job  # the space the dead run held
        engine.remove(hand_back=False)
        os.close(lock)
    finally:
        live.kill()
        live.wait()


# -- nvme_path gone or unwritable after the config was made --------------------------------------------------------
def test_nvme_path_removed_after_the_config_is_one_clear_error(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cfg = _config(str(scratch))
    scratch.rmdir()
    with pytest.raises(ValueError, match=rf"nvme_path={str(scratch)!r} does not exist or is not a directory\. "
                                         r"Allowed: an existing, writable directory"):
        _engine(cfg)


def _read_only_on_rank_1(rank, world_size, path):
    cfg = _config(path)
    if rank == 1:  # this rank's mount of the directory turned read-only
        real_open = os.open

        def read_only(p, flags, *a, **k):
            if str(p).startswith(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(errno.EROFS, "Read-only file system", p)
            return real_open(p, flags, *a, **k)

        os.open = read_only
    try:
        _engine(cfg)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_nvme_path_turned_read_only_on_one_rank_is_its_error_on_every_rank(tmp_path):
    first, second = run_distributed(_read_only_on_rank_1, 2, str(tmp_path))
    assert first is not None and first == second, (first, second)
    assert first.startswith(f"rank 1: nvme_path={str(tmp_path)!r} is not writable by this process"), first
    assert swap_files(str(tmp_path)) == []
