"""The Hydra T5 recipe (conf/, examples/t5_config.py, examples/t5_finetune.py): every config composes and builds,
overrides are validated with clear messages, and a short 2-rank ZeRO-2 fit writes checkpoints + metrics."""
import csv
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.helpers.hydra_recipe import CONF, ROOT, compose_recipe, pairs_file  # noqa: F401  (examples/ on sys.path)
from t5_config import (  # noqa: E402,I001
    ConfigError, T5FinetuneConf, build_datamodule, build_strategy, build_t5_config, validate_schema)

STRATEGIES = {"zero0": (0, False), "zero1": (1, False), "zero1_offload": (1, True),
              "zero2": (2, False), "zero2_offload": (2, True), "zero3": (3, False), "zero3_offload": (3, True),
              "zero2_offload_nvme": (2, "nvme"), "zero3_offload_nvme": (3, "nvme")}
MODELS = ["t5_tiny", "t5_mini", "t5_small", "t5_base", "t5_large", "t5_3b"]
DATA = ["stdlib", "stdlib_long", "jsonl"]
TRAINERS = {"cpu": "fork", "gpu": "popen"}


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_config_groups_and_defaults():
    assert _options("strategy") == sorted(STRATEGIES)
    assert _options("model") == sorted(MODELS)
    assert _options("data") == sorted(DATA) and _options("trainer") == sorted(TRAINERS)
    cfg = compose_recipe()
    assert (cfg.strategy.name, cfg.model.preset, cfg.data.kind, cfg.trainer.accelerator) == \
        ("zero2", "t5_mini", "stdlib", "cpu")
    assert cfg.trainer.devices == 2 and cfg.strategy.start_method == "fork"
    assert OmegaConf.get_type(cfg) is T5FinetuneConf  # the structured schema is in force


