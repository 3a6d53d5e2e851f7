"""DeepSpeed's own tutorial configs, as its docs give them, through `lightning-zero from-deepspeed` and
`from_deepspeed_config`: each translates into a run that starts, or is refused at translation with the run's own
reason. DeepSpeed's batch rule (train_batch_size = micro x accumulation x world size), its config dialect
(hjson: trailing commas, newline-separated members), and nvme_path left to the machine that trains."""
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import DeepSpeedConfigError, ZeroStrategy, from_deepspeed_config
from lightning_zero.tools.cli import main as cli_main

from .helpers.hydra_recipe import compose_recipe

# docs/_tutorials/onebit-adam.md, "1.4 Configuration of 1-bit Adam" (the trailing comma is DeepSpeed's: its
# loader is hjson)
ONEBIT_TUTORIAL = """{
  "train_batch_size": 4096,
  "train_micro_batch_size_per_gpu": 16,
  "optimizer": {
    "type": "OneBitAdam",
    "params": {
      "lr": 4e-4,
      "freeze_step": 23000,
      "cuda_aware": false,
      "comm_backend_name": "nccl"
    }
  },
  "fp16": {
    "enabled": true,
  }
}
"""

# docs/code-docs/source/zero3.rst, "Example ZeRO-3 Configurations" 1 (its "..." placeholder line left out)
ZERO3_TUTORIAL = """{
    "zero_optimization": {
        "stage": 3,
    },
    "fp16": {
        "enabled": true
    },
    "optimizer": {
        "type": "AdamW",
        "params": {
        "lr": 0.001,
        "betas": [
            0.8,
            0.999
        ],
        "eps": 1e-8,
        "weight_decay": 3e-7
        }
    },
}
"""

# docs/_tutorials/zero.md, "Offloading to CPU and NVMe with ZeRO-Infinity"
ZERO_INFINITY_CPU_TUTORIAL = """{
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": true,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {
            "device": "cpu"
         },
        "offload_param": {
            "device": "cpu"
       }
   }
}
"""

# docs/code-docs/source/zero3.rst, example 4 "offloading to NVMe" (no comma between the two blocks: hjson's
# newline separator; the "..." placeholder line left out). /nvme_data is a directory of the training machine.
ZERO_INFINITY_NVME_TUTORIAL = """{
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/nvme_data"
        }
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/nvme_data"
        }
    },
}
"""


def _write(tmp_path, text, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(text)
    return path


class _Net(LightningModule):
    """A config's optimizer block when it has one; else the user's own AdamW (DeepSpeed's client optimizer)."""

    def __init__(self, translation):
        super().__init__()
        self.t = translation
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        if self.t.optimizer is None:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return self.t.configure_optimizers(self.parameters())


def _fit(translation, tmp_path, **strategy_kw):
    """The translation as a user runs it: its strategy, Trainer flags, micro-batch and optimizer; two steps."""
    torch.manual_seed(0)
    trainer = Trainer(strategy=translation.make_strategy(**strategy_kw), accelerator="cpu", devices=1,
                      max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path), **translation.trainer)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    trainer.fit(_Net(translation), DataLoader(data, batch_size=translation.micro_batch_size or 4))
    return trainer


# -- the tutorial configs -----------------------------------------------------------------------------------
def test_onebit_adam_tutorial_is_refused_at_translation_with_the_runs_reason(tmp_path, capsys):
    """fp16 + OneBitAdam: the run refuses it at setup (fp16 loss scaling); the CLI says so, with that message."""
    path = _write(tmp_path, ONEBIT_TUTORIAL)
    assert cli_main(["from-deepspeed", str(path), "--world-size", "256"]) == 2
    err = capsys.readouterr().err
    run_reason = _run_refusal(tmp_path)
    assert run_reason in err and "fp16 loss scaling" in run_reason and "Allowed:" in run_reason
    assert "Traceback" not in err


def _run_refusal(tmp_path) -> str:
    """What the run itself says when it sets up OneBitAdam under fp16 (the engine's own check, at fit)."""
    from lightning_zero import ZeroPrecision
    from lightning_zero.optim import OneBitAdam

    class Net(_Net):
        def configure_optimizers(self):
            return OneBitAdam(self.parameters(), lr=4e-4, freeze_step=23000)

    trainer = Trainer(strategy=ZeroStrategy(stage=0, precision_plugin=ZeroPrecision("16-mixed")), accelerator="cpu",
                      devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=str(tmp_path))
    with pytest.raises(ValueError) as caught:
        data = DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1)), batch_size=4)
        trainer.fit(Net(from_deepspeed_config({})), data)
    return str(caught.value)


