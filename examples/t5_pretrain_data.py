"""Offline pretraining data: T5 span corruption on the Python stdlib *source* of the running interpreter.

Design note
-----------
* Text: every ``.py`` file of ``sysconfig.get_paths()["stdlib"]`` that t5_data walks (tests, idlelib,
  lib2to3 and site-packages pruned), whole -- code, comments and docstrings.
* No leak into fine-tuning: t5_data splits the code-summarisation pairs by *module* (crc32 of the module
  name), so only modules of the fine-tuning *train* split are pretrained on; a val/test module's code and
  docstrings are never seen.  A train-split file is dropped too if it contains a val/test summary verbatim
  (whitespace-normalised): stdlib copies some docstrings across modules (``_pydecimal``/``decimal``,
  ``_pyio``/``io``), and pretraining must not teach the answer of a held-out pair.
* Objective (Raffel et al. 2020, ``random_spans_noise_mask``): the token stream (files joined by eos) is
  cut into chunks of ``chunk_len`` tokens; in each chunk 15% of the tokens, in spans of mean length 3, are
  replaced by one sentinel per span in the input, and the target lists each sentinel followed by the tokens
  it hides, then eos.  Masks come from a RNG seeded with (seed, chunk index): every rank and rerun agrees.
* A deterministic 1-in-``val_every`` slice of chunks is held out for the pretraining val_loss.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import sysconfig
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from t5_data import _iter_stdlib_files, _module_name, collate_seq2seq, split_of
from t5_resume import ResumableDataLoader


def _ws(text: str) -> str:
    return " ".join(text.split())


def pretrain_files(root: str | None = None, packages: Sequence[str] | None = None, val_pct: int = 5,
                   test_pct: int = 5, held_out_targets: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(module, text) of the stdlib files pretraining may see: fine-tuning train-split modules only, minus
    files holding a held-out (val/test) summary verbatim."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    held = [_ws(t) for t in held_out_targets if len(t.split()) >= 4]
    out = []
    for rel in _iter_stdlib_files(base, packages):
        module = _module_name(rel)
        if split_of(module, val_pct, test_pct) != "train":
            continue
        try:
            text = (base / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        flat = _ws(text)
        if any(t in flat for t in held):
            continue
        out.append((module, text))
    return out


def _segments(rng: random.Random, num_items: int, num_segments: int) -> list[int]:
    """A random partition of ``num_items`` into ``num_segments`` non-empty parts."""
    cuts = sorted(rng.sample(range(1, num_items), num_segments - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [num_items])]


def noise_spans(length: int, rng: random.Random, noise_density: float = 0.15,
                mean_span: float = 3.0) -> list[tuple[int, int]]:
    """T5's random_spans_noise_mask as (start, end) spans; the chunk starts with a non-noise span."""
    n_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    n_spans = max(1, min(int(round(n_noise / mean_span)), n_noise, length - n_noise))
    noise = _segments(rng, n_noise, n_spans)
    keep = _segments(rng, length - n_noise, n_spans)
    spans, pos = [], 0
    for k, n in zip(keep, noise):
        pos += k
        spans.append((pos, pos + n))
        pos += n
    return spans


def span_corrupt(ids: Sequence[int], sentinel_ids: Sequence[int], eos_id: int, rng: random.Random,
                 noise_density: float = 0.15, mean_span: float = 3.0) -> tuple[list[int], list[int]]:
    """(input ids, target ids) of one chunk, both ending in eos."""
    spans = noise_spans(len(ids), rng, noise_density, mean_span)
    if len(spans) > len(sentinel_ids):
        raise ValueError(f"{len(spans)} noise spans but only {len(sentinel_ids)} sentinel tokens; "
                         "shorten the chunks (pretrain.chunk_len).")
    inp, tgt, prev = [], [], 0
    for sid, (a, b) in zip(sentinel_ids, spans):
        inp += list(ids[prev:a]) + [sid]
        tgt += [sid] + list(ids[a:b])
        prev = b
    inp += list(ids[prev:])
    return inp + [eos_id], tgt + [eos_id]


