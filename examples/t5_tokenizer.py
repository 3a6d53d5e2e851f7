"""Tokenizers of the T5 recipe, all offline.

Design note
-----------
* ``tokenizer=subword`` (default): a byte-level BPE trained with the ``tokenizers`` library on the
  fine-tuning *training* split (sources + targets) at first use -- a few seconds -- and cached beside the
  data cache, keyed by a digest of the training text and the vocabulary size.  It is saved in HF format
  (``PreTrainedTokenizerFast``), so the run's outputs are an HF model + tokenizer that
  ``AutoTokenizer.from_pretrained(dir)`` loads.  Ids follow T5: pad 0, eos 1, unk 2, and 100 sentinels
  ``<extra_id_N>`` for span corruption (t5_pretrain.py).  Byte-level pre-tokenisation keeps indentation
  and newlines exact and never needs ``<unk>``.
* ``tokenizer=bytes``: transformers' own ``ByT5Tokenizer`` (no vocabulary file, so nothing to download).
* ``model.pretrained=DIR``: the tokenizer saved in DIR, ``local_files_only``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: T5's pad / eos / unk
NUM_SENTINELS = 100
TOKENIZER_KINDS = ("subword", "bytes")
_FORMAT = 1  # bump when the training recipe below changes: old caches are then ignored


def sentinels(n: int = NUM_SENTINELS) -> list[str]:
    return [f"<extra_id_{i}>" for i in range(n)]


def train_subword_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike):
    """Train a byte-level BPE on ``texts`` and save it as an HF ``PreTrainedTokenizerFast`` in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    min_vocab = len(SPECIALS) + NUM_SENTINELS + 256
    if vocab_size < min_vocab:
        raise ValueError(f"tokenizer.vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
                         f"{min_vocab} (3 specials + {NUM_SENTINELS} sentinels + 256 bytes).")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS) + sentinels(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=sentinels(), model_max_length=1 << 20)
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer_dir(path: str | os.PathLike):
    """A tokenizer saved in HF format (a fine-tuned or pretrained run's output directory), local only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def bytes_tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()  # utf-8 byte + 3, pad 0 / eos 1 / unk 2, 125 sentinels: vocab 384


def corpus_digest(texts: Sequence[str], vocab_size: int) -> str:
    h = hashlib.sha1(f"v{_FORMAT}:{vocab_size}:{len(texts)}".encode())
    for t in texts:
        h.update(t.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def cached_subword_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: str | os.PathLike):
    """The BPE for ``texts`` from ``cache_dir``, training and saving it on a miss (atomic: ranks may race)."""
    path = Path(cache_dir) / f"bpe{vocab_size}_{corpus_digest(texts, vocab_size)}"
    if not (path / "tokenizer.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        train_subword_tokenizer(texts, vocab_size, tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    tok = load_tokenizer_dir(path)
    tok.lightning_zero_cache = str(path)  # where it came from, for the run summary (not saved with it)
    return tok


def tokenizer_vocab(tok: Any) -> int:
    """Ids the model's embedding must hold (``len`` counts added tokens; ``vocab_size`` may not)."""
    return len(tok)


def describe(tok: Any) -> str:
    """One line for logs and the run summary: which tokenizer, its vocabulary, where it was loaded from."""
    cached = getattr(tok, "lightning_zero_cache", None)
    if cached:
        return f"subword byte-level BPE, vocab {tokenizer_vocab(tok)} (trained on the training split; {cached})"
    where = getattr(tok, "name_or_path", "") or ""
    return f"{type(tok).__name__}, vocab {tokenizer_vocab(tok)}" + (f" (from {where})" if where else "")


def encode(tok: Any, text: str, max_length: int | None) -> list[int]:
    """Ids of ``text`` ending in eos, at most ``max_length`` long (the eos survives truncation)."""
    if max_length is None:
        return tok(text)["input_ids"]
    return tok(text, truncation=True, max_length=max_length)["input_ids"]


def check_vocab_matches(tok: Any, model_vocab: int, where: str) -> None:
    """Ids the tokenizer emits must index the model's embedding; one clear error otherwise."""
    n = tokenizer_vocab(tok)
    if n > model_vocab:
        raise ValueError(
            f"{where}: the tokenizer has {n} ids but the model's embedding has {model_vocab} rows. Use the "
            "tokenizer the checkpoint was trained with: model.pretrained=DIR loads DIR's own tokenizer, so save "
            "the tokenizer next to the weights (t5_pretrain.py and t5_finetune.py both do).")
