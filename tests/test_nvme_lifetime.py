"""The NVMe scratch files live as long as the Trainer can still save their states, and not longer.

``trainer.save_checkpoint`` after ``trainer.fit`` (full and ``weights_only=True``) with the registered presets
``zero2_offload_nvme`` / ``zero3_offload_nvme`` and with ``ZeroPipelineStrategy(offload_optimizer="nvme")``,
at 1 and 2 devices, in a script run as a user runs it (tests/helpers/nvme_after_fit.py; with 2 devices
Lightning's default launcher starts the second rank): the kept states are only on disk between saves, a
full checkpoint saved after two earlier saves resumes (``ckpt_path=``) into a differently initialized model
and ends where the uninterrupted run ends, bit for bit; the weights-only one holds the trained weights; and
once every process has exited no scratch file is left
([Note: NVMe states outlive teardown], engine/placement/nvme_states.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero.engine.placement.nvme import NVME_PATH_ENV

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "nvme_after_fit.py"
CASES = [(kind, devices) for kind in ("zero2_offload_nvme", "zero3_offload_nvme", "pipeline") for devices in (1, 2)]


def _values(tensors) -> torch.Tensor:
    """Every element of ``tensors``, sorted: equal multisets of values whatever the names."""
    return torch.cat([t.detach().float().reshape(-1) for t in tensors]).sort().values


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,devices", CASES)
def test_save_checkpoint_after_fit_with_nvme_offload_resumes_exactly_and_no_scratch_file_outlives_the_process(
        kind, devices, tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k != NVME_PATH_ENV}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), kind, str(devices), str(out), str(scratch)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [torch.load(out / f"rank{r}.pt") for r in range(devices)]
    for r, rec in enumerate(records):
        assert any(f.startswith("lightning_zero-optimizer-") for f in rec["held"]), rec["held"]  # kept for the saves
        assert rec["in_memory"] == 0 < rec["on_disk"], rec  # each save's read-back written out again
        assert set(rec["resumed"]) == set(rec["straight"])
        for k in rec["straight"]:
            assert torch.equal(rec["resumed"][k], rec["straight"][k]), f"rank {r}: {k} resumed != uninterrupted"
        assert any(not torch.equal(rec["trained"][k], rec["straight"][k]) for k in rec["straight"])  # it trained on
        for k in rec.get("loaded", {}):  # the weights-only directory read back by load_from_checkpoint
            assert torch.equal(rec["loaded"][k], rec["trained"][k]), f"rank {r}: {k} weights-only != trained"
    if kind == "pipeline":  # every stage's weights in both directories (names: the uncut model's)
        from lightning_zero.checkpoint.pipeline_dir import consolidate_pipeline_checkpoint

        full, weights, again = (consolidate_pipeline_checkpoint(out / name) for name in ("full", "weights", "again"))
        for other in (weights, again):
            assert set(full) == set(other) and all(torch.equal(full[k], other[k]) for k in full)
        trained = [t for rec in records for t in rec["trained"].values()]
        assert torch.equal(_values(weights.values()), _values(trained))
    assert os.listdir(scratch) == []  # every process has exited: no scratch file left behind


@pytest.mark.timeout(300)
def test_the_next_fit_releases_the_kept_scratch_file_and_the_collected_trainer_leaves_none(tmp_path, monkeypatch):
    """In one process (devices=1): a second ``fit`` of the same Trainer removes the first fit's file when it
    sets up, and a Trainer no longer referenced takes its file with it."""
    import gc

    from lightning.pytorch import Trainer

    from tests.helpers.nvme_after_fit import TinyRegressor
    from tests.helpers.nvme_models import swap_files

    monkeypatch.setenv(NVME_PATH_ENV, str(tmp_path))
    model = TinyRegressor()
    trainer = Trainer(strategy="zero2_offload_nvme", accelerator="cpu", devices=1, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    first = swap_files(str(tmp_path))
    assert len(first) == 1  # kept after fit for save_checkpoint
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model)
    second = swap_files(str(tmp_path))
    assert len(second) == 1 and second != first  # the first fit's file went when the second set up
    del trainer, model
    gc.collect()
    assert swap_files(str(tmp_path)) == []
