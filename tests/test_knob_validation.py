"""Every constructor knob of ZeroConfig, ZeroStrategy, ZeroPipelineStrategy and
ZeroFabricStrategy is checked at construction: valid values pass, each kind of bad value (wrong type, out of
range, not in the allowed set, a refused combination) is one ValueError naming the knob and what is allowed.
A table row per knob; ``test_every_parameter_has_a_row`` fails as soon as a signature gains a knob without
one. Knobs that name modules of the model (``unit_classes``) are checked at setup: a real Trainer fit.

Pipeline x ``offload_optimizer`` is accepted, not refused: ``test_pipeline_with_offload_optimizer_matches_reference``
shows that it trains as the uncut single-process reference does.
"""

from __future__ import annotations

import inspect
import math
import os
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
from lightning.fabric.plugins.environments import LightningEnvironment as FabricEnv
from lightning.fabric.plugins.io import TorchCheckpointIO as FabricIO
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins import HalfPrecision, MixedPrecision
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import ListConfig
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroConfig, ZeroPrecision, ZeroStrategy
from lightning_zero.lightning.fabric_precision import ZeroFabricPrecision
from lightning_zero.lightning.fabric_strategy import ZeroFabricStrategy
from lightning_zero.lightning.pipeline_strategy import ZeroPipelineStrategy
from tests.helpers.lightning_models import TokenDataset, trainer_kwargs
from tests.helpers.zoo_models import VOCAB, gpt2


@dataclass
class Knob:
    good: list  # values accepted (with ``ctx``)
    bad: list  # (value, regex) or (value, regex, ctx): each refused with a ValueError matching the regex
    ctx: dict = field(default_factory=dict)  # the other arguments the good values are given with


@pytest.fixture(autouse=True)
def _no_nvme_path_from_the_environment(monkeypatch):
    """The table's nvme rows give nvme_path themselves; None must mean "no directory" here."""
    monkeypatch.delenv("LIGHTNING_ZERO_NVME_PATH", raising=False)


