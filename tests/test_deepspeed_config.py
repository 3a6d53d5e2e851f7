"""A DeepSpeed JSON config becomes the same run here: ZeRO settings, precision and loss scaler, Trainer flags,
micro-batch, optimizer and LR schedule (DeepSpeed's formulas), recipe overrides; unsupported settings are refused."""
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import (DeepSpeedConfigError, DeepSpeedWarmupLR, ZeroPrecision, ZeroStrategy,
                            from_deepspeed_config)
from lightning_zero.tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]

HF_STYLE = {  # the shape of the configs HF / DeepSpeed users keep (stage 3 offload, bf16)
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "bf16": {"enabled": True}, "fp16": {"enabled": False},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "reduce_bucket_size": 2**20, "stage3_param_persistence_threshold": 5000,
        "stage3_gather_16bit_weights_on_model_save": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
                             "total_num_steps": 100, "warmup_type": "linear"}},
}


def test_hf_style_config_translates_key_by_key():
    t = from_deepspeed_config(HF_STYLE)
    assert t.strategy == {"stage": 3, "offload_optimizer": True, "offload_params": True,
                          "bucket_mb": 2.0, "persist_numel": 5000}  # 2**20 bf16 elements = 2 MiB
    assert t.precision == "bf16-mixed" and t.precision_kwargs == {}
    assert t.trainer == {"accumulate_grad_batches": 4, "gradient_clip_val": 1.0}
    assert t.micro_batch_size is None  # "auto" = not set
    assert t.optimizer == (torch.optim.AdamW, {"lr": 3e-4, "betas": (0.9, 0.98), "eps": 1e-6, "weight_decay": 0.1})
    assert set(t.ignored) == {"steps_per_print", "zero_optimization.overlap_comm",
                              "zero_optimization.contiguous_gradients",
                              "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                              "zero_optimization.offload_optimizer.pin_memory",
                              "zero_optimization.offload_param.pin_memory"}  # said, never dropped silently
    s = t.make_strategy(start_method="fork")
    assert isinstance(s, ZeroStrategy)
    assert (s.zero_config.stage, s.zero_config.offload_optimizer, s.zero_config.offload_params) == (3, True, True)
    assert s.zero_config.bucket_mb == 2.0 and s.zero_config.persist_numel == 5000
    assert isinstance(s.precision_plugin, ZeroPrecision) and s.precision_plugin.precision == "bf16-mixed"


def test_fp16_scaler_settings_reach_the_precision_plugin():
    t = from_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                        "loss_scale_window": 500, "hysteresis": 4, "min_loss_scale": 8}})
    assert t.precision == "16-mixed" and t.strategy["stage"] == 0
    scaler = t.make_precision()._scaler_args
    assert scaler["init_scale"] == 2.0**12 and scaler["scale_window"] == 500
    assert scaler["hysteresis"] == 4 and scaler["min_scale"] == 8
    static = from_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 128}}).make_precision()
    assert static._static_scale == 128.0


def test_deepspeed_adam_is_adamw_unless_told_otherwise():
    adamw = from_deepspeed_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}).optimizer
    assert adamw == (torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.0})  # DeepSpeed's default decay is 0
    adam = from_deepspeed_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False,
                                                                           "weight_decay": 0.01}}}).optimizer
    assert adam == (torch.optim.Adam, {"lr": 1e-4, "weight_decay": 0.01})


def test_train_batch_size_derives_and_checks_the_micro_batch():
    cfg = {"train_batch_size": 64, "gradient_accumulation_steps": 2}
    assert from_deepspeed_config(cfg, world_size=4).micro_batch_size == 8
    with pytest.raises(DeepSpeedConfigError, match="does not split over world size 3"):
        from_deepspeed_config(cfg, world_size=3)
    with pytest.raises(DeepSpeedConfigError, match="train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 "
                                                   "x world size 4"):
        from_deepspeed_config({**cfg, "train_micro_batch_size_per_gpu": 4}, world_size=4)


