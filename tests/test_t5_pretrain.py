"""Offline pretraining (examples/t5_pretrain_data.py, examples/t5_pretrain.py): T5 span corruption on the stdlib
source without the fine-tuning val/test modules, and an HF directory that t5_finetune.py starts from."""
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from t5_data import build_stdlib_pairs, split_of  # noqa: E402
from t5_pretrain_data import held_out_summaries, noise_spans, pretrain_files, span_corrupt  # noqa: E402

PKGS = ["json", "textwrap", "email"]


@pytest.mark.parametrize("length", [20, 64, 128, 513])
def test_noise_spans_follow_t5(length):
    rng = random.Random(length)
    spans = noise_spans(length, rng, 0.15, 3.0)
    n_noise = round(length * 0.15)
    assert sum(b - a for a, b in spans) == n_noise
    assert len(spans) == max(1, round(n_noise / 3.0))
    assert spans[0][0] > 0 and spans[-1][1] <= length  # starts with kept tokens
    assert all(b > a for a, b in spans) and all(s[1] < t[0] for s, t in zip(spans, spans[1:]))  # gaps
    assert spans == noise_spans(length, random.Random(length), 0.15, 3.0)  # seeded: deterministic


def test_span_corruption_reconstructs_the_chunk():
    ids = list(range(1000, 1128))
    sentinels = list(range(3, 103))
    inp, tgt = span_corrupt(ids, sentinels, 1, random.Random(0))
    assert inp[-1] == 1 and tgt[-1] == 1
    n_spans = sum(t in sentinels for t in inp)
    assert n_spans == sum(t in sentinels for t in tgt) and inp.count(3) == 1 and tgt[0] == 3
    # put each hidden span back at its sentinel: the original chunk
    spans, cur = {}, None
    for t in tgt[:-1]:
        if t in sentinels:
            cur = t
            spans[cur] = []
        else:
            spans[cur].append(t)
    rebuilt = [x for t in inp[:-1] for x in (spans[t] if t in sentinels else [t])]
    assert rebuilt == ids
    assert len(tgt) - 1 - n_spans == round(128 * 0.15)


def test_pretraining_text_leaves_out_finetuning_val_and_test():
    splits = build_stdlib_pairs(packages=PKGS, max_pairs=None)
    held = held_out_summaries(splits)
    assert held and {p["module"] for p in splits["val"] + splits["test"]}
    files = pretrain_files(packages=PKGS, held_out_targets=held)
    mods = {m for m, _ in files}
    assert mods and all(split_of(m) == "train" for m in mods)
    assert not mods & {p["module"] for p in splits["val"] + splits["test"]}
    text = "\n".join(" ".join(t.split()) for _, t in files)
    assert not [t for t in held if len(t.split()) >= 4 and t in text]
    everything = {m for m, _ in pretrain_files(packages=PKGS)}
    assert mods <= everything and len(everything) >= len(mods)  # the summary filter only ever drops files


def _compose(name, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(name, overrides=list(overrides))


@pytest.mark.timeout(240)
def test_pretrain_writes_hf_dir_that_finetune_starts_from(tmp_path, restore_threads, capsys):
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from t5_finetune import train
    from t5_pretrain import pretrain

    common = ["model=t5_tiny", f"data.stdlib_packages=[{','.join(PKGS)}]", "data.max_pairs=null",
              f"data.cache_dir={tmp_path / 'cache'}", "data.batch_size=4", "trainer.enable_progress_bar=false",
              "output.tensorboard=false", "trainer.log_every_n_steps=1", "optim.warmup_steps=1"]
    s = pretrain(_compose("t5_pretrain", *common, "trainer.max_steps=4", "trainer.val_check_interval=2",
                          "pretrain.max_val=8", "tokenizer.vocab_size=512", f"output.dir={tmp_path / 'pre'}"))
    hf = Path(s["hf_model"])
    assert hf == tmp_path / "pre" / "hf_model" and (hf / "config.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    model = T5ForConditionalGeneration.from_pretrained(str(hf), local_files_only=True)
    assert len(tok) == model.config.vocab_size == 512
    assert len(s["val_history"]) == 2 and s["val_history"][-1]["val_loss"] < s["val_history"][0]["val_loss"]
    assert "fine-tune it:  python examples/t5_finetune.py model.pretrained=" in capsys.readouterr().out

    # fine-tune from it: weights and tokenizer from the directory (tokenizer.vocab_size would say 2048)
    out = tmp_path / "ft"
    f = train(_compose("t5_finetune", *common, f"model.pretrained={hf}", "trainer.max_steps=2",
                       "trainer.val_check_interval=2", "data.limit_val=8", "trainer.validate_before_fit=true",
                       f"output.dir={out}"))
    printed = capsys.readouterr().out
    assert f"model:        pretrained {hf}" in printed and f"vocab 512 (from {hf})" in printed
    assert f["n_params"] == sum(p.numel() for p in model.parameters())
    info = json.loads((out / "run_info.json").read_text())
    assert AutoTokenizer.from_pretrained(info["hf_model"], local_files_only=True).get_vocab() == tok.get_vocab()