BOOL = r"must be True or False"
TMP = tempfile.gettempdir()  # an existing, writable directory (nvme_path)
# the offload knobs read back as False / True (host memory) / "nvme"
_OFFLOAD_NORMAL = lambda v: {"none": False, "cpu": True}.get(v.lower(), v.lower()) if isinstance(v, str) else v  # noqa: E731
# the state dtypes read back as "fp32" / "bf16" (None: the default, fp32)
_STATE_DTYPE_NORMAL = lambda v: "bf16" if v in ("bf16", "bfloat16", torch.bfloat16) else "fp32"  # noqa: E731
# -- ZeroConfig: every field; the strategies take each of them too ----------------------------------------------------
CONFIG = {
    "stage": Knob([0, 1, 2, 3, np.int64(3)], [(5, "Allowed stages: 0, 1, 2, 3"), (2.0, "Allowed stages"),
                                              ("2", "Allowed stages"), (True, "Allowed stages"), (None, "stage")]),
    "offload_optimizer": Knob([True, False, "cpu", "none", "CPU"], [
        ("no", BOOL), (1, BOOL), ("disk", r"or one of 'none', 'cpu', 'nvme'"),
        (True, r"Allowed: offload_optimizer with stage 1, 2 or 3", dict(stage=0)),
        ("nvme", r"Allowed: offload_optimizer with stage 1, 2 or 3", dict(stage=0, nvme_path=TMP)),
        ("nvme", r"offload_optimizer='nvme' needs a directory for the scratch files: nvme_path=DIR")], dict(stage=1)),
    "offload_params": Knob([True, False, "cpu", "nvme", "NVMe"], [
        ("yes", BOOL), ("disk", r"or one of 'none', 'cpu', 'nvme'"),
        (True, r"Allowed: offload_params with stage 3 only", dict(stage=2)),
        ("nvme", r"offload_params='nvme' needs partitioned parameters \(stage 3\).*Allowed: offload_params with stage 3 "
                 r"only", dict(stage=2)),
        ("nvme", r"offload_params='nvme' needs a directory for the scratch files: nvme_path=DIR",
         dict(nvme_path=None, offload_optimizer=False))],
        dict(stage=3, offload_optimizer="nvme", nvme_path=TMP)),  # nvme_path is used by every value
    "nvme_path": Knob([TMP, Path(TMP)], [("/no/such/dir", r"nvme_path='/no/such/dir' does not exist .*Allowed: an "
                                                          r"existing, writable directory"),
                                         ("/proc", r"nvme_path='/proc' is not writable by this process"),
                                         (3, r"nvme_path must be None or a directory path"),
                                         ("", r"nvme_path='' is empty\. Allowed: an existing, writable directory"),
                                         ("", r"nvme_path='' given without NVMe offload", dict(offload_optimizer=True)),
                                         (TMP, r"nvme_path='.*' given without NVMe offload \(offload_optimizer=True, "
                                               r"offload_params=False\): it would be ignored\. Allowed: NVMe knobs "
                                               r"with offload_optimizer='nvme' or offload_params='nvme'",
                                          dict(offload_optimizer=True)),
                                         (None, r"needs a directory for the scratch files: nvme_path=DIR \(or the "
                                                r"environment variable LIGHTNING_ZERO_NVME_PATH\)")],
                      dict(stage=2, offload_optimizer="nvme")),
    "nvme_direct": Knob([True, False], [(v, BOOL) for v in ("yes", 1, None)] + [
        (True, r"nvme_direct=True given without NVMe offload", dict(offload_optimizer=False)),
        (True, r"nvme_direct=True opens the optimizer's scratch files with O_DIRECT; with offload_params='nvme' alone "
               r"there are none.*Allowed: nvme_direct=True with offload_optimizer='nvme'",
         dict(stage=3, offload_optimizer=False, offload_params="nvme"))],
                        dict(stage=2, offload_optimizer="nvme", nvme_path=TMP)),
    "nvme_buffer_count": Knob([2, 3, 8], [(v, r"nvme_buffer_count must be an int >= 2") for v in (1, 2.0, True, None)]
                              + [(4, r"nvme_buffer_count=4 given without NVMe offload", dict(offload_optimizer=True))],
                              dict(stage=2, offload_optimizer="nvme", nvme_path=TMP)),
    "offload_kernel": Knob(["fused", "user"], [("FUSED", "offload_kernel must be one of 'fused', 'user'"),
                                               (True, "offload_kernel must be one of"), (None, "offload_kernel")],
                           dict(stage=2, offload_optimizer=True)),
    "optimizer_state_dtype": Knob(["fp32", "bf16", "bfloat16", torch.bfloat16, torch.float32, None],
                                  [(v, r"optimizer_state_dtype must be 'fp32' \(default\) or 'bf16'; got")
                                   for v in ("fp8", True, 16, torch.int8)]
                                  + [("fp16", r"got 'fp16' \(fp16's 5 exponent bits cannot hold Adam's second moment")]),
    "master_dtype": Knob(["fp32", "bf16", "bfloat16", torch.bfloat16, None],
                         [(v, r"master_dtype must be 'fp32' \(default\) or 'bf16'; got") for v in ("fp8", False, 2)]
                         + [(torch.float16, r"master_dtype must be 'fp32' \(default\) or 'bf16'; got torch.float16"),
                            ("bf16", r"master_dtype='bf16' keeps the master in the published bf16 parameter .*"
                                     r"quantize_weights=True .*Allowed: master_dtype='bf16' without quantize_weights",
                             dict(stage=2, quantize_weights=True))]),
    "bucket_mb": Knob([25, 0.5, np.float32(2)], [(0, "positive number of MiB"), (-1.0, "positive"),
                                                  ("25", "positive"), (True, "positive"), (math.nan, "finite")]),
    "reduce_dtype": Knob([None, "fp32", "bf16", "float16", torch.float32],
                         [("int8", r"Unknown dtype 'int8' for reduce_dtype\. Allowed: None, .*fp32"),
                          (torch.float64, "Allowed: None"), (True, "Allowed: None"), (32, "Allowed: None")]),
    "broadcast_buffers": Knob([True, False], [("no", BOOL), (None, BOOL)]),
    "unit_classes": Knob([None, ["GPT2Block"], "GPT2Block", (nn.Linear, "transformer.h.0"),
                          ListConfig(["GPT2Block"])],  # Hydra's list
                         [(v, r"unit_classes must be None or a non-empty list of module classes, class names or "
                              r"qualified module names") for v in ([3], [], int, {"GPT2Block": 1}, [""], 3.0)]),
    "unit_mb": Knob([None, 1, 0.25], [(0, "positive number of MiB"), ("8", "positive"), (True, "positive"),
                                      (math.inf, "finite")]),
    "persist_numel": Knob([None, 0, 10_000], [(-1, "int >= 0"), (10.5, "int >= 0"), (True, "int >= 0"),
                                               ("x", "int >= 0")]),
    "prefetch": Knob([True, False, 0, 2], [(v, r"prefetch must be True \(1 unit ahead\), False \(none\) or an int >= 0")
                                           for v in ("false", -1, 1.5, None)]),
    "reshard_after_forward": Knob([True, False], [("no", BOOL), (None, BOOL),
                                                  (2, r"reshard_after_forward=2: resharding to a smaller group .*"
                                                      r"Allowed: True .* or False")]),
    "order_check": Knob(["strict", "always", "off"], [(v, r"order_check must be one of 'strict', 'always', 'off'")
                                                      for v in ("sometimes", True, None)]),
    "shard_group_size": Knob([None, 1, 2], [(v, "shard_group_size must be an int >= 1") for v in (0, 2.0, True, "2")],
                             dict(stage=3)),
    "tensor_parallel_size": Knob([None, 1, 2], [(v, "tensor_parallel_size must be an int >= 1") for v in (0, 2.0, True)]
                                 + [(2, r"ZeRO stage 3 cannot be combined with tensor parallelism .*Allowed stages "
                                        r"with tensor parallelism: 0, 1, 2", dict(stage=3))]),
    "sequence_parallel_size": Knob(
        [None, 1, 2, (2, dict(stage=3)), (2, dict(stage=0)), (2, dict(stage=3, shard_group_size=2)),
         (2, dict(stage=3, offload_optimizer=True, offload_params=True))],
        [(v, "sequence_parallel_size must be an int >= 1") for v in (0, 2.0, True, "2")]
        + [(2, r"tensor_parallel_size=2 \(tensor parallelism\) cannot be combined with sequence_parallel_size=2 "
               r"\(sequence parallelism\): the tensor-parallel ranks already split every attention's heads",
            dict(tensor_parallel_size=2))]),
    "activation_checkpointing": Knob(
        [None, "auto", ["GPT2Block"], "GPT2Block", nn.Linear, "AutoBlock", ListConfig(["GPT2Block"])],
        [(v, r"did you mean 'auto'.*Allowed: None, 'auto' or a non-empty list") for v in ("autoo", "Auto", ["auto"])]
        + [(v, r"activation_checkpointing must be None, 'auto' or a non-empty list") for v in ([], 3, [3], [""])]),
    "offload_activations": Knob([True, False], [("yes", BOOL)]),
    "grad_reduce": Knob(["auto", "reduce_scatter", "all_reduce", "all_to_all"],
                        [(v, "grad_reduce must be one of 'auto', 'reduce_scatter'")
                         for v in ("reduce", ["auto"], None)]),
    "overlap_publish": Knob([True, False], [("no", BOOL)] + [
        (True, r"overlap_publish=True .*got stage %d .*Allowed: overlap_publish with stage 1 or 2" % s, dict(stage=s))
        for s in (0, 3)] + [(True, r"overlap_publish=True does not compose with offload_optimizer='nvme'",
                             dict(stage=1, offload_optimizer="nvme", nvme_path=TMP))], dict(stage=1)),
    "quantize_weights": Knob([True, False], [(1, BOOL), (True, "Allowed: quantize_weights with stage 1, 2 or 3",
                                                         dict(stage=0))]),
    "quantize_grads": Knob([True, False], [("on", BOOL), (True, "Allowed: quantize_grads with stage 1, 2 or 3",
                                                          dict(stage=0))]),
}