def test_onebit_adam_tutorial_in_bf16_translates_by_deepspeeds_batch_rule(tmp_path):
    """The same config with the precision the refusal allows: 4096 = 16 x accumulation x world size."""
    path = _write(tmp_path, ONEBIT_TUTORIAL.replace('"fp16"', '"bf16"'))
    with pytest.raises(DeepSpeedConfigError, match=r"leaves gradient_accumulation_steps to the world size.*Allowed: "
                                                   r"--world-size N .* one of 1, 2, 4, 8, 16, 32, 64, 128, 256"):
        from_deepspeed_config(path)  # never 16 per rank x however many ranks run
    t = from_deepspeed_config(path, world_size=128)
    assert (t.micro_batch_size, t.trainer["accumulate_grad_batches"], t.world_size) == (16, 2, 128)
    assert t.precision == "bf16-mixed"
    overrides, notes = t.hydra_overrides()
    assert "data.batch_size=16" in overrides and "trainer.accumulate_grad_batches=2" in overrides
    assert "optim.name=onebit_adam" in overrides and "optim.freeze_step=23000" in overrides
    assert any("run on 128 ranks" in n for n in notes)
    from t5_config import build_strategy, validate_schema
    from t5_optim import check_optimizer

    cfg = compose_recipe(*overrides)  # the recipe starts: its own checks before any rank, the engine's included
    validate_schema(cfg)
    check_optimizer(cfg, build_strategy(cfg))
    assert (cfg.data.batch_size, cfg.trainer.accumulate_grad_batches, cfg.optim.name) == (16, 2, "onebit_adam")


def test_zero3_tutorial_translates_into_a_run_that_starts(tmp_path):
    t = from_deepspeed_config(_write(tmp_path, ZERO3_TUTORIAL))
    assert t.strategy["stage"] == 3 and t.precision == "16-mixed"
    assert t.optimizer == (torch.optim.AdamW, {"lr": 0.001, "betas": (0.8, 0.999), "eps": 1e-8, "weight_decay": 3e-7})
    trainer = _fit(t, tmp_path)
    assert trainer.global_step == 2 and trainer.strategy.zero_config.stage == 3
    assert trainer.precision_plugin.precision == "16-mixed"


def test_zero_infinity_cpu_tutorial_translates_into_a_run_that_starts(tmp_path):
    t = from_deepspeed_config(_write(tmp_path, ZERO_INFINITY_CPU_TUTORIAL))
    assert t.strategy == {"stage": 3, "offload_optimizer": True, "offload_params": True,
                          "bucket_mb": 1e7 * 4 / 2**20, "persist_numel": 100000}
    trainer = _fit(t, tmp_path)
    z = trainer.strategy.zero_config
    assert trainer.global_step == 2 and (z.stage, z.offload_optimizer, z.offload_params) == (3, True, True)


def test_zero_infinity_nvme_tutorial_translates_where_the_disk_is_not(tmp_path, capsys):
    """nvme_path names the training machine's directory: the translation (a login node) never needs it; the run
    checks it where it starts (the strategy, the recipe), and starts once it is there."""
    path = _write(tmp_path, ZERO_INFINITY_NVME_TUTORIAL)
    out = tmp_path / "ds.overrides"
    assert cli_main(["from-deepspeed", str(path), "--out", str(out)]) == 0
    overrides = out.read_text().split()
    assert "strategy.nvme_path=/nvme_data" in overrides and "strategy.offload_params=nvme" in overrides
    t = from_deepspeed_config(path)
    assert t.strategy == {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": "/nvme_data"}
    with pytest.raises(ValueError, match="nvme_path='/nvme_data' does not exist"):
        t.make_strategy()  # the run's own check, at its start
    from t5_config import ConfigError, build_strategy

    with pytest.raises(ConfigError, match="nvme_path='/nvme_data' does not exist"):
        build_strategy(compose_recipe(*overrides))  # the recipe's start
    scratch = tmp_path / "nvme"
    scratch.mkdir()
    assert build_strategy(compose_recipe(*overrides, f"strategy.nvme_path={scratch}")).zero_config.nvme_path == \
        str(scratch)
    trainer = _fit(t, tmp_path, nvme_path=str(scratch))
    z = trainer.strategy.zero_config
    assert trainer.global_step == 2 and (z.offload_optimizer, z.offload_params, z.nvme_path) == ("nvme", "nvme",
                                                                                                 str(scratch))


# -- DeepSpeed's batch rule: train_batch_size = micro x accumulation x world size ----------------------------
@pytest.mark.parametrize("cfg, world, want", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, 2, (8, 4, 2)),  # accumulation derived
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 4, (8, 2, 4)),  # micro-batch derived
    ({"train_batch_size": 64}, 4, (16, 1, 4)),  # DeepSpeed: accumulation 1, micro = total // world
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, None, (8, 2, 4)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, 4, (8, 2, 4)),
    ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, None, (8, 2, None)),  # total derived
    ({"train_micro_batch_size_per_gpu": 8}, 3, (8, None, None)),
])
def test_batch_sizes_follow_deepspeeds_rule(cfg, world, want):
    t = from_deepspeed_config(cfg, world_size=world)
    assert (t.micro_batch_size, t.trainer.get("accumulate_grad_batches"), t.world_size) == want
    if t.world_size:
        assert t.micro_batch_size * t.trainer["accumulate_grad_batches"] * t.world_size == cfg["train_batch_size"]


