"""The memory table a fit prints (global rank 0), its ``zero/*`` metrics against the ZeRO floor and DDP's own
bytes, the ``memory_summary=False`` switch, and ModelSummary's "Params per Device" column under stage 3."""
import csv
import json

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.loggers import CSVLogger

from lightning_zero import ZeroStrategy, model_state_floor
from tests.helpers.gpt2_module import GPTModule, gpt2_config


class _Record(Callback):
    """Global rank 0 of the forked ranks writes what it showed: ModelSummary's columns (as the callback builds
    them) and the memory table the strategy printed."""

    def __init__(self, path):
        self.path, self.summary = path, None

    def on_fit_start(self, trainer, pl_module):
        summary = next(c for c in trainer.callbacks if type(c) is ModelSummary)
        self.summary = dict(summary._summary(trainer, pl_module)._get_summary_data())

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"summary": self.summary, "table": trainer.strategy.memory_table}))


def _fit(tmp_path, **strategy_kw):
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(start_method="fork", **strategy_kw),
                      max_steps=2, logger=CSVLogger(tmp_path, name="", version=""), enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[ModelSummary(max_depth=2), _Record(tmp_path / "shown.json")],
                      num_sanity_val_steps=0)
    module = GPTModule(gpt2_config().to_dict())
    trainer.fit(module)
    rows = []
    if (tmp_path / "metrics.csv").exists():  # nothing logged: no file
        with open(tmp_path / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if any(v for k, v in r.items() if k.startswith("zero/"))]
    return module, rows, json.loads((tmp_path / "shown.json").read_text())


@pytest.mark.timeout(200)
def test_stage3_table_metrics_and_params_per_device(tmp_path):
    module, rows, shown = _fit(tmp_path, stage=3)
    numel = sum(p.numel() for p in module.parameters())

    # printed by global rank 0, after the first step
    assert shown["table"].startswith("ZeRO stage 3 on 2 rank(s): model-state bytes per rank"), shown["table"]
    print(shown["table"])
    table = shown["table"].splitlines()
    assert [ln.split()[0] for ln in table[2:8]] == ["params", "grads", "master", "optimizer", "device", "host"]
    assert table[8].startswith("  stage 3: 3 units, largest gathered ")  # 2 GPT2Blocks + root
    assert table[6].split()[-1] == "2.0x"  # fp32 AdamW, 2 ranks: 16 psi / (16 psi / 2)

    # logged once, at step 1; against the floor formula (fp32, K=8) and what DDP holds (everything whole)
    assert len(rows) == 1 and rows[0]["step"] == "1"
    m = {k: float(v) * 2**20 for k, v in rows[0].items() if k.endswith("_mb")}
    floor = model_state_floor(3, numel, 2, mixed=False, state_bytes=8)
    assert abs(m["zero/model_states_mb"] - floor["device"]) <= 0.02 * floor["device"]  # padding < 2 elements
    assert abs(m["zero/params_mb"] - floor["params"]) <= 0.02 * floor["params"]
    assert abs(m["zero/optimizer_state_mb"] - floor["optimizer"]) <= 0.02 * floor["optimizer"]
    assert m["zero/master_mb"] == 0 and m["zero/host_mb"] == 0  # fp32: the parameter is its own master
    assert abs(m["zero/ddp_model_states_mb"] - 16 * numel) <= 0.02 * 16 * numel
    assert 0 < m["zero/peak_gathered_mb"] <= 4 * numel and float(rows[0]["zero/units"]) == 3
    assert float(rows[0]["zero/saving_vs_ddp"]) == pytest.approx(2.0, rel=0.02)

    # ModelSummary: the whole count and what one rank stores, per layer
    summary = shown["summary"]
    assert list(summary)[3:5] == ["Params", "Params per Device"]
    row = summary["Name"].index("model.transformer")
    per_rank = sum((p.numel() + 1) // 2 for p in module.model.transformer.parameters())
    assert summary["Params"][row] == "7.7 K" and summary["Params per Device"][row] == f"{per_rank / 1e3:.1f} K"


@pytest.mark.timeout(200)
def test_memory_summary_false_prints_and_logs_nothing(tmp_path):
    _, rows, shown = _fit(tmp_path, stage=2, memory_summary=False)
    assert shown["table"] is None and rows == []
    assert "Params" in shown["summary"] and "Params per Device" not in shown["summary"]  # stage 2: whole params