BACKEND = r"process_group_backend must be None .* or a torch.distributed backend name"
TIMEOUT = r"timeout must be a positive datetime.timedelta"
START = r"Unknown start_method .*Allowed: popen, spawn, fork, forkserver"
DEVICES = r"parallel_devices must be None .* or a non-empty list of torch.device"
TP = r"tensor_parallel_size must be an int >= 1"


def _objects(accelerator, env, io) -> dict:
    """Lightning's own objects: an instance passes, anything else (a name) is refused."""
    return {name: Knob([None, ok], [(v, rf"{name} must be None .* or an instance of {cls}") for v in bad])
            for name, ok, cls, bad in (("accelerator", accelerator, "Accelerator", ("cpu", CPUAccelerator)),
                                       ("cluster_environment", env, "ClusterEnvironment", ("slurm",)),
                                       ("checkpoint_io", io, "CheckpointIO", ("torch",)))}


_COMMON = {  # the strategy knobs both strategies have (zero_setup.check_strategy_knobs)
    "parallel_devices": Knob([None, [torch.device("cpu")] * 2], [(["cpu"], DEVICES), (torch.device("cpu"), DEVICES),
                                                                 ([], DEVICES)]),
    "process_group_backend": Knob([None, "gloo", "cpu:gloo"], [(v, BACKEND) for v in (3, "", "mpi2", ":gloo",
                                                                                     "gloo,gloo")]),
    "timeout": Knob([None, timedelta(minutes=5)], [(60, TIMEOUT), (timedelta(0), TIMEOUT), ("30m", TIMEOUT)]),
    "start_method": Knob(["popen", "spawn", "fork", "forkserver"], [("thread", START), (None, START)]),
    "trust_checkpoint": Knob([True, False], [(v, r"trust_checkpoint must be True or False") for v in ("no", 1, None)]),
    "async_save": Knob([True, False], [(v, r"async_save must be True or False") for v in ("no", 1, None)]),
    "checkpoint_trainable_only": Knob([False, (True, dict(checkpoint_base=str(Path(__file__).parent)))],
                                      [(v, r"checkpoint_trainable_only must be True or False") for v in ("no", 1)]
                                      + [(True, r"checkpoint_trainable_only=True needs the frozen base's source\. "
                                                r"Allowed: checkpoint_base=DIR")]),
    "checkpoint_base": Knob([None, (str(Path(__file__).parent), dict(checkpoint_trainable_only=True))],
                            [(v, r"checkpoint_base=.*: no such directory or file\. Allowed: a save_pretrained "
                                 r"directory", dict(checkpoint_trainable_only=True)) for v in ("/no/such/dir", 3)]
                            + [(str(Path(__file__).parent), r"checkpoint_base=.* is only read by trainable-only "
                                                            r"saves\. Allowed: checkpoint_trainable_only=True")]),
}

