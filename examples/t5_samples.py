"""Generated text a person reads: the fixed validation samples table, and the test predictions file.

Design note: every rank generates for its own share of a batch, so rows are gathered to global rank 0 with
``all_gather_object`` (every rank must call it) and put back in dataset order by their ``index``; the
DistributedSampler pads the last batch with repeats, which the index also removes.  Rank 0 appends each
validation's table to ``samples.jsonl`` in the run directory: the console summary reads the last entry
from there, because under the fork/spawn launchers the process printing it is not the one that trained.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch.distributed as dist


def gather_rows(rows: list[dict]) -> list[dict]:
    """Rows of every rank (on every rank), sorted by ``index``, duplicates dropped."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, rows)
        rows = [r for part in parts for r in part]
    seen, out = set(), []
    for r in sorted(rows, key=lambda r: r["index"]):
        if r["index"] not in seen:
            seen.add(r["index"])
            out.append(r)
    return out


def function_head(source: str, width: int = 72) -> str:
    """The ``def`` line (with a decorator dropped), shortened to ``width`` characters."""
    lines = [ln.strip() for ln in source.splitlines() if ln.strip()]
    head = next((ln for ln in lines if ln.startswith(("def ", "async def "))), lines[0] if lines else "")
    return head if len(head) <= width else head[: width - 3] + "..."


def _cell(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def console_table(rows: Iterable[dict], width: int = 100) -> str:
    """One block per sample: the function head, its reference docstring, what the model generated."""
    out = []
    for r in rows:
        out.append(f"[{r['index']}] {function_head(r['source'], width - 5)}")
        out.append(f"    reference: {_cell(r['reference'], width - 15)}")
        out.append(f"    generated: {_cell(r['prediction'], width - 15) or '(empty)'}")
    return "\n".join(out)


def markdown_table(rows: Iterable[dict]) -> str:
    """TensorBoard's text plugin renders markdown: one table row per sample."""
    def esc(t: str) -> str:
        return " ".join(t.split()).replace("|", "\\|") or "(empty)"

    lines = ["| # | function head | reference | generated |", "|---|---|---|---|"]
    lines += [f"| {r['index']} | `{esc(function_head(r['source']))}` | {esc(r['reference'])} | "
              f"{esc(r['prediction'])} |" for r in rows]
    return "\n".join(lines)


def append_jsonl(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_jsonl(path: str, rows: Iterable[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def last_samples(path: str) -> dict | None:
    """The last validation's entry of ``samples.jsonl`` ({"step": N, "rows": [...]}), None if absent."""
    if not os.path.isfile(path):
        return None
    last = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                last = json.loads(line)
    return last
