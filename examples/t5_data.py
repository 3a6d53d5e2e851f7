"""Offline data pieces for the T5 fine-tuning recipe.

Design note
-----------
* The data must exist on an air-gapped machine, so the default dataset is built
  from the Python standard library that ships with the interpreter itself:
  task = "summarise this function": source = function/method code with every
  docstring removed, target = first sentence of its docstring (``summary="paragraph"``: the first
  paragraph).  A first-sentence target is the common code-summarisation formulation.
* Docstrings are removed by cutting their exact line range (located with
  ``ast``) out of the original text, which keeps comments and formatting.  When
  a docstring shares a line with other code, or cutting would leave invalid
  code, we fall back to ``ast.unparse`` of a copy without docstrings.
* Everything is deterministic: sorted file lists, a seeded RNG for the cap, and
  a train/val/test split keyed on ``zlib.crc32`` of the *module name* (never
  ``hash()``, which is salted per process), so all ranks / reruns agree and no
  module leaks across splits.
* Tokenizers live in t5_tokenizer.py (a BPE trained on the training split, or ByT5's bytes).
* Every example carries its index in the split (``index``), so predictions written from several ranks
  can be put back in order and the DistributedSampler's padding duplicates dropped.
"""
from __future__ import annotations

import ast
import copy
import csv
import functools
import hashlib
import inspect
import json
import os
import random
import re
import sysconfig
import textwrap
import zlib
from pathlib import Path
from typing import Any, Iterable, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from t5_resume import ResumableDataLoader
from t5_tokenizer import bytes_tokenizer, encode

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
SPLITS = ("train", "val", "test")
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_DOC_OWNERS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)


# --------------------------------------------------------------------------- stdlib pairs
def _docstring_node(node: ast.AST) -> ast.Expr | None:
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0]
    return None


def _strip_by_unparse(fn: ast.AST) -> str:
    # Fallback: drop every docstring node from a deep copy; `pass` keeps bodies non-empty.
    fn = copy.deepcopy(fn)
    for n in ast.walk(fn):
        if isinstance(n, _DOC_OWNERS) and _docstring_node(n) is not None:
            n.body = n.body[1:] or [ast.Pass()]
    return ast.unparse(fn)


def _strip_docstrings(fn: ast.AST, lines: list[str]) -> str | None:
    """Source of `fn` (from its `def` line) with all docstrings (incl. nested) removed."""
    start, end = fn.lineno, fn.end_lineno
    cut: set[int] = set()
    clean = True
    for n in ast.walk(fn):
        doc = _docstring_node(n) if isinstance(n, _DOC_OWNERS) else None
        if doc is None:
            continue
        first, last = lines[doc.lineno - 1], lines[doc.end_lineno - 1]
        # Only cut if the docstring owns its lines (nothing but a comment after it).
        tail = last.encode()[doc.end_col_offset:].decode(errors="ignore").strip()
        head = first.encode()[:doc.col_offset].decode(errors="ignore").strip()
        if head or (tail and not tail.startswith("#")) or len(n.body) == 1:
            clean = False  # e.g. `def f(): "doc"`, `"doc"; x = 1`, or a body that is only the docstring
            break
        cut.update(range(doc.lineno, doc.end_lineno + 1))
    if clean:
        text = textwrap.dedent("\n".join(
            lines[i - 1] for i in range(start, end + 1) if i not in cut)).strip("\n")
        try:
            tree = ast.parse(text)
            if len(tree.body) == 1 and isinstance(tree.body[0], _FUNCS) \
                    and _docstring_node(tree.body[0]) is None:
                return text
        except SyntaxError:
            pass
    return _strip_by_unparse(fn)


SUMMARIES = ("sentence", "paragraph")
# a sentence ends at . ! ? followed by whitespace and then a capital, a quote/bracket or the end; "e.g. foo",
# "x.y" and "1.5" stay inside
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"(\[])")


def _summary(doc: str, unit: str = "sentence") -> str:
    """First sentence (the usual code-summarisation target) or first paragraph of a docstring, whitespace
    collapsed."""
    para = " ".join(re.split(r"\n\s*\n", inspect.cleandoc(doc).strip(), maxsplit=1)[0].split())
    if unit == "paragraph":
        return para
    if unit != "sentence":
        raise ValueError(f"summary={unit!r}: allowed {', '.join(SUMMARIES)}.")
    return _SENTENCE_END.split(para, maxsplit=1)[0]


