"""DeepSpeed's low-precision options (its ``bf16`` block: ``bf16_master_weights_and_grads``, ``bf16_optimizer_states``)
through ``from_deepspeed_config`` / ``lightning-zero from-deepspeed``: our ``master_dtype`` / ``optimizer_state_dtype``,
what differs said, what the run would refuse refused with one error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import DeepSpeedConfigError, ZeroStrategy, from_deepspeed_config
from lightning_zero.tools.cli import main as cli_main
from tests.helpers.lightning_models import trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]

# DeepSpeed's own example of the options (docs of PR #7700): bf16 masters, grads and moments at ZeRO-2
DS_LOW_PRECISION = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
}


def test_bf16_master_weights_and_optimizer_states_translate_and_say_what_differs():
    t = from_deepspeed_config(DS_LOW_PRECISION)
    assert t.strategy == {"stage": 2, "offload_optimizer": False, "offload_params": False, "master_dtype": "bf16",
                          "optimizer_state_dtype": "bf16"}
    assert t.precision == "bf16-mixed"
    how = t.differs["bf16.bf16_master_weights_and_grads"]
    assert "the gradients stay fp32" in how and "bf16 Kahan compensation term" in how
    assert "2 bytes per element more than DeepSpeed's plain bf16 master" in how
    assert "can lose updates smaller than half a bf16 ulp" in how
    assert "bf16.bf16_optimizer_states" not in t.differs  # the moments in bf16, as DeepSpeed keeps them
    z = t.make_strategy(start_method="fork").zero_config
    assert (z.stage, z.master_dtype, z.optimizer_state_dtype) == (2, "bf16", "bf16")
    overrides, notes = t.hydra_overrides()
    assert "strategy.master_dtype=bf16" in overrides and "strategy.optimizer_state_dtype=bf16" in overrides
    assert any(n.startswith("bf16.bf16_master_weights_and_grads: differs here (master_dtype='bf16': the gradients "
                            "stay fp32") for n in notes)


def test_each_option_alone():
    master_only = {**DS_LOW_PRECISION, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    t = from_deepspeed_config(master_only)  # DeepSpeed's supported mix: bf16 masters, fp32 moments, CPU offload
    assert t.strategy == {"stage": 3, "offload_optimizer": True, "offload_params": False, "master_dtype": "bf16"}
    states_only = {**DS_LOW_PRECISION, "bf16": {"enabled": True, "bf16_optimizer_states": True}}
    t = from_deepspeed_config(states_only)
    assert t.strategy == {"stage": 2, "offload_optimizer": False, "offload_params": False,
                          "optimizer_state_dtype": "bf16"}
    assert "DeepSpeed refuses bf16_optimizer_states without bf16_master_weights_and_grads; here bf16 moments run " \
           "with fp32 masters" in t.differs["bf16.bf16_optimizer_states"]
    off = {**DS_LOW_PRECISION, "bf16": {"enabled": True, "bf16_master_weights_and_grads": False,
                                        "bf16_optimizer_states": False}}
    t = from_deepspeed_config(off)
    assert t.strategy == {"stage": 2, "offload_optimizer": False, "offload_params": False} and not t.differs


@pytest.mark.parametrize("cfg,match", [
    ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True}},
     r"bf16.bf16_master_weights_and_grads=true with precision '32-true': a bf16 master needs bf16 compute\. "
     r"Allowed: bf16.bf16_master_weights_and_grads with bf16.enabled=true"),
    ({"fp16": {"enabled": True}, "bf16": {"bf16_master_weights_and_grads": True}},
     r"with precision '16-mixed': a bf16 master needs bf16 compute"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": "yes"}},
     r"bf16.bf16_optimizer_states='yes': allowed true or false"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grad": True}},
     r"bf16: unsupported key\(s\) \['bf16_master_weights_and_grad'\]\. Allowed: bf16_master_weights_and_grads, "
     r"bf16_optimizer_states, check_grad_overflow, enabled"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 1},
      "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}}},
     r"optimizer OneBitAdam .*the run refuses it: optimizer_state_dtype='bf16' widen and round .*Allowed: an "
     r"elementwise optimizer"),
])
def test_what_the_run_refuses_is_refused_with_one_error(cfg, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_deepspeed_config(cfg)


def test_auto_precision_leaves_the_bf16_check_to_the_trainer():
    """HF's ``"enabled": "auto"``: the Trainer's precision flag decides; the knob is translated and the run checks."""
    t = from_deepspeed_config({"bf16": {"enabled": "auto", "bf16_master_weights_and_grads": True},
                               "zero_optimization": {"stage": 2}})
    assert t.precision is None and t.strategy["master_dtype"] == "bf16"


def test_cli_overrides_compose_into_the_recipe(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    from hydra import compose, initialize_config_dir
    from t5_config import build_strategy, validate_schema

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_LOW_PRECISION))
    out = tmp_path / "ds.overrides"
    assert cli_main(["from-deepspeed", str(path), "--out", str(out)]) == 0
    assert "bf16.bf16_master_weights_and_grads: differs here" in capsys.readouterr().err
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("t5_finetune", overrides=out.read_text().split())
    validate_schema(cfg)
    assert (cfg.strategy.master_dtype, cfg.strategy.optimizer_state_dtype, cfg.trainer.precision) == \
        ("bf16", "bf16", "bf16-mixed")
    z = build_strategy(cfg).zero_config
    assert (z.master_dtype, z.optimizer_state_dtype) == ("bf16", "bf16")


class _Regression(LightningModule):
    def __init__(self, translation) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.translation = translation

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x).float() - y).pow(2).mean()

    def configure_optimizers(self):
        return self.translation.configure_optimizers(self.parameters())

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)),
                          batch_size=self.translation.micro_batch_size)


@pytest.mark.timeout(180)
def test_translated_run_keeps_the_moments_in_bf16():
    t = from_deepspeed_config(DS_LOW_PRECISION)
    strategy = t.make_strategy()  # one device: the fit runs in this process
    assert isinstance(strategy, ZeroStrategy)
    seen = []

    class See(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            s = trainer.strategy.engine.shardeds[0]
            seen.append({v.dtype for st in s.optimizer.state.values() for k, v in st.items() if k != "step"})
            seen.append(s.low_precision.compensation_bytes() > 0)

    trainer = Trainer(strategy=strategy, callbacks=[See()], **trainer_kwargs(devices=1, max_steps=2))
    trainer.fit(_Regression(t))
    assert seen == [{torch.bfloat16}, True] * 2, seen
    assert trainer.global_step == 2