@pytest.mark.parametrize("cfg, match", [
    ({"zero_optimization": {"stage": 4}}, "Allowed stages: 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_params with stage 3 only"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}},
     "offload_param.device='disk' is not supported. Allowed: 'cpu', 'none', 'nvme'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/y"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
     "offload_param.nvme_path='/y' differs from the optimizer's '/x'. Allowed: one nvme_path for both"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}},
     "offload_optimizer.device='disk' is not supported. Allowed: 'cpu', 'none', 'nvme'"),
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}}, r"unsupported key\(s\) \['zero_hpz"),
    ({"pipeline": {"stages": 2}}, r"top level: unsupported key\(s\) \['pipeline'\]"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "Allowed: Adam, AdamW, SGD, Adagrad"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.9]}}}, "do not fit SGD"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "Allowed: WarmupLR, WarmupDecayLR"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}}, "needs total_num_steps"),
])
def test_unsupported_settings_are_refused_naming_what_is_allowed(cfg, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_deepspeed_config(cfg)


def _deepspeed_lr(it, typ, lo, hi, warm, total):
    """DeepSpeed's WarmupLR / WarmupDecayLR (runtime/lr_schedules.py), written out for iteration ``it``."""
    if it < 0:
        return lo
    warm = max(2, warm)
    if it < warm:
        gamma = math.log(it + 1) / math.log(warm) if typ == "log" else it / warm
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warm))
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("typ", ["log", "linear"])
@pytest.mark.parametrize("total", [None, 30])
def test_warmup_schedules_follow_deepspeed_formulas(typ, total):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    kind = "WarmupLR" if total is None else "WarmupDecayLR"
    sched = DeepSpeedWarmupLR(opt, type=kind, warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=10,
                              warmup_type=typ, total_num_steps=total)
    seen = []
    for _ in range(40):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [_deepspeed_lr(i - 1, typ, 0.01, 0.2, 10, total) for i in range(40)]
    assert seen[0] == pytest.approx(0.01)  # DeepSpeed's first step runs at warmup_min_lr
    assert seen == pytest.approx(want, rel=1e-12, abs=1e-15)
    ds = _deepspeed_schedules()
    if ds is not None:  # DeepSpeed installed (bench extra): its own class gives the same trajectory
        opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
        kw = dict(warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=10, warmup_type=typ)
        ref = ds.WarmupLR(opt2, **kw) if total is None else ds.WarmupDecayLR(opt2, total_num_steps=total, **kw)
        theirs = []
        for _ in range(40):
            theirs.append(opt2.param_groups[0]["lr"])
            ref.step()
        assert seen == pytest.approx(theirs, rel=1e-12, abs=1e-15)


def _deepspeed_schedules():
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.runtime import lr_schedules
        return lr_schedules
    except Exception:  # noqa: BLE001 -- DeepSpeed is an optional bench peer, not a test dependency
        return None


class _Tiny(LightningModule):
    def __init__(self, translation):
        super().__init__()
        self.t = translation
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lrs, self.stages = [], []

    def training_step(self, batch, _):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.stages.append(self.trainer.strategy.engine.config.stage)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.t.configure_optimizers(self.parameters())


def test_translated_run_trains_with_deepspeed_schedule(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                                                        "warmup_type": "linear"}}}
    t = from_deepspeed_config(cfg, world_size=1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = _Tiny(t)
    trainer = Trainer(strategy=t.make_strategy(), accelerator="cpu", devices=1, max_steps=6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), **t.trainer)
    trainer.fit(model, DataLoader(data, batch_size=t.micro_batch_size))
    assert trainer.global_step == 6 and trainer.gradient_clip_val == 0.5
    assert model.lrs == pytest.approx([_deepspeed_lr(i - 1, "linear", 0.0, 1e-2, 4, None) for i in range(6)])
    assert model.stages == [2] * 6  # every step ran through the ZeRO-2 engine