def _norm(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _iter_stdlib_files(root: Path, packages: Sequence[str] | None) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place; sort so traversal order never depends on the filesystem.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py"):
                rel = Path(dirpath, f).relative_to(root)
                if packages is None or _module_name(rel).split(".")[0] in packages:
                    out.append(rel)
    return sorted(out)


def split_of(key: str, val_pct: int = 5, test_pct: int = 5) -> str:
    """Stable split bucket for `key` (crc32 is identical across processes and machines)."""
    b = zlib.crc32(key.encode("utf-8")) % 100
    return "val" if b < val_pct else "test" if b < val_pct + test_pct else "train"


def _pairs_from_file(path: Path, module: str, max_source_chars: int,
                     min_words: int, max_words: int, min_source_lines: int, summary: str) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # e.g. deliberately broken files such as lib2to3 fixtures
    lines = text.splitlines()
    out: list[dict] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")  # methods, incl. nested classes
            elif isinstance(node, _FUNCS):
                doc = ast.get_docstring(node, clean=False)
                if not doc or len(node.body) < 2:
                    continue  # no docstring, or nothing left to summarise once it is removed
                target = _summary(doc, summary)
                n_words = len(target.split())
                if not (min_words <= n_words <= max_words) or ">>>" in target:
                    continue
                source = _strip_docstrings(node, lines)
                if source is None or len(source) > max_source_chars \
                        or source.count("\n") + 1 < min_source_lines:
                    continue
                # Skip pairs whose summary is copied verbatim in the code (e.g. an error
                # message repeating the docstring): trivial to "predict", and it would make
                # the leak check ambiguous.
                if _norm(" ".join(target.split()[:8])) in _norm(source):
                    continue
                out.append({"source": source, "target": target,
                            "module": module, "name": prefix + node.name})

    visit(tree.body, "")
    return out


def build_stdlib_pairs(seed: int = 0, max_source_chars: int = 2000, max_pairs: int | None = 6000,
                       min_target_words: int = 3, max_target_words: int = 60,
                       min_source_lines: int = 2, packages: Sequence[str] | None = None,
                       val_pct: int = 5, test_pct: int = 5, stdlib_dir: str | None = None,
                       cache_dir: str | None = None, summary: str = "sentence") -> dict[str, list[dict]]:
    """Code-summarisation pairs from the interpreter's stdlib, split by module.

    `summary`: the target is the docstring's first "sentence" (default) or its first "paragraph".

    `packages` restricts to top-level module names (e.g. ("email", "json")) for fast tests.
    `max_pairs` caps the total deterministically (sorted, then a seeded sample).
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    params = dict(seed=seed, max_source_chars=max_source_chars, max_pairs=max_pairs,
                  min_target_words=min_target_words, max_target_words=max_target_words,
                  min_source_lines=min_source_lines, val_pct=val_pct, test_pct=test_pct,
                  packages=sorted(packages) if packages is not None else None,
                  root=str(root), v=1)
    if summary not in SUMMARIES:
        raise ValueError(f"summary={summary!r}: allowed {', '.join(SUMMARIES)}.")
    if summary != "paragraph":  # keeps the cache key of first-paragraph sets built before the option
        params["summary"] = summary
    cache = None
    if cache_dir:
        key = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"stdlib_pairs_{key}.jsonl"
        if cache.exists():
            splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
            for rec in _read_jsonl(cache):
                splits[rec.pop("split")].append(rec)
            return splits

    pairs: list[dict] = []
    for rel in _iter_stdlib_files(root, packages):
        pairs += _pairs_from_file(root / rel, _module_name(rel), max_source_chars,
                                  min_target_words, max_target_words, min_source_lines, summary)
    pairs.sort(key=lambda p: (p["module"], p["name"], p["source"]))
    if max_pairs is not None and len(pairs) > max_pairs:
        pairs = random.Random(seed).sample(pairs, max_pairs)
        pairs.sort(key=lambda p: (p["module"], p["name"], p["source"]))

    splits = {s: [] for s in SPLITS}
    for p in pairs:
        splits[split_of(p["module"], val_pct, test_pct)].append(p)

    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")  # atomic: ranks may race to write it
        with tmp.open("w", encoding="utf-8") as f:
            for s in SPLITS:
                for p in splits[s]:
                    f.write(json.dumps({**p, "split": s}, ensure_ascii=False) + "\n")
        os.replace(tmp, cache)
    return splits


# --------------------------------------------------------------------------- user files
def _read_jsonl(path: Path) -> Iterable[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def load_pairs_file(path: str | os.PathLike, source_field: str = "source",
                    target_field: str = "target") -> list[dict]:
    """Read the user's own pairs from .jsonl/.json (one object per line) or .csv."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext in (".jsonl", ".json"):
        rows = list(_read_jsonl(path))
    elif ext == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        raise ValueError(f"Unsupported pairs file extension {ext!r} for {path}; "
                         "use .jsonl (one JSON object per line) or .csv with a header row.")
    out = []
    for i, row in enumerate(rows):
        for field in (source_field, target_field):
            if field not in row:
                raise ValueError(f"{path}: record {i} has no field {field!r} "
                                 f"(available: {sorted(row)}); pass source_field=/target_field=.")
        out.append({"source": str(row[source_field]), "target": str(row[target_field])})
    return out


# --------------------------------------------------------------------------- tokenizer
def ByteTokenizer():
    """transformers' ``ByT5Tokenizer`` (``tokenizer=bytes``): no vocabulary file, so nothing to download."""
    return bytes_tokenizer()


# --------------------------------------------------------------------------- name words
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)", re.M)