@pytest.mark.parametrize("cfg, world, match", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, None,
     r"leaves gradient_accumulation_steps to the world size .* Allowed: --world-size N .* one of 1, 2, 4, 8\.$"),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, None,
     r"leaves train_micro_batch_size_per_gpu to the world size .* one of 1, 2, 4, 8, 16, 32\.$"),
    ({"train_batch_size": 64}, None, r"Allowed: --world-size N .* one of 1, 2, 4, 8, 16, 32, 64\.$"),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 3,
     r"does not split over world size 3 .* Allowed: world size one of 1, 2, 4, 8, 16, 32\.$"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, 2,
     r"64 != train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 2 x world size 2 .* Allowed: world size 4"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}, None,
     r"Allowed: train_batch_size a multiple of 24"),
    ({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 8}, 2,
     r"not a multiple of train_micro_batch_size_per_gpu=8\. Allowed: train_batch_size a multiple of 8"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"}, 2,
     r"train_micro_batch_size_per_gpu \"auto\".* Allowed: give them as numbers"),
    ({"train_batch_size": 64}, 0, r"world size 0: allowed a positive integer"),
    ({"train_micro_batch_size_per_gpu": 8}, -3, r"world size -3: allowed a positive integer"),
    ({}, 1.5, r"world size 1.5: allowed a positive integer"),
    ({"train_batch_size": -64}, 2, r"train_batch_size=-64: allowed a positive integer"),
    ({"train_micro_batch_size_per_gpu": 0}, 2, r"train_micro_batch_size_per_gpu=0: allowed a positive integer"),
])
def test_batch_sizes_deepspeed_would_not_run_are_refused_naming_what_is_allowed(cfg, world, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_deepspeed_config(cfg, world_size=world)


def test_cli_derives_accumulation_from_the_world_size(tmp_path, capsys):
    """The issue's reproduction: 64 / 8 on 2 ranks is accumulation 4, not a refusal (and not 8 x ranks)."""
    path = _write(tmp_path, '{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}')
    assert cli_main(["from-deepspeed", str(path), "--world-size", "2"]) == 0
    out, err = capsys.readouterr()
    assert {"data.batch_size=8", "trainer.accumulate_grad_batches=4"} <= set(out.split())
    assert "run on 2 ranks" in err
    assert cli_main(["from-deepspeed", str(path)]) == 2
    assert "Allowed: --world-size N" in capsys.readouterr().err


# -- what the run refuses, refused at translation with the run's message -------------------------------------
@pytest.mark.parametrize("opt, zero, fp16, reason", [
    ("OneBitAdam", {"stage": 2}, False, "ZeRO stage 2 shards the gradients"),
    ("OneBitAdam", {"stage": 3}, False, "ZeRO stage 3 shards the gradients"),
    ("ZeroOneAdam", {"stage": 1}, False, "ZeRO stage 1 gives every master slice one owner"),
    ("OneBitAdam", {"stage": 1, "offload_optimizer": {"device": "cpu"}}, False, "optimizer offload"),
    ("ZeroOneAdam", {"stage": 0}, True, "fp16 loss scaling"),
])
def test_compressed_adams_the_run_refuses_are_refused_at_translation(opt, zero, fp16, reason):
    cfg = {"optimizer": {"type": opt, "params": {"lr": 1e-3}}, "zero_optimization": zero,
           "fp16": {"enabled": fp16}}
    with pytest.raises(DeepSpeedConfigError, match=f"the run refuses it: {opt} does not compose with this setup: "
                                                   f".*{reason}.*Allowed: ZeroStrategy\\(stage=0\\)"):
        from_deepspeed_config(cfg)


@pytest.mark.parametrize("opt, stage", [("OneBitAdam", 0), ("OneBitAdam", 1), ("ZeroOneAdam", 0)])
def test_compressed_adams_the_run_takes_translate(opt, stage):
    t = from_deepspeed_config({"optimizer": {"type": opt, "params": {"lr": 1e-3}},
                               "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    assert t.optimizer[0].__name__ == opt and t.strategy["stage"] == stage


# -- DeepSpeed's config dialect --------------------------------------------------------------------------------
def test_config_files_read_as_deepspeeds_hjson_loader_reads_them(tmp_path):
    text = '{\n  # a comment\n  "zero_optimization": {"stage": 2,}  // another\n  "gradient_clipping": 1.0,\n}\n'
    t = from_deepspeed_config(_write(tmp_path, text))
    assert t.strategy["stage"] == 2 and t.trainer["gradient_clip_val"] == 1.0
    with pytest.raises(DeepSpeedConfigError, match=r"key 'stage' is given twice\. Allowed: each key once"):
        from_deepspeed_config(_write(tmp_path, '{"zero_optimization": {"stage": 2, "stage": 3}}', "dup.json"))
    with pytest.raises(DeepSpeedConfigError, match=r"is not valid JSON: .*line 1 column 24.* Allowed: JSON, with "
                                                   r"trailing commas"):
        from_deepspeed_config(_write(tmp_path, '{"zero_optimization": {stage: 2}}', "quoteless.json"))
