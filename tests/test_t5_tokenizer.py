"""The recipe's tokenizers (examples/t5_tokenizer.py): a BPE trained offline on the training split, cached
and saved in HF format; the checkpoint's own tokenizer with model.pretrained; one error on a vocab mismatch."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

import t5_tokenizer  # noqa: E402
from t5_data import build_stdlib_pairs  # noqa: E402
from t5_tokenizer import cached_subword_tokenizer, encode, load_tokenizer_dir  # noqa: E402

def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("t5_finetune", overrides=list(overrides))


CODE = "def f(x, *, y=None):\n    if y is None:\n\t\treturn x  # tab ✓\n    return x + y\n"


@pytest.fixture(scope="module")
def texts():
    s = build_stdlib_pairs(packages=("json", "textwrap"), max_pairs=None)
    return [p["source"] for p in s["train"]] + [p["target"] for p in s["train"]]


def test_subword_trains_caches_and_round_trips(tmp_path, texts, monkeypatch):
    from transformers import AutoTokenizer

    tok = cached_subword_tokenizer(texts, 512, tmp_path)
    dirs = [p for p in tmp_path.iterdir()]
    assert len(dirs) == 1 and (dirs[0] / "tokenizer.json").is_file()
    assert len(tok) == 512
    assert [tok.convert_ids_to_tokens(i) for i in (0, 1, 2)] == ["<pad>", "</s>", "<unk>"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids("<extra_id_0>") == 3 and tok.convert_tokens_to_ids("<extra_id_99>") == 102

    ids = encode(tok, CODE, None)
    assert ids[-1] == 1 and 1 not in ids[:-1]
    assert tok.decode(ids, skip_special_tokens=True) == CODE  # byte-level: whitespace and unicode exact
    assert len(ids) < 0.7 * len(CODE.encode())  # subwords, not bytes (even with only 153 merges)
    short = encode(tok, CODE, 5)
    assert len(short) == 5 and short[-1] == 1

    # HF format: AutoTokenizer loads the cached directory as it is
    again = AutoTokenizer.from_pretrained(str(dirs[0]), local_files_only=True)
    assert encode(again, CODE, None) == ids

    # cached: a second call does not train; other vocab sizes or other text get their own entry
    def no_training(*a, **k):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(t5_tokenizer, "train_subword_tokenizer", no_training)
    assert encode(cached_subword_tokenizer(texts, 512, tmp_path), CODE, None) == ids
    monkeypatch.undo()
    cached_subword_tokenizer(texts, 600, tmp_path)
    cached_subword_tokenizer(texts[:-1], 512, tmp_path)
    assert len([p for p in tmp_path.iterdir()]) == 3

    with pytest.raises(ValueError, match="at least 359"):
        cached_subword_tokenizer(texts, 300, tmp_path / "small")


def test_vocab_mismatch_is_one_clear_error(tmp_path, texts):
    from t5_config import ConfigError
    from t5_module import T5FineTuner, make_t5_config
    from transformers import T5ForConditionalGeneration

    tok = cached_subword_tokenizer(texts, 512, tmp_path / "cache")
    d = tmp_path / "ckpt"
    # weights sized for ByT5 bytes (384 rows), saved with a 512-id BPE beside them
    T5ForConditionalGeneration(make_t5_config("t5_tiny", vocab_size=384)).save_pretrained(d)
    tok.save_pretrained(d)
    with pytest.raises(ValueError, match=r"tokenizer has 512 ids but the model's embedding has 384 rows"):
        T5FineTuner(pretrained=str(d), tokenizer=load_tokenizer_dir(d))

    # through the app: the tokenizer comes from DIR, and the mismatch is the one config error
    from t5_finetune import train

    cfg = _compose("model=t5_tiny", f"model.pretrained={d}", "data.stdlib_packages=[json,textwrap,email]",
                   "data.max_pairs=null", f"data.cache_dir={tmp_path / 'data'}", f"output.dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError, match="tokenizer has 512 ids"):
        train(cfg)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        train(cfg)
