"""Tests for the offline T5 recipe pieces in examples/ (t5_data.py, t5_module.py)."""
import ast
import json
import math
import os
import sys
from pathlib import Path

# examples/ is not a package: put it on sys.path so plain `python -m pytest` works.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from t5_data import (  # noqa: E402
    ByteTokenizer, Seq2SeqDataModule, build_stdlib_pairs, collate_seq2seq, load_pairs_file)
from t5_tokenizer import encode  # noqa: E402

SMALL = dict(packages=("email", "json", "textwrap", "fractions", "argparse"), max_pairs=None)


@pytest.fixture(scope="module")
def full_build():
    return build_stdlib_pairs()


def _all(splits):
    return [p for s in ("train", "val", "test") for p in splits[s]]


def test_deterministic_small():
    a, b = build_stdlib_pairs(**SMALL), build_stdlib_pairs(**SMALL)
    assert a == b
    assert len(_all(a)) > 100
    assert {p["module"].split(".")[0] for p in _all(a)} <= set(SMALL["packages"])
    # The seeded cap is deterministic too, and changes with the seed.
    kw = dict(SMALL, max_pairs=50)
    c1, c2 = build_stdlib_pairs(seed=1, **kw), build_stdlib_pairs(seed=1, **kw)
    assert c1 == c2 and len(_all(c1)) == 50
    assert c1 != build_stdlib_pairs(seed=2, **kw)


def test_cache_roundtrip(tmp_path):
    a = build_stdlib_pairs(cache_dir=str(tmp_path), **SMALL)
    assert len(list(tmp_path.glob("*.jsonl"))) == 1
    assert build_stdlib_pairs(cache_dir=str(tmp_path), **SMALL) == a


def test_full_build_size_and_fields(full_build):
    pairs = _all(full_build)
    assert 4000 <= len(pairs) <= 9000
    assert all(len(full_build[s]) > 0 for s in ("train", "val", "test"))
    for p in pairs:
        assert set(p) == {"source", "target", "module", "name"}
        assert 3 <= len(p["target"].split()) <= 60
        assert "test" not in p["module"].split(".") and not p["module"].startswith("idlelib")


def test_splits_disjoint_by_module(full_build):
    mods = {s: {p["module"] for p in full_build[s]} for s in full_build}
    assert not mods["train"] & mods["val"]
    assert not mods["train"] & mods["test"]
    assert not mods["val"] & mods["test"]


def _norm(text):
    return " ".join(text.split())


def test_no_docstring_leak(full_build):
    for p in _all(full_build):
        tree = ast.parse(p["source"])  # source is valid code on its own
        fn = tree.body[0]
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        # No docstring node left anywhere (incl. nested defs/classes).
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assert ast.get_docstring(n) is None, p["name"]
        # The summary phrase (first 6 words, contiguous) is not present in the code.
        phrase = " ".join(p["target"].split()[:6])
        assert phrase not in _norm(p["source"]), (p["module"], p["name"])


def test_no_docstring_literal_leak_against_original():
    # Re-derive the original docstrings from the stdlib files and check the literal text
    # (first 40 chars of each docstring line) never appears in the emitted source.
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    splits = build_stdlib_pairs(**SMALL)
    by_key = {(p["module"], p["name"]): p["source"] for p in _all(splits)}
    checked = 0
    for mod in {m for m, _ in by_key}:
        rel = Path(*mod.split("."))
        path = root / (str(rel) + ".py")
        if not path.exists():
            path = root / rel / "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def visit(body, prefix):
            nonlocal checked
            for n in body:
                if isinstance(n, ast.ClassDef):
                    visit(n.body, prefix + n.name + ".")
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    src = by_key.get((mod, prefix + n.name))
                    doc = ast.get_docstring(n, clean=False)
                    if src is None or not doc:
                        continue
                    checked += 1
                    for line in doc.splitlines():
                        line = line.strip()
                        if len(line) >= 25:
                            assert line[:40] not in src, (mod, n.name, line)

        visit(tree.body, "")
    assert checked > 100


def test_load_pairs_file(tmp_path):
    rows = [{"code": "def f(): pass", "summary": "does nothing"},
            {"code": "x = 'é'", "summary": "sets x, with a comma"}]
    jl = tmp_path / "p.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    got = load_pairs_file(jl, source_field="code", target_field="summary")
    assert got == [{"source": r["code"], "target": r["summary"]} for r in rows]

    import csv
    cs = tmp_path / "p.csv"
    with open(cs, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["code", "summary"])
        w.writeheader()
        w.writerows(rows)
    assert load_pairs_file(cs, "code", "summary") == got

    with pytest.raises(ValueError, match="'source'"):
        load_pairs_file(jl)  # default field names are missing
    bad = tmp_path / "p.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="extension"):
        load_pairs_file(bad)


def test_byte_tokenizer_is_transformers_byt5():
    from transformers import ByT5Tokenizer

    tok = ByteTokenizer()  # tokenizer=bytes: transformers' own class, constructed without any file
    assert isinstance(tok, ByT5Tokenizer) and len(tok) == 384
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    text = "def f(x): return 'héllo wörld ✓ 日本'"
    ids = encode(tok, text, None)
    assert ids[:-1] == [b + 3 for b in text.encode("utf-8")] and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    short = encode(tok, text, 10)
    assert len(short) == 10 and short[-1] == tok.eos_token_id  # eos survives truncation