def name_words(source: str) -> str:
    """The name of the function ``source`` defines, split into lower-case words (snake_case and CamelCase:
    ``_check_thread`` -> ``check thread``, ``getHTTPHeader`` -> ``get httpheader``); '' if it defines none."""
    m = _DEF.search(source)
    if m is None:
        return ""
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", m.group(1))
    return " ".join(w.lower() for w in re.split(r"[_\s]+", name) if w)


def with_name_words(source: str) -> str:
    """``source`` after a first line holding its function's :func:`name_words` (the identifier split of
    code-summarisation models): the words a summary reuses become ordinary prose tokens the decoder can copy
    (a byte-level BPE gives ``thread`` in code and `` thread`` in prose different ids)."""
    words = name_words(source)
    return f"{words}\n{source}" if words else source


# --------------------------------------------------------------------------- datamodule
class Seq2SeqDataset(Dataset):
    def __init__(self, pairs: list[dict], tokenizer: Any, max_source_len: int, max_target_len: int,
                 name_hint: bool = False):
        self.pairs, self.tok = pairs, tokenizer
        self.max_source_len, self.max_target_len = max_source_len, max_target_len
        self.name_hint = name_hint

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        p = self.pairs[i]  # tokenised lazily: cheap for bytes, and keeps setup fast
        source = with_name_words(p["source"]) if self.name_hint else p["source"]
        return {"input_ids": encode(self.tok, source, self.max_source_len),
                "labels": encode(self.tok, p["target"], self.max_target_len), "index": i}


def collate_seq2seq(batch: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad inputs with pad id and labels with -100 (ignored by the T5 loss)."""
    def pad(seqs: list[list[int]], value: int) -> torch.Tensor:
        out = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return out

    input_ids = pad([b["input_ids"] for b in batch], pad_token_id)
    mask = pad([[1] * len(b["input_ids"]) for b in batch], 0)
    out = {"input_ids": input_ids, "attention_mask": mask, "labels": pad([b["labels"] for b in batch], -100)}
    if all("index" in b for b in batch):
        out["index"] = torch.tensor([b["index"] for b in batch], dtype=torch.long)
    return out


class Seq2SeqDataModule(L.LightningDataModule):
    """`pairs`: "stdlib", a .jsonl/.csv path, or an already split {"train": [...], ...} dict."""

    def __init__(self, pairs: str | dict = "stdlib", tokenizer: Any = None, batch_size: int = 8,
                 max_source_len: int = 256, max_target_len: int = 64, num_workers: int = 0,
                 limit_train: int | None = None, limit_val: int | None = None,
                 source_field: str = "source", target_field: str = "target",
                 stdlib_kwargs: dict | None = None, name_hint: bool = False):
        super().__init__()
        self.pairs_spec = pairs
        self.tokenizer = tokenizer if tokenizer is not None else bytes_tokenizer()
        self.batch_size, self.num_workers = batch_size, num_workers
        self.max_source_len, self.max_target_len = max_source_len, max_target_len
        self.limit_train, self.limit_val = limit_train, limit_val
        self.source_field, self.target_field = source_field, target_field
        self.stdlib_kwargs = stdlib_kwargs or {}
        self.name_hint = name_hint  # prefix each source with its function's name words (with_name_words)
        self.splits: dict[str, list[dict]] | None = None
        self.skip_train_batches = 0  # set by t5_resume.TrainPosition when a fit resumes mid-epoch

    def _load_splits(self) -> dict[str, list[dict]]:
        if isinstance(self.pairs_spec, dict):
            return {s: list(self.pairs_spec.get(s, [])) for s in SPLITS}
        if self.pairs_spec == "stdlib":
            return build_stdlib_pairs(**self.stdlib_kwargs)
        rows = load_pairs_file(self.pairs_spec, self.source_field, self.target_field)
        # User files have no module names: split on the source text (stable across ranks).
        splits = {s: [] for s in SPLITS}
        for r in rows:
            splits[split_of(r["source"])].append(r)
        return splits

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:  # every rank builds the same deterministic splits
            self.splits = self._load_splits()
            if self.limit_train is not None:
                self.splits["train"] = self.splits["train"][: self.limit_train]
            if self.limit_val is not None:
                for s in ("val", "test"):
                    self.splits[s] = self.splits[s][: self.limit_val]

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        assert self.splits is not None, "call setup() first"
        ds = Seq2SeqDataset(self.splits[split], self.tokenizer, self.max_source_len, self.max_target_len,
                            self.name_hint)
        pad_id = self.tokenizer.pad_token_id
        # Lightning injects a DistributedSampler for distributed strategies; a resumed fit skips what the
        # checkpoint's epoch had consumed (t5_resume.py)
        return ResumableDataLoader(ds, batch_size=self.batch_size, shuffle=shuffle,
                                   num_workers=self.num_workers,
                                   collate_fn=functools.partial(collate_seq2seq, pad_token_id=pad_id),
                                   persistent_workers=self.num_workers > 0,
                                   skip_batches=self.skip_train_batches if split == "train" else 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
