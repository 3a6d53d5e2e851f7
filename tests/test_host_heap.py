"""Freed host memory kept mapped by glibc (engine/comm/host_heap.py, [Note: freed host memory kept mapped]):
a freed block stays in the allocator for the next allocation instead of being unmapped, so a CPU rank's fresh
communication buffers do not page-fault; the user's own glibc tuning and LIGHTNING_ZERO_HOST_HEAP=0 are left
alone. Each check runs in a fresh interpreter: mallopt is process state."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from lightning_zero.engine.comm import buffer_pool as BP

_PROBE = r"""
import torch
from lightning_zero.engine.comm.host_heap import retain_freed_host_memory
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) * 1024
told = retain_freed_host_memory()
t = torch.ones(4 * 2**20)  # 16 MiB, every page touched
before = rss()
del t
print(told, before - rss())
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's mallopt")


def _freed_after_delete(**env) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    told, freed = out.stdout.split()
    return told == "True", int(freed)


@glibc
def test_a_freed_block_stays_mapped_for_the_next_allocation():
    told, freed = _freed_after_delete()
    assert told and freed < 2**20  # the 16 MiB stay in the allocator


@glibc
@pytest.mark.parametrize("env", [dict(LIGHTNING_ZERO_HOST_HEAP="0"), dict(MALLOC_TRIM_THRESHOLD_="131072")])
def test_the_users_choice_is_left_alone(env):
    told, freed = _freed_after_delete(**env)
    assert not told and freed >= 15 * 2**20  # glibc's own behaviour: the block unmapped on free


def test_the_pool_asks_for_it_on_a_fresh_cpu_block(monkeypatch):
    calls = []
    monkeypatch.setattr(BP, "retain_freed_host_memory", lambda: calls.append(1))
    pool = BP.BufferPool()
    pool.give(pool.take(10, torch.float32, "cpu"))
    pool.take(10, torch.float32, "cpu")  # the kept block: nothing new made
    assert calls == [1]