# -- ZeroStrategy's own knobs ----------------------------------------------------------------------------------------
TRAINER = {
    **_objects(CPUAccelerator(), LightningEnvironment(), TorchCheckpointIO()),
    **_COMMON,
    "precision_plugin": Knob([None, ZeroPrecision("bf16-mixed"), MixedPrecision("bf16-mixed", "cpu")],
                             [("bf16-mixed", r"precision_plugin must be None or a precision plugin.*Allowed: "
                                             r"precision='32-true', '16-mixed' or 'bf16-mixed'"),
                              (HalfPrecision("16-true"), r"HalfPrecision.*Allowed: precision='32-true'")]),
    "checkpoint_format": Knob(["sharded", "full"], [(v, r"Unknown checkpoint_format .*Allowed: 'sharded', 'full'")
                                                    for v in ("dcp", ["full"])]),
    "memory_summary": Knob([True, False], [(v, r"memory_summary must be True or False") for v in ("no", 1, None)]),
    "load_weights_from": Knob([None, str(Path(__file__).parent)],
                              [(v, r"load_weights_from=.*no such directory or file\. Allowed: None, a save_pretrained")
                               for v in ("/no/such/dir", 3, ["a"])]),
    "tensor_parallel_size": Knob([None, 1, 2], [(0, TP), (2.0, TP), (True, TP),
                                                (2, r"Allowed stages with tensor parallelism: 0, 1, 2", dict(stage=3)),
                                                (2, r"checkpoint_format='full' is not available with "
                                                    r"tensor_parallel_size", dict(checkpoint_format="full"))]),
}