def _pairwise(*groups):
    """Combinations that hold every pair of options of any two groups at least once (greedy, deterministic):
    the configs interpolate across at most two groups (strategy with trainer, model with data), so a pair
    that composes wrong shows here, in 54 compositions instead of the product's 324 (~0.25 s each)."""
    def pairs(combo):
        return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(combo), 2)}

    todo = set().union(*(pairs(c) for c in itertools.product(*groups)))
    chosen = []
    while todo:
        best = max(itertools.product(*groups), key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


def test_every_pair_of_options_composes_and_validates():
    import re

    for group in ("strategy", "model", "data", "trainer"):  # what makes pairs enough: no option reads two groups
        for f in (CONF / group).glob("*.yaml"):
            read = set(re.findall(r"\$\{(\w+)\.", f.read_text())) - {group}
            assert len(read) <= 1, f"{f.name} interpolates {read}: test the triples too"
    combos = _pairwise(list(STRATEGIES), MODELS, DATA, list(TRAINERS))
    assert len(combos) < 60
    for s, m, d, t in combos:
        cfg = compose_recipe(f"strategy={s}", f"model={m}", f"data={d}", f"trainer={t}")
        validate_schema(cfg)
        obj = OmegaConf.to_object(cfg)  # resolves interpolations, type-checks every field
        assert isinstance(obj, T5FinetuneConf)
        assert (obj.strategy.name, obj.model.preset, obj.trainer.accelerator) == (s, m, t)
        assert obj.strategy.start_method == TRAINERS[t]
        assert obj.model.max_new_tokens == obj.data.max_target_len


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
@pytest.mark.parametrize("preset", sorted(STRATEGIES))
def test_strategy_presets_build(preset, trainer, tmp_path, monkeypatch):
    from lightning_zero import ZeroStrategy

    monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", str(tmp_path))  # the *_offload_nvme presets' nvme_path: null
    strategy = build_strategy(compose_recipe(f"strategy={preset}", f"trainer={trainer}"))
    stage, offload = STRATEGIES[preset]
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.stage == stage and strategy.zero_config.offload_optimizer == offload
    assert strategy.zero_config.nvme_path == (str(tmp_path) if offload == "nvme" else None)
    params = (offload if offload == "nvme" else offload is True) if stage == 3 else False  # zero3_offload_nvme: "nvme"
    assert strategy.zero_config.offload_params == params and strategy.zero_config.bucket_mb == 25.0
    if stage == 3:  # units from the model's declaration (T5Block), as for `strategy.stage=3`
        assert strategy.zero_config.unit_classes is None and strategy.zero_config.persist_numel is None
    assert strategy._start_method == TRAINERS[trainer]


def test_hydra_strategy_presets_agree_with_the_preset_table():
    from pathlib import Path

    import yaml

    from lightning_zero.engine.config import PRESETS
    from lightning_zero.tools.estimate import SETTINGS

    conf = Path(__file__).resolve().parents[1] / "conf" / "strategy"
    yamls = {f.stem: yaml.safe_load(f.read_text()) for f in conf.glob("*.yaml")}
    assert sorted(yamls) == sorted(PRESETS) == sorted(SETTINGS.values())
    for name, kw in PRESETS.items():
        y = yamls[name]
        assert y["name"] == name
        for key in ("stage", "offload_optimizer", "offload_params"):
            assert y[key] == kw.get(key, False), (name, key)
        for key in ("optimizer_state_dtype", "master_dtype"):  # every preset spells ZeroConfig's default out
            assert y[key] == kw.get(key, "fp32"), (name, key)


def test_strategy_field_overrides_need_no_code_change():
    s = build_strategy(compose_recipe("strategy.stage=1"))
    assert s.stage == 1 and not s.zero_config.offload_optimizer
    s = build_strategy(compose_recipe("strategy=zero2_offload", "strategy.stage=1", "strategy.bucket_mb=2",
                                "strategy.reduce_dtype=fp32", "strategy.start_method=spawn"))
    assert (s.stage, s.zero_config.offload_optimizer, s.zero_config.bucket_mb) == (1, True, 2.0)
    assert s.zero_config.reduce_dtype == torch.float32 and s._start_method == "spawn"


@pytest.mark.parametrize("stage", [5, -1])
def test_out_of_range_stage_is_refused_naming_allowed_stages(stage):
    cfg = compose_recipe(f"strategy.stage={stage}")  # an int: the schema accepts it, ZeroConfig refuses it
    with pytest.raises(ConfigError, match=r"Allowed stages: 0, 1, 2") as e:
        build_strategy(cfg)
    assert f"stage={stage}" in str(e.value) and "strategy=zero2" in str(e.value)


def test_stage_override_reaches_stage3():
    s = build_strategy(compose_recipe("strategy.stage=3"))  # from the zero2 preset: no code change
    assert s.stage == 3 and s.zero_config.unit_classes is None  # the default policy, as under strategy=zero3
    s = build_strategy(compose_recipe("strategy=zero3", "strategy.unit_classes=[T5Block,T5LayerNorm]"))
    assert s.zero_config.unit_classes == ["T5Block", "T5LayerNorm"]


def test_stage_override_and_zero3_preset_give_the_same_units():
    """`strategy.stage=3` from the zero2 preset and `strategy=zero3` partition the recipe's T5 alike: one unit per
    T5Block (its _no_split_modules), none persistent -- not one persistent root unit."""
    from t5_module import make_t5_config
    from transformers import T5ForConditionalGeneration

    from lightning_zero.engine.stage3.units import build_units

    with torch.device("meta"):
        model = T5ForConditionalGeneration(make_t5_config("t5_mini"))
    got = []
    for overrides in (["strategy.stage=3"], ["strategy=zero3"], ["strategy=zero3_offload"]):
        z = build_strategy(compose_recipe(*overrides)).zero_config
        units = build_units(model, 2, 0, z.unit_classes, z.unit_bytes, z.persist_numel)
        got.append([(u.name, len(u.params), u.persistent) for u in units])
    assert got[0] == got[1] == got[2]
    blocks = [b for b in got[0] if b[0] != "<root>"]
    n_blocks = len(model.encoder.block) + len(model.decoder.block)
    assert len(blocks) == n_blocks and all(".block." in n and not pers for n, _, pers in blocks)


def test_invalid_combinations_are_refused():
    with pytest.raises(ConfigError, match="offload_optimizer=True needs a sharded optimizer"):
        build_strategy(compose_recipe("strategy=zero0", "strategy.offload_optimizer=true"))
    with pytest.raises(ConfigError, match="offload_params"):
        build_strategy(compose_recipe("strategy.offload_params=true"))
    with pytest.raises(ConfigError, match="Unknown start_method"):
        build_strategy(compose_recipe("strategy.start_method=thread"))
    with pytest.raises(ConfigError, match="Unknown dtype"):
        build_strategy(compose_recipe("strategy.reduce_dtype=fp8"))


def test_misspelt_keys_and_bad_types_are_refused():
    def refused(override):  # Hydra prints the message and its cause
        with pytest.raises(ConfigCompositionException) as e:
            compose_recipe(override)
        return f"{e.value}\n{e.value.__cause__}"

    msg = refused("strategy.stag=1")
    assert "Could not override 'strategy.stag'" in msg and "Key 'stag' not in 'StrategyConf'" in msg
    assert "Key 'max_step' not in 'TrainerConf'" in refused("trainer.max_step=3")
    assert "'two' of type 'str' could not be converted to Integer" in refused("strategy.stage=two")
    with pytest.raises(ConfigCompositionException, match="zero4"):
        compose_recipe("strategy=zero4")
    # `+key=value` bypasses the struct flag while composing; the app's schema check still refuses it.
    cfg = compose_recipe("+strategy.stag=1")
    with pytest.raises(ConfigError, match=r"strategy\.stag .*Allowed: name, stage"):
        validate_schema(cfg)
    with pytest.raises(ConfigError, match="strategy.stag"):
        build_strategy(cfg)


@pytest.mark.parametrize("model", MODELS)
def test_model_presets_build_t5_config(model):
    from t5_data import ByteTokenizer
    from t5_module import T5_PRESETS

    cfg = compose_recipe(f"model={model}")
    assert cfg.model.pretrained is None  # random init by default
    t5 = build_t5_config(cfg, ByteTokenizer())
    assert type(t5).__name__ == "T5Config"
    for k in ("d_model", "d_ff", "num_layers", "num_heads", "d_kv"):
        assert getattr(t5, k) == T5_PRESETS[model][k], k
    assert t5.vocab_size == 384 and t5.decoder_start_token_id == 0  # ByT5Tokenizer's ids
    t5 = build_t5_config(compose_recipe(f"model={model}", "+model.config_overrides.num_layers=1"))
    assert t5.num_layers == 1
    with pytest.raises(ConfigError, match="unknown preset"):
        build_t5_config(compose_recipe("model.preset=t5_huge"))


def test_data_presets_load(tmp_path, pairs_file):
    dm = build_datamodule(compose_recipe("data.stdlib_packages=[json,textwrap]", "data.max_pairs=null",
                                   f"data.cache_dir={tmp_path / 'cache'}", "data.limit_train=20"))
    dm.setup("fit")
    assert len(dm.splits["train"]) == 20 and dm.max_source_len == 64
    assert {p["module"].split(".")[0] for p in dm.splits["train"]} <= {"json", "textwrap"}
    assert list((tmp_path / "cache").glob("*.jsonl"))  # built once, cached

    cfg = compose_recipe("data=jsonl", f"data.path={pairs_file}", "data.source_field=code",
                   "data.target_field=doc", "data.batch_size=4")
    dm = build_datamodule(cfg)
    dm.setup("fit")
    assert sum(map(len, dm.splits.values())) == 300 and dm.splits["val"]
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4
    with pytest.raises(ConfigError, match="data.path"):
        build_datamodule(compose_recipe("data=jsonl"))
    with pytest.raises(ConfigError, match="no such file"):
        build_datamodule(compose_recipe("data=jsonl", f"data.path={tmp_path / 'missing.jsonl'}"))


def test_popen_is_replaced_under_multirun():
    from hydra.core.hydra_config import HydraConfig
    from t5_finetune import resolve_start_method

    cfg = compose_recipe("trainer=gpu", "hydra.mode=MULTIRUN", hydra_cfg=True)
    HydraConfig.instance().set_config(cfg)
    try:
        job = compose_recipe("trainer=gpu")
        assert job.strategy.start_method == "popen"
        resolve_start_method(job)
        assert job.strategy.start_method == "spawn"
    finally:
        HydraConfig.instance().cfg = None


def test_pretrained_must_be_a_local_dir(tmp_path, pairs_file):
    from t5_finetune import train

    cfg = compose_recipe("model=t5_tiny", f"model.pretrained={tmp_path / 'nope'}", "data=jsonl",
                   f"data.path={pairs_file}", "data.source_field=code", "data.target_field=doc",
                   f"output.dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError, match="never downloaded"):
        train(cfg)


# "zero2+stage3": the headline override (strategy.stage=3 on the zero2 preset) must be reported as stage 3
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero2", "zero2+stage3"])
def test_recipe_fit_two_cpu_ranks(tmp_path, pairs_file, restore_threads, strategy, capsys):
    from t5_finetune import train

    out = tmp_path / "out"
    preset, *extra = strategy.split("+")
    extra = ["strategy.stage=3"] if extra else []
    cfg = compose_recipe(f"strategy={preset}", *extra, "model=t5_tiny", "trainer=cpu", "trainer.devices=2",
                   "data=jsonl", f"data.path={pairs_file}", "data.source_field=code", "data.target_field=doc",
                   "data.batch_size=4", "data.limit_train=32", "data.limit_val=8", "data.max_source_len=48",
                   "data.max_target_len=16", "trainer.max_steps=4", "trainer.val_check_interval=2",
                   "trainer.log_every_n_steps=1", "tokenizer.vocab_size=400",
                   "trainer.enable_progress_bar=false", "trainer.validate_before_fit=true",
                   "optim.warmup_steps=1", f"output.dir={out}", f"output.tensorboard={not extra}")
    assert cfg.strategy.start_method == "fork"
    summary = train(cfg)
    printed = capsys.readouterr().out

    assert summary["output_dir"] == str(out)
    # a file, or a directory (sharded checkpoint formats): either way one best (val_loss) + last
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in ckpts and len(ckpts) == 2, ckpts
    assert Path(summary["best_checkpoint"]).name in ckpts
    with open(out / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("train_loss") for r in rows)
    val = [r for r in rows if r.get("val_loss")]
    assert len(val) == 2 and all(math.isfinite(float(r["val_loss"])) for r in val)  # after steps 2 and 4
    assert "val_chrf" in rows[0]
    assert summary["baseline_val"]["val_loss"] > summary["last_val"]["val_loss"]

    # the summary names what was composed, read from the strategy object, and what ran
    head = printed[printed.index("== t5_finetune done"):]
    stage = 3 if extra else 2
    assert f"strategy:     ZeRO stage {stage}, offload none" in head and "(preset name: zero2)" in head
    if extra:
        assert "units automatic" in head and "stage-3 units built: " in head
        built = int(head[head.index("stage-3 units built: ") + len("stage-3 units built: "):].split()[0])
        assert built >= 2  # the T5 blocks, as under the zero3 preset (not one persistent root unit)
    assert "model:        t5_tiny (random init)" in head and "tokenizer:    subword byte-level BPE, vocab 400" in head
    assert ": 4 steps (" in head and summary["run_info"]["global_step"] == 4
    mem = summary["run_info"]["ranks"]
    assert len(mem) == 2 and all(r["model_states"] > 0 for r in mem) and "model states: rank 0 " in head
    # the samples table under the metrics: 4 fixed validation pairs, function head / reference / generated
    table = head[head.index("samples (validation after step 4"):]
    assert table.count("    reference: ") == 4 and table.count("    generated: ") == 4
    val_pairs = summary["samples"]["rows"]
    assert [r["index"] for r in val_pairs] == [0, 1, 2, 3]
    assert all(f"    reference: {r['reference']}" in table for r in val_pairs)
    # the HF export loads with the stock classes
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    hf = summary["run_info"]["hf_model"]
    assert len(AutoTokenizer.from_pretrained(hf)) == T5ForConditionalGeneration.from_pretrained(hf).config.vocab_size
    if extra:
        return

    # TensorBoard holds the same table as text, one event per validation (steps 2 and 4)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(next((out / "tb").glob("events.*"))), size_guidance={"tensors": 0})
    ea.Reload()
    events = ea.Tensors("val_samples/text_summary")
    assert [e.step for e in events] == [2, 4]
    md = events[-1].tensor_proto.string_val[0].decode()
    assert md.startswith("| # | function head | reference | generated |") and md.count("\n") == 5

    # mode=test on the last checkpoint: test metrics + one prediction per test pair, in order
    pred = tmp_path / "pred.jsonl"
    res = train(compose_recipe("model=t5_tiny", "data=jsonl", f"data.path={pairs_file}", "data.source_field=code",
                         "data.target_field=doc", "data.batch_size=4", "data.limit_train=32", "data.limit_val=8",
                         "data.max_source_len=48", "data.max_target_len=16", "tokenizer.vocab_size=400",
                         "mode=test", f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}", f"output.predictions={pred}",
                         f"output.dir={tmp_path / 'test'}", "trainer.enable_progress_bar=false"))
    lines = [json.loads(x) for x in pred.read_text().splitlines()]
    n_test = 8  # data.limit_val caps val and test
    assert [r["index"] for r in lines] == list(range(n_test))
    assert set(lines[0]) == {"index", "source", "reference", "prediction"}
    # the source the model read: its name words (data.name_hint), then the function
    assert all(r["reference"] and r["source"].startswith("add ") and "\ndef add_" in r["source"] for r in lines)
    for k in ("test_loss", "test_chrf", "test_sacrebleu", "test_rougeL"):
        assert math.isfinite(res["test_metrics"][k]), k
    assert f"predictions:  {pred}" in capsys.readouterr().out

    # `export --hf` finds the architecture among the checkpoint's hyper-parameters: no --config needed
    from lightning_zero.tools.cli import main as cli_main

    exported = tmp_path / "exported"
    assert cli_main(["export", str(out / "checkpoints" / "last.ckpt"), str(exported), "--hf"]) == 0
    assert T5ForConditionalGeneration.from_pretrained(exported).config.vocab_size == 400


def test_help_lists_the_choice_groups_not_the_schema():
    import subprocess

    for app in ("t5_finetune", "t5_pretrain"):
        r = subprocess.run([sys.executable, str(ROOT / "examples" / f"{app}.py"), "--help"], capture_output=True,
                           text=True, timeout=120, cwd=str(ROOT))
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"{app}: ") and "schema" not in r.stdout.replace("schema: examples", "")
        for group in ("strategy", "model", "tokenizer", "data", "trainer"):
            line = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"{group}:"))
            assert sorted(o.strip() for o in line.split(":", 1)[1].split(",")) == _options(group), line


