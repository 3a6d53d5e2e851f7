"""offload_params="nvme" (engine/placement/nvme_params.py): the clear errors.

No nvme_path; too little free space at setup, with the bytes needed (the fp32 staging counted with a bf16
compute dtype); a failed read mid-run on one rank (one error on every rank), also in an evaluation-only
engine (at the gather on one rank, on every rank at the end of the evaluation); a failed write of the
updated shards.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.placement import nvme as NV
from lightning_zero.engine.placement import nvme_space as NS
from tests.helpers.dist_utils import run_distributed
from tests.helpers.nvme_models import STACK_UNITS, Stack, swap_files


def _engine(path, compute_dtype=None, **kw):
    torch.manual_seed(0)
    model = Stack(4, 16)
    return model, ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(
        stage=3, offload_params="nvme", nvme_path=path, **STACK_UNITS, **kw), compute_dtype=compute_dtype)


def test_no_nvme_path_is_refused(monkeypatch):
    monkeypatch.delenv(NV.NVME_PATH_ENV, raising=False)
    with pytest.raises(ValueError, match=r"offload_params='nvme' needs a directory for the scratch files: nvme_path="):
        ZeroConfig(stage=3, offload_params="nvme")


def test_too_little_free_space_is_refused_at_setup_with_the_bytes_needed(tmp_path, monkeypatch):
    real = NS.shutil.disk_usage
    monkeypatch.setattr(NS.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(ValueError, match=r"has 1,000 bytes free; rank 0's stage-3 parameter shards \(4 bytes per "
                                         r"element\) need ([\d,]+) bytes.*offload_params=True") as err:
        _engine(str(tmp_path))
    needed = int(err.value.args[0].split(" need ")[1].split(" bytes")[0].replace(",", ""))
    numel = sum(p.numel() for p in Stack(4, 16).parameters())
    assert 4 * numel <= needed <= 4 * numel + 4096 * 5  # the shards, each unit's region page-aligned
    assert os.listdir(tmp_path) == []  # nothing was created


def _one_rank_fails_to_read(rank, world_size, path):
    model, engine = _engine(path)
    model(torch.randn(2, 16)).backward()
    engine.step()
    if rank == 0:  # rank 0's parameter file becomes unreadable in the next forward
        real = NV.ScratchFile.read

        def failing(self, buf, offset):
            if "-params-" in self.path:
                raise OSError(errno.EIO, "Input/output error")
            return real(self, buf, offset)

        NV.ScratchFile.read = failing
    model(torch.randn(2, 16)).backward()
    try:
        engine.step()
    except RuntimeError as e:
        return str(e), swap_files(path)
    return None, None


@pytest.mark.timeout(120)
def test_a_failed_read_on_one_rank_stops_every_rank_with_one_error(tmp_path):
    (first, _), (second, _) = run_distributed(_one_rank_fails_to_read, 2, str(tmp_path))
    assert first is not None and "offload_params='nvme': on rank 0, the read of" in first and "-params-rank0-" in first
    assert "Input/output error" in first, first
    assert second == first, second  # every rank raises the failing rank's own words
    assert all("The run stops on every rank" in m for m in (first, second))


def _failing_param_reads():
    real = NV.ScratchFile.read

    def failing(self, buf, offset):
        if "-params-" in self.path:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, buf, offset)

    return failing


def _eval_only(path):
    torch.manual_seed(0)
    model = Stack(4, 16).eval()
    return model, ZeroEngine(model, None, ZeroConfig(stage=3, offload_params="nvme", nvme_path=path, **STACK_UNITS))


def test_an_evaluation_engine_raises_a_failed_read_at_the_gather(tmp_path, monkeypatch):
    """No step agrees on an evaluation-only engine's I/O: one rank stops at the gather whose read failed."""
    model, engine = _eval_only(str(tmp_path))
    with torch.no_grad():
        model(torch.randn(2, 16))
        monkeypatch.setattr(NV.ScratchFile, "read", _failing_param_reads())
        with pytest.raises(RuntimeError, match=r"offload_params='nvme': on rank 0, the read of .*-params-rank0-.*"
                                               r"Input/output error.*outputs since the failure are not trusted"):
            model(torch.randn(2, 16))
        monkeypatch.undo()
        model(torch.randn(2, 16))  # one error per failure; the ring has every slot back
        assert engine.join() == 0
    engine.remove(hand_back=False)
    assert os.listdir(tmp_path) == []


def _eval_read_fails_on_one_rank(rank, world_size, path):
    model, engine = _eval_only(path)
    if rank == 0:
        NV.ScratchFile.read = _failing_param_reads()
    with torch.no_grad():
        for _ in range(2 + rank):  # uneven batches: the gathers still match, served by the joined rank
            model(torch.randn(2, 16))
        try:
            engine.join()  # the end of this rank's evaluation loop
        except RuntimeError as e:
            return str(e)
    return None


@pytest.mark.timeout(120)
def test_an_evaluation_engine_raises_a_failed_read_on_every_rank_at_the_end_of_evaluation(tmp_path):
    first, second = run_distributed(_eval_read_fails_on_one_rank, 2, str(tmp_path))
    assert first is not None and "offload_params='nvme': on rank 0, the read of" in first, first
    assert second == first, second  # every rank raises the failing rank's own words
    assert all("The run stops on every rank; the evaluation's outputs" in m for m in (first, second))


def test_a_failed_write_of_the_updated_shards_stops_the_step(tmp_path, monkeypatch):
    model, engine = _engine(str(tmp_path))
    model(torch.randn(2, 16)).backward()

    def full_disk(self, buf, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(NV.ScratchFile, "write", full_disk)
    with pytest.raises(RuntimeError, match=r"offload_params='nvme': on rank 0, the write of .*-params-rank0-.*\.swap "
                                           r"failed: .*No space left.*The run stops on every rank"):
        engine.step()
    monkeypatch.undo()
    engine.remove(hand_back=False)
    assert os.listdir(tmp_path) == []


def test_the_free_space_check_counts_the_fp32_staging_of_a_bf16_engine(tmp_path, monkeypatch):
    real = NS.shutil.disk_usage
    monkeypatch.setattr(NS.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(ValueError, match=r"rank 0's stage-3 parameter shards \(2 bytes per element, and ([\d,]+) "
                                         r"bytes more in fp32 during setup\) need ([\d,]+) bytes") as err:
        _engine(str(tmp_path), compute_dtype=torch.bfloat16)
    staged, needed = (int(err.value.args[0].split(a)[1].split(b)[0].replace(",", ""))
                      for a, b in ((" per element, and ", " bytes more"), (" need ", " bytes")))
    numel = sum(p.numel() for p in Stack(4, 16).parameters())
    assert 4 * numel <= staged <= 4 * numel + 4096 * 5 and 6 * numel <= needed <= 6 * numel + 4096 * 10
    assert os.listdir(tmp_path) == []