# -- ZeroPipelineStrategy's own knobs (it takes ZeroStrategy's too) ---------------------------------------------------
PIPE = dict(pipeline_parallel_size=2)
PIPELINE = {
    "pipeline_parallel_size": Knob(
        [2, (2, dict(stage=2, offload_optimizer=True)), (2, dict(stage=0))],  # offload: see the test below
        [(v, "pipeline_parallel_size must be an int >= 1") for v in (0, 2.0, True, None)]
        + [(2, r"ZeRO stage 3 cannot be combined with pipeline parallelism .*Allowed stages with pipeline "
               r"parallelism: 0, 1, 2", dict(stage=3)),
           (2, r"shard_group_size=2 .* cannot be combined with pipeline_parallel_size=2 .*Allowed: one of "
               r"shard_group_size and pipeline_parallel_size, or neither",
            dict(shard_group_size=2)),
           (2, r"tensor_parallel_size=2 \(tensor parallelism\) cannot be combined with pipeline_parallel_size",
            dict(tensor_parallel_size=2)),
           (2, r"pipeline_parallel_size=2 \(pipeline parallelism\) cannot be combined with "
               r"sequence_parallel_size=2 .*a sequence-sharded micro-batch", dict(sequence_parallel_size=2)),
           (2, r"checkpoint_format='full' is not available with pipeline_parallel_size",
            dict(checkpoint_format="full")),
           (2, r"memory_summary=True is not available with pipeline_parallel_size.*Allowed: memory_summary=False",
            dict(memory_summary=True)),
           (2, r"load_weights_from=.* is not available with pipeline_parallel_size.*Allowed: load_weights_from=None",
            dict(load_weights_from=str(Path(__file__).parent)))]),
    "pipeline_microbatches": Knob([1, 8], [(v, "pipeline_microbatches must be an int >= 1") for v in (0, 2.0, True)],
                                  PIPE),
    "pipeline_schedule": Knob(["1f1b", "gpipe", "interleaved"],
                              [(v, r"Unknown pipeline_schedule .*Allowed: 1f1b, gpipe, interleaved")
                               for v in ("zb", None, ["gpipe"])], PIPE),
    "pipeline_max_imbalance": Knob([None, 1, 4.0], [(v, r"pipeline_max_imbalance must be a finite number >= 1 .* "
                                                       r"or None") for v in (0.5, "4", True, math.nan)], PIPE),
    "pipeline_chunks": Knob([None, 1], [(0, "pipeline_chunks must be an int >= 1"), (1.0, "pipeline_chunks must be"),
                                        (2, r"pipeline_chunks=2 .*Allowed: pipeline_schedule='interleaved'")],
                            PIPE),
}

# -- ZeroFabricStrategy's own knobs ---------------------------------------------------------------------------------
FABRIC = {
    **_objects(FabricCPU(), FabricEnv(), FabricIO()),
    **_COMMON,
    "precision": Knob([None, ZeroFabricPrecision("bf16-mixed"), FabricMixed("bf16-mixed", "cpu")],
                      [("bf16-mixed", r"precision must be None or a precision plugin.*Allowed: precision='32-true'")]),
    "tensor_parallel_size": Knob([None, 2], [(0, TP), (2, r"Allowed stages with tensor parallelism", dict(stage=3))]),
    "parallelize_fn": Knob([None, (lambda m, mesh: m, dict(tensor_parallel_size=2))],
                           [(3, r"parallelize_fn must be None or a callable"),
                            (lambda m, mesh: m, r"parallelize_fn needs tensor_parallel_size=T")]),
}


def _build(target: str, kwargs: dict):
    if target == "config":
        return ZeroConfig(**kwargs)
    if target == "fabric":
        return ZeroFabricStrategy(**kwargs)
    if target == "pipeline":
        return ZeroPipelineStrategy(**kwargs)
    return ZeroStrategy(**kwargs)


def _cases(tables: dict, kind: str):
    """(target, knob, kwargs[, regex]) for every good value (``kind="good"``) or bad case of the tables."""
    out = []
    for target, table in tables.items():
        for name, knob in table.items():
            for entry in getattr(knob, kind):
                if kind == "good":
                    value, ctx = entry if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], dict) \
                        else (entry, {})
                    out.append(pytest.param(target, name, {**knob.ctx, **ctx, name: value}, None,
                                            id=f"{target}-{name}={value!r}"))
                else:
                    value, regex, ctx = entry if len(entry) == 3 else (*entry, {})
                    kw = {**{k: v for k, v in knob.ctx.items() if k != name}, **ctx, name: value}
                    out.append(pytest.param(target, name, kw, regex, id=f"{target}-{name}={value!r}-{ctx or ''}"))
    return out