def test_lightning_messages_print_once(capsys):
    import io
    import logging

    import lightning  # noqa: F401  (installs its own console handlers)
    from t5_run import one_line_per_message

    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)  # what Hydra installs on the root logger
    root.addHandler(handler)
    try:
        one_line_per_message()
        for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.distributed"):
            logging.getLogger(name).warning("hello from %s", name)
            assert stream.getvalue().count(f"hello from {name}") == 1
        assert "hello from" not in capsys.readouterr().err  # no second copy through Lightning's own handler
    finally:
        root.removeHandler(handler)


def test_tuner_sizes_the_model_with_the_runs_vocabulary(tmp_path):
    # The tuner measures what the run trains: the subword BPE's vocabulary by default, ByT5's 384 ids for
    # tokenizer=bytes, the checkpoint's own with model.pretrained.
    import yaml
    from t5_config import tune_model_config
    from t5_data import ByteTokenizer
    from transformers import T5Config

    from lightning_zero.tools.t5_dims import RECIPE_VOCAB

    default = yaml.safe_load((ROOT / "conf" / "tokenizer" / "subword.yaml").read_text())["vocab_size"]
    assert tune_model_config(compose_recipe()).vocab_size == default == RECIPE_VOCAB
    assert tune_model_config(compose_recipe("tokenizer=bytes")).vocab_size == len(ByteTokenizer()) == 384
    assert tune_model_config(compose_recipe("tokenizer.vocab_size=512")).vocab_size == 512
    T5Config(vocab_size=777, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16).save_pretrained(tmp_path)
    assert tune_model_config(compose_recipe(f"model.pretrained={tmp_path}")).vocab_size == 777


def test_long_input_preset_keeps_whole_long_functions_and_bad_lengths_are_refused():
    """data=stdlib_long: the set keeps functions up to 8000 characters (data=stdlib: 2000) and reads 2048 tokens;
    data.max_source_chars reaches the set builder; a length below 1 is one clear error."""
    from t5_config import ConfigError, build_datamodule

    dm = build_datamodule(compose_recipe("data=stdlib_long"))
    assert dm.stdlib_kwargs["max_source_chars"] == 8000 and dm.max_source_len == 2048
    assert build_datamodule(compose_recipe()).stdlib_kwargs["max_source_chars"] == 2000
    with pytest.raises(ConfigError, match=r"data.max_source_chars must be an int >= 1"):
        build_datamodule(compose_recipe("data.max_source_chars=0"))