def sentinel_ids(tok: Any) -> list[int]:
    """``<extra_id_0>``, ``<extra_id_1>``, ... as ids (both the recipe's BPE and ByT5Tokenizer have them)."""
    ids = []
    for i in range(1000):
        t = f"<extra_id_{i}>"
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or tid == tok.unk_token_id or tok.convert_ids_to_tokens(tid) != t:
            break
        ids.append(tid)
    if not ids:
        raise ValueError(f"{type(tok).__name__} has no <extra_id_N> sentinel tokens: span corruption needs "
                         "them (tokenizer=subword and tokenizer=bytes both have them).")
    return ids


def token_chunks(texts: Sequence[str], tok: Any, chunk_len: int, cache_dir: str | None = None) -> list[list[int]]:
    """The files' tokens joined by eos, cut into ``chunk_len`` pieces (a short tail is dropped).

    Tokenising all of the stdlib takes ~10-30 s on a small CPU, so the stream is cached in ``cache_dir``,
    keyed by the text, the tokenizer's vocabulary and the chunk length."""
    path = None
    if cache_dir:
        h = hashlib.sha1(f"{chunk_len}:{len(tok)}:{type(tok).__name__}".encode())
        h.update(json.dumps(tok.get_vocab(), sort_keys=True).encode())
        for t in texts:
            h.update(t.encode("utf-8", errors="replace") + b"\0")
        path = Path(cache_dir) / f"span_chunks_{h.hexdigest()[:16]}.pt"
        if path.is_file():
            return torch.load(path).tolist()
    stream: list[int] = []
    for ids in tok(list(texts), add_special_tokens=False)["input_ids"]:
        stream += ids + [tok.eos_token_id]
    n = (len(stream) // chunk_len) * chunk_len
    chunks = torch.tensor(stream[:n], dtype=torch.int32).view(-1, chunk_len)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")  # atomic: ranks or parallel runs may race
        torch.save(chunks, tmp)
        os.replace(tmp, path)
    return chunks.tolist()


class SpanCorruptionDataset(Dataset):
    def __init__(self, chunks: list[list[int]], sentinels: list[int], eos_id: int, seed: int,
                 noise_density: float, mean_span: float):
        self.chunks, self.sentinels, self.eos_id, self.seed = chunks, sentinels, eos_id, seed
        self.noise_density, self.mean_span = noise_density, mean_span

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict:
        rng = random.Random(self.seed * 1_000_003 + i)
        inp, tgt = span_corrupt(self.chunks[i], self.sentinels, self.eos_id, rng, self.noise_density, self.mean_span)
        return {"input_ids": inp, "labels": tgt, "index": i}


class SpanCorruptionDataModule(L.LightningDataModule):
    """Train/val span-corruption examples from ``texts``, every ``val_every``-th chunk held out."""

    def __init__(self, texts: Sequence[str], tokenizer: Any, chunk_len: int = 128, batch_size: int = 16,
                 noise_density: float = 0.15, mean_span: float = 3.0, val_every: int = 50,
                 max_val: int = 256, seed: int = 0, num_workers: int = 0, cache_dir: str | None = None):
        super().__init__()
        self.texts, self.tokenizer = list(texts), tokenizer
        self.chunk_len, self.batch_size, self.num_workers = chunk_len, batch_size, num_workers
        self.noise_density, self.mean_span, self.seed = noise_density, mean_span, seed
        self.val_every, self.max_val, self.cache_dir = val_every, max_val, cache_dir
        self.splits: dict[str, list[list[int]]] | None = None
        self.skip_train_batches = 0  # set by t5_resume.TrainPosition when a fit resumes mid-epoch

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            chunks = token_chunks(self.texts, self.tokenizer, self.chunk_len, self.cache_dir)
            val = [c for i, c in enumerate(chunks) if i % self.val_every == 0][: self.max_val]
            train = [c for i, c in enumerate(chunks) if i % self.val_every != 0]
            self.splits = {"train": train, "val": val}

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        assert self.splits is not None, "call setup() first"
        tok = self.tokenizer
        ds = SpanCorruptionDataset(self.splits[split], sentinel_ids(tok), tok.eos_token_id,
                                   self.seed + (split == "val"), self.noise_density, self.mean_span)
        return ResumableDataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                                   collate_fn=functools.partial(collate_seq2seq, pad_token_id=tok.pad_token_id),
                                   skip_batches=self.skip_train_batches if split == "train" else 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)


def held_out_summaries(splits: dict[str, list[dict]]) -> list[str]:
    return [p["target"] for s in ("val", "test") for p in splits.get(s, [])]

