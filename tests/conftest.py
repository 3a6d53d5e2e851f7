"""Shared test hygiene."""

import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _nvme_scratch_dir(tmp_path_factory, monkeypatch):
    """Where the registered ``*_offload_nvme`` presets (``nvme_path`` from LIGHTNING_ZERO_NVME_PATH) put their
    scratch files in the tests that build every preset; a test of the variable's absence deletes it."""
    if "LIGHTNING_ZERO_NVME_PATH" not in os.environ:
        monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", str(tmp_path_factory.getbasetemp() / "nvme"))
        (tmp_path_factory.getbasetemp() / "nvme").mkdir(exist_ok=True)


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """A Trainer run in the test process (devices=1) leaves Lightning's process group initialized; forked
    ranks of a later test would inherit it and fail to initialize their own."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _environment_restored():
    """Lightning exports LOCAL_RANK, NODE_RANK, MASTER_ADDR, ... in the process it runs in; a later test
    would read them as "launched externally" (e.g. the recipe keeps the popen launcher)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def restore_threads():
    """An in-process recipe run sets torch's thread count and OMP_NUM_THREADS; later tests get them back."""
    n, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(n)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp
