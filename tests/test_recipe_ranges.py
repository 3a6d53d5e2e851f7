"""The T5 recipe's numeric knobs: every Hydra override out of its range is one ``ConfigError`` naming the knob
and what it allows, raised by the app before any process starts (examples/t5_ranges.py; the strategy's own
numbers through ``ZeroConfig``), and a value at the edge of its range passes."""
import dataclasses
import os
import subprocess
import sys

import pytest

from tests.helpers.hydra_recipe import CONF, ROOT, compose_recipe  # noqa: F401  (examples/ on sys.path)
from t5_config import ConfigError, T5PretrainConf, validate_schema  # noqa: E402,I001
from t5_ranges import RANGES  # noqa: E402

# override -> what the error must say (the knob with its value, and what is allowed)
BAD = {
    "trainer.num_nodes=0": r"trainer.num_nodes=0 \(allowed: an int >= 1\)",
    "trainer.max_steps=-2": r"trainer.max_steps=-2 \(allowed: an int >= -1\)",
    "trainer.max_epochs=-5": r"trainer.max_epochs=-5 \(allowed: an int >= -1\)",
    "trainer.val_check_interval=0": r"trainer.val_check_interval=0 \(allowed: an int >= 1 \(batches\) or a float",
    "trainer.val_check_interval=1.5": r"trainer.val_check_interval=1.5 \(allowed: .*0 < value <= 1",
    "trainer.check_val_every_n_epoch=0": r"trainer.check_val_every_n_epoch=0 \(allowed: null or an int >= 1\)",
    "trainer.limit_val_batches=-1": r"trainer.limit_val_batches=-1 \(allowed: an int >= 0 \(batches\)",
    "trainer.limit_val_batches=2.5": r"trainer.limit_val_batches=2.5 \(allowed: .*0 <= value <= 1",
    "trainer.num_sanity_val_steps=-2": r"trainer.num_sanity_val_steps=-2 \(allowed: an int >= -1\)",
    "trainer.log_every_n_steps=0": r"trainer.log_every_n_steps=0 \(allowed: an int >= 1\)",
    "trainer.gradient_clip_val=-1": r"trainer.gradient_clip_val=-1.0 \(allowed: null or a number >= 0\)",
    "trainer.gradient_clip_val=nan": r"trainer.gradient_clip_val=nan \(allowed: null or a number >= 0\)",
    "trainer.accumulate_grad_batches=0": r"trainer.accumulate_grad_batches=0 \(allowed: an int >= 1\)",
    "data.batch_size=0": r"data.batch_size=0 \(allowed: an int >= 1\)",
    "data.max_source_len=-5": r"data.max_source_len=-5 \(allowed: an int >= 2\)",
    "data.max_target_len=1": r"data.max_target_len=1 \(allowed: an int >= 2\)",
    "data.limit_train=0": r"data.limit_train=0 \(allowed: null or an int >= 1\)",
    "data.limit_val=-1": r"data.limit_val=-1 \(allowed: null or an int >= 1\)",
    "data.num_workers=-1": r"data.num_workers=-1 \(allowed: an int >= 0\)",
    "data.max_pairs=0": r"data.max_pairs=0 \(allowed: null or an int >= 1\)",
    "data.max_source_chars=0": r"data.max_source_chars=0 \(allowed: an int >= 1\)",
    "tokenizer.vocab_size=100": r"tokenizer.vocab_size=100 \(allowed: an int >= 359 with tokenizer=subword",
    "model.dropout_rate=1.0": r"model.dropout_rate=1.0 \(allowed: a number with 0 <= value < 1\)",
    "model.num_gen_batches=-1": r"model.num_gen_batches=-1 \(allowed: null or an int >= 0\)",
    "model.num_samples=-1": r"model.num_samples=-1 \(allowed: an int >= 0\)",
    "model.max_new_tokens=0": r"model.max_new_tokens=0 \(allowed: an int >= 1\)",
    "model.no_repeat_ngram_size=-1": r"model.no_repeat_ngram_size=-1 \(allowed: an int >= 0\)",
    "model.sparse.block=0": r"model.sparse.block=0 \(allowed: an int >= 1\)",
    "optim.lr=0": r"optim.lr=0.0 \(allowed: a number > 0\)",
    "optim.lr=-inf": r"optim.lr=-inf \(allowed: a number > 0\)",
    "optim.weight_decay=-0.1": r"optim.weight_decay=-0.1 \(allowed: a number >= 0\)",
    "optim.warmup_steps=-1": r"optim.warmup_steps=-1 \(allowed: an int >= 0\)",
    "optim.total_steps=0": r"optim.total_steps=0 \(allowed: null or an int >= 1\)",
    "optim.label_smoothing=1": r"optim.label_smoothing=1.0 \(allowed: a number with 0 <= value < 1\)",
    "optim.freeze_step=0": r"optim.freeze_step=0 \(allowed: null or an int >= 1\)",
    "optim.var_update_scaler=0": r"optim.var_update_scaler=0 \(allowed: an int >= 1\)",
    "optim.local_step_scaler=0": r"optim.local_step_scaler=0 \(allowed: an int >= 1\)",
    "optim.local_step_clipper=0": r"optim.local_step_clipper=0 \(allowed: an int >= 1\)",
    "output.save_top_k=-2": r"output.save_top_k=-2 \(allowed: an int >= -1\)",
    "seed=-1": r"seed=-1 \(allowed: an int from 0 to 4294967295\)",
    "seed=4294967296": r"seed=4294967296 \(allowed: an int from 0 to 4294967295\)",
    # the strategy's own numbers: ZeroConfig's checks, reached by the same app before any process starts
    "strategy.stage=5": r"Unknown ZeRO stage 5\. Allowed stages: 0, 1, 2, 3",
    "strategy.nvme_buffer_count=1": r"nvme_buffer_count must be an int >= 2 .*; got 1",
    "strategy.bucket_mb=0": r"bucket_mb must be a positive number of MiB .*; got 0.0",
    "strategy.unit_mb=-1": r"unit_mb must be a positive number of MiB .* or None .*; got -1.0",
    "strategy.persist_numel=-1": r"persist_numel must be an int >= 0 .*; got -1",
    "strategy.prefetch=-1": r"prefetch must be True .*, False .* or an int >= 0 .*; got -1",
    "strategy.shard_group_size=0": r"shard_group_size must be an int >= 1 .*; got 0",
    "strategy.tensor_parallel_size=0": r"tensor_parallel_size must be an int >= 1 .*; got 0",
    "strategy.sequence_parallel_size=0": r"sequence_parallel_size must be an int >= 1 .*; got 0",
}
PRETRAIN_BAD = {
    "pretrain.chunk_len=1": r"pretrain.chunk_len=1 \(allowed: an int >= 2\)",
    "pretrain.noise_density=1.0": r"pretrain.noise_density=1.0 \(allowed: a number with 0 < value < 1\)",
    "pretrain.mean_span=0.5": r"pretrain.mean_span=0.5 \(allowed: a number >= 1\)",
    "pretrain.val_every=1": r"pretrain.val_every=1 \(allowed: an int >= 2\)",
    "pretrain.max_val=0": r"pretrain.max_val=0 \(allowed: an int >= 1\)",
}
# the edge of each range passes
GOOD = ["trainer.max_steps=-1", "trainer.max_epochs=-1", "trainer.val_check_interval=1.0",
        "trainer.val_check_interval=1", "trainer.limit_val_batches=0", "trainer.limit_val_batches=1.0",
        "trainer.num_sanity_val_steps=-1", "trainer.gradient_clip_val=0", "trainer.gradient_clip_val=null",
        "trainer.accumulate_grad_batches=1", "trainer.check_val_every_n_epoch=null", "data.max_source_len=2",
        "data.num_workers=0", "data.limit_train=null", "tokenizer.vocab_size=359", "tokenizer=bytes",
        "tokenizer=bytes tokenizer.vocab_size=1", "model.dropout_rate=0", "model.num_gen_batches=0",
        "optim.weight_decay=0", "optim.warmup_steps=0", "optim.label_smoothing=0", "output.save_top_k=-1",
        "seed=0", "seed=4294967295"]


def _run_app(app: str, overrides: list[str], monkeypatch):
    """The app's own job function, as ``python examples/<app>.py OVERRIDES`` runs it, stopped at the first
    thing past its checks (threads, data; reaching it means the config error came too late)."""
    import importlib

    from hydra import compose, initialize_config_dir

    module = importlib.import_module(app)

    def late(*a, **k):
        raise RuntimeError(f"{app} got past its config checks")

    monkeypatch.setattr(module, "set_cpu_threads", late)
    monkeypatch.setattr(module, "build_datamodule", late)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(app, overrides=overrides)
    return getattr(module, {"t5_finetune": "train", "t5_pretrain": "pretrain"}[app])(cfg)


@pytest.mark.parametrize("override,message", sorted(BAD.items()))
def test_out_of_range_override_is_one_config_error_before_any_rank(override, message, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        _run_app("t5_finetune", [override, f"output.dir={tmp_path}"], monkeypatch)
    assert "got past its config checks" not in str(err.value)


@pytest.mark.parametrize("override,message", sorted(PRETRAIN_BAD.items()))
def test_pretrain_out_of_range_override_is_one_config_error(override, message, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        _run_app("t5_pretrain", [override, f"output.dir={tmp_path}"], monkeypatch)


@pytest.mark.parametrize("overrides", GOOD)
def test_value_at_the_edge_of_its_range_passes(overrides):
    validate_schema(compose_recipe(*overrides.split()))


def test_every_numeric_knob_has_a_range_and_a_bad_row():
    """Every int / float field of the schema (the pretraining one holds the fine-tuning one) is in the range
    table, or is the strategy's (ZeroConfig checks those), and each has a bad override above."""
    numeric = set()

    def walk(schema, prefix=""):
        for f in dataclasses.fields(schema):
            factory = f.default_factory
            if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
                walk(factory, f"{prefix}{f.name}.")
            elif any(t in str(f.type) for t in ("int", "float")):
                numeric.add(prefix + f.name)

    walk(T5PretrainConf)
    ranged = {r.path for r in RANGES} | {"tokenizer.vocab_size"}
    assert {"trainer.accumulate_grad_batches", "data.max_source_len", "strategy.bucket_mb"} <= numeric
    assert {n for n in numeric - ranged if not n.startswith("strategy.")} == set(), "numeric knobs without a range"
    bad_rows = {k.split("=")[0] for k in list(BAD) + list(PRETRAIN_BAD)}
    assert (numeric | ranged) - bad_rows == set(), "knobs without a bad row"


@pytest.mark.timeout(120)
def test_cli_names_every_bad_knob_at_once_and_starts_no_rank(tmp_path):
    """The issue's reproduction as a user types it: one error, all three knobs, no rank started."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "t5_finetune.py"), "trainer.gradient_clip_val=-1",
                          "data.max_source_len=-5", "trainer.accumulate_grad_batches=0", f"hydra.run.dir={tmp_path}"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=110)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert ("t5_finetune: config error: Out of range: trainer.gradient_clip_val=-1.0 (allowed: null or a number >= 0); "
            "trainer.accumulate_grad_batches=0 (allowed: an int >= 1); data.max_source_len=-5 (allowed: an int >= 2)."
            ) in text, text[-3000:]
    assert "Traceback" not in text and "GLOBAL_RANK" not in text and "Initializing distributed" not in text