def test_collate_pads_labels_with_ignore_index():
    tok = ByteTokenizer()
    batch = [{"input_ids": encode(tok, "abc", None), "labels": encode(tok, "x", None)},
             {"input_ids": encode(tok, "a", None), "labels": encode(tok, "xyz", None)}]
    out = collate_seq2seq(batch, tok.pad_token_id)
    assert out["input_ids"].shape == (2, 4) and out["labels"].shape == (2, 4)
    assert out["input_ids"][1].tolist() == [100, 1, 0, 0]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert out["labels"][0].tolist() == [123, 1, -100, -100]


def test_datamodule_file_and_limits(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text("\n".join(json.dumps({"source": f"def f{i}(): return {i}", "target": f"ret {i}"})
                            for i in range(200)), encoding="utf-8")
    dm = Seq2SeqDataModule(str(jl), batch_size=4, limit_train=10, max_source_len=8)
    dm.setup("fit")
    assert len(dm.splits["train"]) == 10 and sum(map(len, dm.splits.values())) > 10
    b = next(iter(dm.train_dataloader()))
    assert b["input_ids"].shape == (4, 8) and (b["input_ids"][:, -1] == 1).all()


def test_tiny_t5_fit_cpu():
    import lightning as L
    from t5_module import T5FineTuner

    torch.manual_seed(0)
    splits = build_stdlib_pairs(packages=("json", "textwrap"), max_pairs=None)
    pairs = {"train": splits["train"][:8], "val": splits["train"][8:12]}
    dm = Seq2SeqDataModule(pairs, batch_size=4, max_source_len=64, max_target_len=16)
    model = T5FineTuner("t5_tiny", warmup_steps=1, num_gen_batches=1, max_new_tokens=8)
    assert model.model.config.vocab_size == 384 and model.model.config.decoder_start_token_id == 0
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    groups = trainer.optimizers[0].param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and len(groups[1]["params"]) > 0
    m = trainer.callback_metrics
    assert math.isfinite(float(m["val_loss"]))
    for k in ("train_loss", "val_token_acc", "val_chrf", "val_sacrebleu", "val_rougeL"):
        assert k in m and math.isfinite(float(m[k])), k


@pytest.mark.parametrize("num_gen_batches,calls", [(None, 3), (1, 1)])
def test_text_metrics_score_every_validation_batch_by_default(num_gen_batches, calls):
    """num_gen_batches=None (the presets' default): every validation batch generates, so a smaller
    data.batch_size still scores the whole (limit_val-capped) set; a number limits it."""
    import lightning as L
    from t5_module import T5FineTuner

    torch.manual_seed(0)
    splits = build_stdlib_pairs(packages=("json", "textwrap"), max_pairs=None)
    pairs = {"train": splits["train"][:4], "val": splits["train"][4:10]}
    dm = Seq2SeqDataModule(pairs, batch_size=2, max_source_len=32, max_target_len=8)
    model = T5FineTuner("t5_tiny", warmup_steps=1, num_gen_batches=num_gen_batches, max_new_tokens=4)
    seen = []
    generate = model._generate
    model._generate = lambda batch: seen.append(len(batch["input_ids"])) or generate(batch)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(model, datamodule=dm, verbose=False)
    assert len(seen) == calls and sum(seen) == 2 * calls


def test_presets_and_pretrained_error(tmp_path):
    from t5_module import T5_PRESETS, T5FineTuner, make_t5_config

    assert T5_PRESETS["t5_base"]["d_model"] == 768 and T5_PRESETS["t5_3b"]["d_ff"] == 16384
    cfg = make_t5_config("t5_small", ByteTokenizer())
    assert cfg.vocab_size == 384 and cfg.d_model == 512 and cfg.decoder_start_token_id == 0
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        T5FineTuner(pretrained=str(tmp_path / "missing"))


def test_summary_is_the_first_sentence_or_paragraph():
    from t5_data import _summary

    doc = """Return the value of x.y, e.g. 1.5 or 2.

    Raises ValueError when empty. More text.
    """
    assert _summary("Check the thread. Then return it.\n\nDetails.") == "Check the thread."
    assert _summary(doc) == "Return the value of x.y, e.g. 1.5 or 2."  # "x.y", "e.g." and "1.5" stay inside
    assert _summary("Check the thread. Then return it.\n\nDetails.", "paragraph") == "Check the thread. Then return it."
    with pytest.raises(ValueError, match="allowed sentence, paragraph"):
        _summary(doc, "line")
    sent, para = build_stdlib_pairs(packages=("json",), max_pairs=None), \
        build_stdlib_pairs(packages=("json",), max_pairs=None, summary="paragraph")
    by_name = {p["name"]: p["target"] for p in _all(para)}
    assert all(by_name[p["name"]].startswith(p["target"]) for p in _all(sent) if p["name"] in by_name)
    assert any(len(by_name[p["name"]]) > len(p["target"]) for p in _all(sent) if p["name"] in by_name)


def test_name_words_prefix_the_source():
    from t5_data import Seq2SeqDataset, name_words, with_name_words

    src = "@cached\nasync def _checkThread_state(self):\n    def inner(): pass\n    return 1"
    assert name_words(src) == "check thread state"
    assert with_name_words(src) == "check thread state\n" + src
    assert with_name_words("x = 1") == "x = 1"  # no function: the source as it is
    tok = ByteTokenizer()
    pairs = [{"source": src, "target": "Check it."}]
    hinted, plain = Seq2SeqDataset(pairs, tok, 256, 16, name_hint=True)[0], Seq2SeqDataset(pairs, tok, 256, 16)[0]
    assert tok.decode(hinted["input_ids"], skip_special_tokens=True) == "check thread state\n" + src
    assert tok.decode(plain["input_ids"], skip_special_tokens=True) == src and hinted["labels"] == plain["labels"]
