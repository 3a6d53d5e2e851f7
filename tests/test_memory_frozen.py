"""The memory table with frozen parameters (a LoRA-style fine-tune: frozen base, few trainable weights).

Frozen parameters have no master, gradient or optimizer state, but every rank holds them: whole and
replicated at stages 0-2 (as under DDP), partitioned with the rest at stage 3. The table's ZeRO column must
count what the ranks really hold (tensor storages counted here, independently of ``engine.memory_report``),
its DDP column the whole model, so the saving it prints is the true one.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_zero import ZeroStrategy
from tests.helpers.gpt2_module import GPTModule, gpt2_config


class FrozenBaseGPT(GPTModule):
    """HF GPT-2 with its base frozen; only the LayerNorms train (AdamW over the trainable parameters)."""

    def __init__(self, config: dict, out: str) -> None:
        super().__init__(config)
        self.out = out
        for n, p in self.model.named_parameters():
            p.requires_grad_(".ln_" in n or n.startswith("transformer.ln_f"))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def on_train_end(self):  # before the strategy hands the module back: what this rank holds now
        engine = self.trainer.strategy.engine
        storages = {}
        for p in self.parameters():
            s = p.untyped_storage()
            if s.nbytes():
                storages[s.data_ptr()] = s.nbytes()
        if engine.partitioner is not None:  # stage 3: the unit shards are the parameters' home
            for u in engine.partitioner.units:
                if u.shard is not None:
                    storages[u.shard.untyped_storage().data_ptr()] = u.shard.untyped_storage().nbytes()
        held = {"params": sum(storages.values())}
        with open(f"{self.out}/held_rank{self.global_rank}.json", "w") as f:
            json.dump(held, f)
        if self.trainer.is_global_zero:
            with open(f"{self.out}/table.txt", "w") as f:
                f.write(self.trainer.strategy.memory_table)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,precision", [(0, "32-true"), (1, "32-true"), (2, "32-true"), (2, "bf16-mixed"),
                                             (3, "32-true")])
def test_table_counts_frozen_parameters_on_both_sides(tmp_path, stage, precision):
    module = FrozenBaseGPT(gpt2_config().to_dict(), str(tmp_path))
    size = 2 if precision == "bf16-mixed" else 4
    numel = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert 0 < trainable < numel // 10  # mostly frozen
    Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage, start_method="fork"),
            precision=precision, max_steps=2, logger=CSVLogger(tmp_path, name="", version=""),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0).fit(module)
    held = [json.loads((tmp_path / f"held_rank{r}.json").read_text())["params"] for r in range(2)]
    with open(tmp_path / "metrics.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f) if r.get("zero/params_mb"))
    m = {k: float(v) * 2**20 for k, v in row.items() if k.endswith("_mb") and v}
    print((tmp_path / "table.txt").read_text())

    assert m["zero/params_mb"] == pytest.approx(max(held), rel=1e-6)  # what the ranks really hold
    if stage < 3:  # frozen or not, every rank holds every parameter whole
        assert held == [size * numel] * 2
    else:  # stage 3 partitions the frozen parameters too (per-parameter padding: < 1 element per rank)
        assert max(held) <= size * (numel / 2 + len(list(module.parameters())))
    # DDP: every parameter whole, gradients and fp32 AdamW state (2 x 4 B) and, mixed, a master for the trainable
    ddp = size * numel + size * trainable + 8 * trainable + (4 * trainable if size == 2 else 0)
    assert m["zero/ddp_model_states_mb"] == pytest.approx(ddp, rel=1e-6)
    saving = float(row["zero/saving_vs_ddp"])
    assert saving == pytest.approx(ddp / m["zero/model_states_mb"], rel=1e-6)
    if stage < 3:  # the frozen base dominates and is replicated: little to save
        assert saving < 1.2
