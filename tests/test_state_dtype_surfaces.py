"""``optimizer_state_dtype`` / ``master_dtype`` from every surface a user sets them on: the Hydra recipe's command
line, ``ZeroStrategy`` under a Trainer, ``ZeroFabricStrategy`` under Fabric -- each reaching the engine's optimizer
state (bf16 moments, bf16 masters) -- and a bad value refused at construction with the config's one error."""

from __future__ import annotations

import re

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.lightning.fabric_strategy import ZeroFabricStrategy
from lightning_zero.lightning.pipeline_strategy import ZeroPipelineStrategy
from tests.helpers.hydra_recipe import compose_recipe  # noqa: F401  (examples/ on sys.path)
from tests.helpers.lightning_models import trainer_kwargs
from t5_config import ConfigError, build_strategy  # noqa: E402,I001

BF16 = torch.bfloat16


@pytest.mark.parametrize("preset", ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload_nvme"])
def test_recipe_command_line_sets_both_knobs(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", str(tmp_path))  # the *_offload_nvme presets' nvme_path: null
    cfg = compose_recipe(f"strategy={preset}", "strategy.optimizer_state_dtype=bf16", "strategy.master_dtype=bf16",
                         "trainer.precision=bf16-mixed")
    z = build_strategy(cfg).zero_config
    assert (z.optimizer_state_dtype, z.master_dtype) == ("bf16", "bf16")
    z = build_strategy(compose_recipe(f"strategy={preset}")).zero_config  # the presets: fp32, ZeroConfig's default
    assert (z.optimizer_state_dtype, z.master_dtype) == ("fp32", "fp32")


def test_recipe_refuses_a_bad_dtype_with_the_configs_error():
    with pytest.raises(ConfigError, match=r"strategy=zero2: .*master_dtype='fp16'.*master_dtype must be 'fp32' "
                                          r"\(default\) or 'bf16'; got 'fp16'"):
        build_strategy(compose_recipe("strategy.master_dtype=fp16"))
    with pytest.raises(ConfigError, match=r"optimizer_state_dtype must be 'fp32' \(default\) or 'bf16'; got 'int8'"):
        build_strategy(compose_recipe("strategy.optimizer_state_dtype=int8"))


@pytest.mark.parametrize("make", [ZeroStrategy, ZeroFabricStrategy,
                                  lambda **kw: ZeroPipelineStrategy(pipeline_parallel_size=2, **kw)],
                         ids=["trainer", "fabric", "pipeline"])
def test_strategies_carry_the_knobs_and_refuse_bad_values_at_construction(make):
    z = make(stage=2, optimizer_state_dtype="bf16", master_dtype="bfloat16").zero_config
    assert (z.optimizer_state_dtype, z.master_dtype) == ("bf16", "bf16")
    with pytest.raises(ValueError, match=r"optimizer_state_dtype must be 'fp32' \(default\) or 'bf16'; got 'fp16' "
                                         r"\(fp16's 5 exponent bits"):
        make(optimizer_state_dtype="fp16")
    with pytest.raises(ValueError, match=r"master_dtype must be 'fp32' \(default\) or 'bf16'; got 'half'"):
        make(master_dtype="half")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _state_dtypes(engine) -> set:
    """(master, its moments) dtypes of every master of the engine's optimizers, between steps, and whether the
    masters carry a compensation term."""
    out = set()
    for s in engine.shardeds:
        compensated = s.low_precision.masters and s.low_precision.compensation_bytes() > 0
        for m in (m for row in s.masters for m in row):
            st = s.optimizer.state[m]
            out.add((m.dtype, st["exp_avg"].dtype, st["exp_avg_sq"].dtype, compensated))
    return out


class _Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x).float() - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)),
                          batch_size=4)


class _SeeStates(Callback):
    def __init__(self) -> None:
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(_state_dtypes(trainer.strategy.engine))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_fit_keeps_the_states_in_bf16(stage):
    """Trainer(strategy=ZeroStrategy(..., optimizer_state_dtype="bf16", master_dtype="bf16"), precision="bf16-mixed"):
    after every step the masters and moments the engine keeps are bf16, the masters with their compensation (fp32
    and none without the knobs)."""
    seen = {}
    for knobs in ({}, dict(optimizer_state_dtype="bf16", master_dtype="bf16")):
        cb = _SeeStates()
        trainer = Trainer(strategy=ZeroStrategy(stage=stage, **knobs), precision="bf16-mixed", callbacks=[cb],
                          **trainer_kwargs(devices=1, max_steps=2))
        trainer.fit(_Regression())
        assert trainer.global_step == 2 and len(cb.seen) == 2
        seen[bool(knobs)] = set.union(*cb.seen)
    assert seen[False] == {(torch.float32, torch.float32, torch.float32, False)}
    assert seen[True] == {(BF16, BF16, BF16, True)}


@pytest.mark.timeout(180)
def test_fabric_strategy_keeps_the_states_in_bf16():
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2, optimizer_state_dtype="bf16", master_dtype="bf16"),
                    accelerator="cpu", devices=1, precision="bf16-mixed")
    fabric.launch()
    net = _net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        fabric.backward((model(x).float() - y).pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert _state_dtypes(fabric.strategy.engine) == {(BF16, BF16, BF16, True)}
    assert fabric.strategy.zero_config.optimizer_state_dtype == "bf16"
    fabric.strategy.teardown()


@pytest.mark.timeout(180)
def test_memory_table_names_the_dtypes_and_compares_with_fp32_ddp():
    """The table a fit prints: ZeRO's master and optimizer-state rows say they are bf16, and DDP's column keeps
    its optimizer state in fp32 (twice the bf16 moments) -- a 1-rank run saves 2x on them, not 1x."""
    trainer = Trainer(strategy=ZeroStrategy(stage=2, optimizer_state_dtype="bf16", master_dtype="bf16"),
                      precision="bf16-mixed", **trainer_kwargs(devices=1, max_steps=1))
    trainer.fit(_Regression())
    trainable = 8 * 16 + 16 + 16 * 1 + 1  # 161
    cells = [re.split(r"\s{2,}", ln.strip()) for ln in trainer.strategy.memory_table.splitlines()[2:6]]
    rows = {c[0]: c[1:] for c in cells}
    assert rows["master (bf16 + compensation)"] == [f"{2 * trainable} B", f"{4 * trainable} B", "2.0x"]
    assert rows["optimizer state (bf16)"] == [f"{2 * 2 * trainable} B", "1.3 KiB", "2.0x"]  # DDP: 8 B x 161
    trainer = Trainer(strategy=ZeroStrategy(stage=2), precision="bf16-mixed", **trainer_kwargs(devices=1, max_steps=1))
    trainer.fit(_Regression())
    labels = [re.split(r"\s{2,}", ln.strip())[0] for ln in trainer.strategy.memory_table.splitlines()[2:6]]
    assert labels == ["params", "grads", "master (fp32)", "optimizer state"]