# ZeroConfig's knobs go through each constructor the way users pass them
TABLES = {"config": CONFIG, "trainer": {**CONFIG, **TRAINER}, "pipeline": PIPELINE, "fabric": {**CONFIG, **FABRIC}}


@pytest.mark.parametrize("target,name,kwargs,_", _cases(TABLES, "good"))
def test_valid_value_is_accepted(target, name, kwargs, _):
    built = _build(target, kwargs)
    config = built if target == "config" else built.zero_config
    normalized = {"offload_optimizer": _OFFLOAD_NORMAL, "offload_params": _OFFLOAD_NORMAL,
                  "nvme_path": lambda v: os.path.abspath(v), "optimizer_state_dtype": _STATE_DTYPE_NORMAL,
                  "master_dtype": _STATE_DTYPE_NORMAL}
    if name in normalized:
        assert getattr(config, name) == normalized[name](kwargs[name])
    elif name in CONFIG and name not in ("unit_classes", "activation_checkpointing", "reduce_dtype", "order_check"):
        assert getattr(config, name) == kwargs[name]  # kept as given (the normalized ones: below)
    if target == "pipeline":
        assert type(built) is ZeroPipelineStrategy and built.pipeline_parallel_size == kwargs["pipeline_parallel_size"]


@pytest.mark.parametrize("target,name,kwargs,regex", _cases(TABLES, "bad"))
def test_bad_value_is_one_clear_error(target, name, kwargs, regex):
    with pytest.raises(ValueError, match=regex) as err:
        _build(target, kwargs)
    message = str(err.value)
    named = "precision" if name == "precision_plugin" and "HalfPrecision" in message else name  # a Trainer flag too
    assert named in message, message  # the knob ...
    assert "Allowed" in message or "must be" in message, message  # ... and what it may be


def test_normalized_values():
    cfg = ZeroConfig(stage=3, unit_classes="GPT2Block", activation_checkpointing=nn.Linear, reduce_dtype="bf16")
    assert cfg.unit_classes == ["GPT2Block"] and cfg.activation_checkpointing == [nn.Linear]
    assert cfg.reduce_dtype is torch.bfloat16
    assert ZeroConfig(activation_checkpointing="auto").activation_checkpointing == "auto"
    assert ZeroConfig(unit_classes=("GPT2Block",)).unit_classes == ["GPT2Block"]
    assert ZeroConfig(unit_classes=ListConfig(["GPT2Block"])).unit_classes == ["GPT2Block"]  # Hydra's list


def test_unknown_arguments_are_a_type_error():
    with pytest.raises(TypeError, match=r"ZeroStrategy got unknown argument\(s\) stages\. Allowed: stage, "):
        ZeroStrategy(stages=2)
    for name in ("pipeline_parallel_size", "pipeline_microbatches", "pipeline_chunks"):  # ZeroPipelineStrategy's
        with pytest.raises(TypeError, match=rf"unknown argument\(s\) {name} .*ZeroPipelineStrategy\("):
            ZeroStrategy(**{name: 2})
    with pytest.raises(TypeError, match="unknown argument.*stages. Allowed: stage, "):
        ZeroPipelineStrategy(stages=2)
    with pytest.raises(TypeError, match="unknown argument.*Allowed: stage, "):
        ZeroFabricStrategy(memory_summary=True)  # a Trainer-only knob


def _knobs(fn) -> set:
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n for n, p in inspect.signature(fn).parameters.items() if n != "self" and p.kind not in skip}


def test_every_parameter_has_a_row():
    """A knob added to a signature without a row here fails (and every ZeroConfig field reaches both strategies)."""
    assert _knobs(ZeroConfig) == set(CONFIG)
    assert _knobs(ZeroStrategy.__init__) == set(CONFIG) | set(TRAINER)
    assert _knobs(ZeroPipelineStrategy.__init__) == set(CONFIG) | set(TRAINER) | set(PIPELINE)
    assert _knobs(ZeroFabricStrategy.__init__) == set(CONFIG) | set(FABRIC)
    for table in (CONFIG, TRAINER, PIPELINE, FABRIC):
        assert all(k.good and k.bad for k in table.values())