def test_overrides_compose_into_the_recipe_and_cli_writes_them(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    from hydra import compose, initialize_config_dir
    from t5_config import validate_schema

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_STYLE))
    out = tmp_path / "ds.overrides"
    assert cli_main(["from-deepspeed", str(path), "--out", str(out)]) == 0
    overrides = out.read_text().split()
    err = capsys.readouterr().err
    assert "note: steps_per_print: no effect here" in err and "scheduler WarmupDecayLR" in err
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("t5_finetune", overrides=overrides)
    validate_schema(cfg)
    assert (cfg.strategy.stage, cfg.strategy.offload_params, cfg.trainer.precision) == (3, True, "bf16-mixed")
    # no unit_classes override: the recipe's unit policy makes the T5 blocks units, as its zero3 preset does
    assert cfg.strategy.unit_classes is None and cfg.strategy.name == "zero3_offload"
    assert (cfg.trainer.accumulate_grad_batches, cfg.optim.warmup_steps, cfg.optim.total_steps) == (4, 10, 100)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    assert cli_main(["from-deepspeed", str(bad)]) == 2
    assert "Allowed stages: 0, 1, 2, 3" in capsys.readouterr().err


HF_DOCS_ZERO3 = {  # HF's documented ZeRO-3 offload config, every tunable "auto"
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_auto_keys_keep_the_recipe_settings_and_say_so(tmp_path, capsys):
    """HF's "auto" means "the setting beside it": composed with the overrides, the recipe's own clipping, weight
    decay, precision, LR, warmup, accumulation, micro-batch and bucket stay, exactly as its zero3_offload preset."""
    sys.path.insert(0, str(ROOT / "examples"))
    from hydra import compose, initialize_config_dir

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_DOCS_ZERO3))
    out = tmp_path / "ds.overrides"
    assert cli_main(["from-deepspeed", str(path), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    overrides = out.read_text().split()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        translated = compose("t5_finetune", overrides=overrides)
        preset = compose("t5_finetune", overrides=["strategy=zero3_offload"])
    assert translated.strategy == preset.strategy
    for key in ("trainer", "optim", "data"):
        assert translated[key] == preset[key], key
    for key, field_ in (("gradient_clipping", "trainer.gradient_clip_val"), ("bf16.enabled", "trainer.precision"),
                        ("optimizer.params.weight_decay", "optim.weight_decay"), ("optimizer.params.lr", "optim.lr"),
                        ("scheduler.params.warmup_num_steps", "optim.warmup_steps"),
                        ("gradient_accumulation_steps", "trainer.accumulate_grad_batches"),
                        ("zero_optimization.reduce_bucket_size", "strategy.bucket_mb")):
        assert f'note: {key}: "auto" -> left to the recipe\'s {field_}' in err, key
    assert "zero_optimization.offload_param.pin_memory: no effect here" in err


def test_auto_keys_resolve_from_trainer_arguments_as_hf_does():
    auto = {"max_grad_norm": 1.0, "weight_decay": 0.01, "precision": "bf16-mixed", "learning_rate": 3e-4,
            "adam_beta1": 0.9, "adam_beta2": 0.98, "adam_epsilon": 1e-6, "warmup_steps": 10,
            "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "hidden_size": 512}
    t = from_deepspeed_config(HF_DOCS_ZERO3, auto=auto)
    assert t.trainer == {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0}
    assert t.precision == "bf16-mixed" and t.micro_batch_size == 8
    assert t.optimizer == (torch.optim.AdamW, {"lr": 3e-4, "betas": (0.9, 0.98), "eps": 1e-6, "weight_decay": 0.01})
    assert t.strategy["bucket_mb"] == 512 * 512 * 2 / 2**20 and t.strategy["persist_numel"] == 5120  # HF's formulas
    assert t.scheduler == {"type": "WarmupLR", "warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}
    assert t.auto["gradient_clipping"] == "1.0 (from max_grad_norm)"
    sched = t.configure_optimizers([torch.zeros(2, requires_grad=True)])["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(12):
        lrs.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    assert lrs[-1] == pytest.approx(3e-4) and max(lrs) == pytest.approx(3e-4)  # warms up to HF's learning_rate


def test_unresolved_auto_defers_to_the_trainer_or_asks_for_the_value():
    t = from_deepspeed_config(HF_DOCS_ZERO3)
    assert t.precision is None and "gradient_clip_val" not in t.trainer  # the Trainer's own flags stay
    assert "weight_decay" not in t.optimizer[1]  # never DeepSpeed's 0.0 in place of "auto"
    strategy = t.make_strategy(start_method="fork")
    trainer = Trainer(strategy=strategy, precision="bf16-mixed", accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"  # the Trainer's flag, not 32-true
    with pytest.raises(DeepSpeedConfigError, match="learning_rate"):
        t.configure_optimizers([torch.zeros(2, requires_grad=True)])
    with pytest.raises(DeepSpeedConfigError, match="warmup_steps"):
        from_deepspeed_config(HF_DOCS_ZERO3, auto={"learning_rate": 1e-3}).configure_optimizers(
            [torch.zeros(2, requires_grad=True)])


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "four"])
def test_non_positive_accumulation_is_refused(value):
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps.*positive integer"):
        from_deepspeed_config({"gradient_accumulation_steps": value})


def test_bad_paths_are_refused_with_one_clear_error(tmp_path, capsys):
    with pytest.raises(DeepSpeedConfigError, match="is a directory"):
        from_deepspeed_config(tmp_path)
    with pytest.raises(DeepSpeedConfigError, match="no such file"):
        from_deepspeed_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DeepSpeedConfigError, match="not valid JSON"):
        from_deepspeed_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(DeepSpeedConfigError, match="expected a JSON object"):
        from_deepspeed_config(tmp_path / "list.json")
    assert cli_main(["from-deepspeed", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "Traceback" not in err


def test_zero_infinity_optimizer_offload_translates(tmp_path):
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4,
                                                       "buffer_size": 1e8, "pipeline_read": True}},
           "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1}}
    t = from_deepspeed_config(cfg)
    assert t.strategy == {"stage": 3, "offload_optimizer": "nvme", "offload_params": True,
                          "nvme_path": str(tmp_path), "nvme_buffer_count": 4}
    assert {"aio", "zero_optimization.offload_optimizer.buffer_size",
            "zero_optimization.offload_optimizer.pipeline_read"} <= set(t.ignored)
    from lightning_zero import ZeroStrategy

    s = ZeroStrategy(**t.strategy)
    assert (s.zero_config.offload_optimizer, s.zero_config.nvme_path, s.zero_config.nvme_buffer_count) == \
        ("nvme", str(tmp_path), 4)
    overrides, _ = t.hydra_overrides()
    assert "strategy.name=zero3_offload_nvme" in overrides and "strategy.offload_optimizer=nvme" in overrides
    assert f"strategy.nvme_path={tmp_path}" in overrides


def test_zero_infinity_parameter_offload_translates(tmp_path):
    """Lightning's deepspeed_stage_3_offload_nvme config (offload_param and offload_optimizer on "nvme", one
    nvme_path, its buffer counts and sizes): parameter shards on NVMe too, what has no effect listed."""
    block = {"nvme_path": str(tmp_path), "pin_memory": False}
    cfg = {"zero_optimization": {"stage": 3,
                                 "offload_optimizer": {"device": "nvme", "buffer_count": 4, **block},
                                 "offload_param": {"device": "nvme", "buffer_count": 5, "buffer_size": 1e8,
                                                   "max_in_cpu": 1e9, **block}}}
    t = from_deepspeed_config(cfg)
    assert t.strategy == {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme",
                          "nvme_path": str(tmp_path), "nvme_buffer_count": 4}
    assert {"zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
            "zero_optimization.offload_param.max_in_cpu"} <= set(t.ignored)
    assert "prefetch + nvme_buffer_count" in t.ignored["zero_optimization.offload_param.buffer_count"]
    from lightning_zero import ZeroStrategy

    z = ZeroStrategy(**t.strategy).zero_config
    assert (z.offload_params, z.offload_optimizer, z.nvme_path) == ("nvme", "nvme", str(tmp_path))
    only_params = from_deepspeed_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", **block}}})
    assert only_params.strategy == {"stage": 3, "offload_optimizer": False, "offload_params": "nvme",
                                    "nvme_path": str(tmp_path)}
    overrides, _ = only_params.hydra_overrides()
    assert "strategy.name=zero3_offload_nvme" in overrides and "strategy.offload_params=nvme" in overrides


# -- DeepSpeed's 1-bit Adam / 0/1 Adam configs (its optimizers are gone since 2026) -------------------------------
ONEBIT_DS = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
             "optimizer": {"type": "OneBitAdam", "params": {"lr": 2e-4, "betas": [0.8, 0.999], "eps": 1e-8,
                                                            "weight_decay": 0.01, "freeze_step": 400,
                                                            "cuda_aware": False, "comm_backend_name": "nccl"}}}
ZEROONE_DS = {"optimizer": {"type": "ZeroOneAdam", "params": {
    "lr": 1e-3, "weight_decay": 0.0, "var_freeze_step": 1000, "var_update_scaler": 16, "local_step_scaler": 1000,
    "local_step_clipper": 16, "cuda_aware": False, "comm_backend_name": "nccl"}}}


def test_deepspeed_onebit_and_zeroone_adam_configs_translate():
    from lightning_zero.optim import OneBitAdam, ZeroOneAdam

    t = from_deepspeed_config(ONEBIT_DS)
    assert t.optimizer == (OneBitAdam, {"lr": 2e-4, "betas": (0.8, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                                        "freeze_step": 400})
    assert {"optimizer.params.cuda_aware", "optimizer.params.comm_backend_name"} <= set(t.ignored)
    opt = t.configure_optimizers(nn.Linear(3, 2).parameters())
    assert isinstance(opt, OneBitAdam) and opt.freeze_step == 400 and opt.defaults["betas"] == (0.8, 0.999)
    z = from_deepspeed_config(ZEROONE_DS)
    assert z.optimizer[0] is ZeroOneAdam and z.optimizer[1]["var_freeze_step"] == 1000
    assert isinstance(z.configure_optimizers(nn.Linear(3, 2).parameters()), ZeroOneAdam)


@pytest.mark.parametrize("params,match", [
    ({"amsgrad": True}, r"params.amsgrad is not supported \(allowed: amsgrad=False\)"),
    ({"max_grad_norm": 1.0}, r"params.max_grad_norm is not supported \(allowed: max_grad_norm=0.0; clip with "
                             r"gradient_clipping\)"),
    ({"freeze_step": 0}, r"do not fit OneBitAdam: Invalid freeze_step 0"),
])
def test_what_onebit_adam_cannot_take_is_refused(params, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_deepspeed_config({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, **params}}})
    with pytest.raises(DeepSpeedConfigError, match=r"Allowed: Adam, AdamW, SGD, Adagrad, Adafactor, Muon, OneBitAdam, ZeroOneAdam"):
        from_deepspeed_config({"optimizer": {"type": "OneBitLamb", "params": {}}})


@pytest.mark.parametrize("ds,want", [
    (ONEBIT_DS, {"optim.name": "onebit_adam", "optim.freeze_step": 400, "strategy.stage": 1}),
    (ZEROONE_DS, {"optim.name": "zeroone_adam", "optim.freeze_step": 1000, "optim.local_step_scaler": 1000}),
])
def test_compressed_adam_configs_become_the_recipes_optim_name(ds, want):
    sys.path.insert(0, str(ROOT / "examples"))
    from hydra import compose, initialize_config_dir
    from t5_config import validate_schema

    overrides, notes = from_deepspeed_config(ds).hydra_overrides()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("t5_finetune", overrides=overrides)
    validate_schema(cfg)
    for key, value in want.items():
        section, name = key.split(".")
        assert cfg[section][name] == value, (key, overrides)
    assert any("betas" in n for n in notes) == ("betas" in ds["optimizer"]["params"])  # the recipe keeps AdamW's
