"""The recipe's ``ckpt_path=`` in ``mode=fit`` resumes a run: the steps after the checkpoint have the same
training losses and the run ends with the same weights as an uninterrupted run (mid-epoch included), and a
path that is not a checkpoint is refused before any process starts."""
import csv
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # examples/ is not a package
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from t5_config import ConfigError  # noqa: E402

CONF = ROOT / "conf"


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("t5_finetune", overrides=list(overrides))


def _run(pairs_file, out, *extra):
    from t5_finetune import train

    # 48 train pairs / (2 ranks x batch 4) = 6 batches an epoch: a checkpoint at step 4 is mid-epoch
    return train(_compose("model=t5_tiny", "trainer=cpu", "trainer.devices=2", "data=jsonl", f"data.path={pairs_file}",
                          "data.source_field=code", "data.target_field=doc", "data.batch_size=4",
                          "data.limit_train=48", "data.limit_val=8", "data.max_source_len=48",
                          "data.max_target_len=16", "tokenizer.vocab_size=400", "trainer.max_steps=8",
                          "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "output.save_top_k=-1",
                          "trainer.enable_progress_bar=false", "output.tensorboard=false", "output.export_hf=false",
                          "model.dropout_rate=0.1", "optim.warmup_steps=1", f"output.dir={out}", *extra))


def _train_losses(out) -> dict:
    with open(Path(out) / "csv" / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


def _weights(ckpt) -> dict:
    from lightning_zero.lightning.lightning_io import load_as_lightning_checkpoint

    return load_as_lightning_checkpoint(ckpt, optimizer=False)["state_dict"]


@pytest.fixture
def pairs_file(tmp_path):
    import json

    path = tmp_path / "pairs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(300):
            f.write(json.dumps({"code": f"def add_{i}(x):\n    return x + {i}\n", "doc": f"Add {i} to x."}) + "\n")
    return path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset", ["zero2", "zero3"])
def test_fit_resumes_from_ckpt_path_mid_epoch(tmp_path, pairs_file, restore_threads, preset):
    whole = _run(pairs_file, tmp_path / "whole", f"strategy={preset}")
    ckpt = next((tmp_path / "whole" / "checkpoints").glob("step00004-*.ckpt"))  # after step 4 of 8, mid-epoch
    resumed = _run(pairs_file, tmp_path / "resumed", f"strategy={preset}", f"ckpt_path={ckpt}")
    assert whole["run_info"]["global_step"] == resumed["run_info"]["global_step"] == 8
    a, b = _train_losses(tmp_path / "whole"), _train_losses(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6, 7], b  # the resumed run trained steps 5..8 only (CSV steps are 0-based)
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a, b)
    wa = _weights(tmp_path / "whole" / "checkpoints" / "last.ckpt")
    wb = _weights(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6, msg=k)


def test_fit_refuses_a_ckpt_path_that_is_not_a_checkpoint(tmp_path, pairs_file):
    with pytest.raises(ConfigError, match="ckpt_path"):
        _run(pairs_file, tmp_path / "x", f"ckpt_path={tmp_path / 'nope.ckpt'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="ckpt_path"):
        _run(pairs_file, tmp_path / "y", f"ckpt_path={tmp_path / 'empty'}")