# -- setup-time: unit_classes against the model, through a real fit -------------------------------------------------
class GPT2Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = gpt2()

    def training_step(self, batch, batch_idx):
        ids = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self.model(ids % VOCAB, labels=ids % VOCAB).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TokenDataset(8, 8), batch_size=2)


def _fit(**strategy):
    trainer = Trainer(strategy=ZeroStrategy(**strategy), **trainer_kwargs(devices=1, max_steps=1))
    trainer.fit(GPT2Module())
    return trainer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_unit_class_matching_no_module_is_refused_at_setup(stage):
    trainer = _fit(stage=stage, unit_classes=["GPT2Block"])  # a valid value trains
    assert trainer.global_step == 1
    with pytest.raises(ValueError, match=r"unit_classes entry 'GPT2Blok' matches no module of GPT2Module\. Did you "
                                         r"mean 'GPT2Block'\? Allowed: .*could be units \(GPT2Block, (\w+, )*Conv1D, "
                                         r"(\w+, )*Linear\)") as err:
        _fit(stage=stage, unit_classes=["GPT2Blok"])
    assert "Dropout" not in str(err.value) and "ModuleList" not in str(err.value)  # no parameters / no forward


# -- pipeline x offload_optimizer: accepted because it works ----------------------------------------------------------
def _pipeline_offload(rank, world_size):
    from lightning_zero.engine.pipeline.pipeline_zero import PipelineZero, pipeline_layout
    from lightning_zero.engine.pipeline.split import split_gpt2
    from tests.helpers import pipeline_gpt2 as T

    module = split_gpt2(T.gpt2_model(), 2, pipeline_layout(2).stage_index)
    pipe = PipelineZero(module, 2, T.lm_loss, T.adamw(module.parameters()), T.M,
                        config=ZeroConfig(stage=2, bucket_mb=0.01, offload_optimizer=True),
                        accumulate_grad_batches=T.ACCUM, gradient_clip_val=T.CLIP)
    return T.train_pipeline(pipe, T.CALLS), T.named_state(pipe), pipe.engine.sharded.states.steps_on_host


@pytest.mark.timeout(120)
def test_pipeline_with_offload_optimizer_matches_reference():
    from tests.helpers import pipeline_gpt2 as T
    from tests.helpers.dist_utils import run_distributed
    from tests.helpers.parity import is_close

    ref_losses, ref_sd = T.single_process_reference([1] * T.CALLS)
    merged = {}
    for losses, sd, offloaded in run_distributed(_pipeline_offload, 2):
        assert losses == pytest.approx(ref_losses, rel=T.RTOL) and offloaded
        merged.update(sd)
    assert set(merged) == set(ref_sd)
    assert not [k for k in ref_sd if not is_close(merged[k], ref_sd[k])]


# -- Hydra: the recipe's composed config reaches the same checks ------------------------------------------------------
def test_hydra_values_pass_and_bad_ones_are_refused():
    from tests.helpers.hydra_recipe import compose_recipe  # examples/ on sys.path
    from t5_config import ConfigError, build_strategy

    s = build_strategy(compose_recipe("strategy=zero3", "strategy.unit_classes=[T5Block]", "strategy.persist_numel=0",
                                "strategy.activation_checkpointing=auto", "strategy.shard_group_size=1"))
    assert s.zero_config.unit_classes == ["T5Block"] and s.zero_config.activation_checkpointing == "auto"
    assert build_strategy(compose_recipe("strategy=zero1", "strategy.overlap_publish=true")).zero_config.overlap_publish
    for overrides, match in ((("strategy=zero3", "strategy.overlap_publish=true"), "Allowed: overlap_publish with "
                                                                                   "stage 1 or 2"),
                             (("strategy.activation_checkpointing=autoo",), "did you mean 'auto'"),
                             (("strategy.unit_classes=[]",), "unit_classes must be None or a non-empty list")):
        with pytest.raises(ConfigError, match=match):
            build_strategy(compose_recipe(*overrides))
