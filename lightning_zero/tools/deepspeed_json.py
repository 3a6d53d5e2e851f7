"""A DeepSpeed config file read as DeepSpeed reads it (``from-deepspeed``; ``deepspeed_config.py`` uses it).

[Note: DeepSpeed's config dialect]
DeepSpeed loads a config file with hjson (``DeepSpeedConfig``: ``hjson.load(..., object_pairs_hook=
dict_raise_error_on_duplicate_keys)``), and its own docs rely on that: the 1-bit Adam tutorial's config ends
its ``fp16`` block with a trailing comma, the ZeRO-3 examples separate members by a newline alone. A strict
JSON reader refuses configs DeepSpeed runs. So the text is read as JSON plus hjson's forms that keep the JSON
shape: trailing commas, members separated by newlines, ``#`` / ``//`` / ``/* */`` comments; a key given twice
is refused, as DeepSpeed refuses it. The rest of hjson (quoteless and multi-line strings) stays an error with
its line and column: no config in DeepSpeed's docs uses it, and hjson is no dependency here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from .deepspeed_auto import DeepSpeedConfigError

_VALUE_END = set('"}]') | set("0123456789") | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.")
_VALUE_START = set('"{[-') | set("0123456789") | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_DIALECT = "JSON, with trailing commas, newline-separated members and comments as DeepSpeed's hjson reads them"


def _as_json(text: str) -> str:
    """``text`` with hjson's JSON-shaped forms made JSON: comments blanked, trailing commas dropped, a comma put
    between members on separate lines; positions kept where the text shrinks (blanks, not deletions)."""
    out: list[str] = []
    last = -1  # index in out of the last significant character
    newline_since = False
    depth = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':  # a string, escapes and all, copied as it is
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            token = text[i:j + 1]
        elif c == "#" or text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
            continue
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            newline_since = newline_since or "\n" in text[i:j]
            i = j
            continue
        elif c.isspace():
            newline_since = newline_since or c == "\n"
            out.append(c)
            i += 1
            continue
        else:
            token = c
        if token[0] in "}]" and last >= 0 and out[last] == ",":
            out[last] = " "  # a trailing comma
        elif token[0] in _VALUE_START and newline_since and depth and last >= 0 and out[last][-1] in _VALUE_END:
            out[last] += ","  # a member on its own line, after a complete one
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            depth -= 1
        out.append(token)
        last, newline_since = len(out) - 1, False
        i += len(token)
    return "".join(out)


def _no_duplicates(pairs: list) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise DeepSpeedConfigError(f"DeepSpeed config: key {key!r} is given twice. Allowed: each key once in "
                                       f"its block (DeepSpeed refuses duplicates too).")
        seen[key] = value
    return seen


def read_config(config: Union[dict, str, Path]) -> dict:
    """A config dict as it is, or a file's object in DeepSpeed's dialect ([Note: DeepSpeed's config dialect])."""
    if isinstance(config, dict):
        return config
    path = Path(config)
    if not path.exists():
        raise DeepSpeedConfigError(f"DeepSpeed config {str(path)!r}: no such file.")
    if path.is_dir():
        raise DeepSpeedConfigError(f"DeepSpeed config {str(path)!r} is a directory; give the JSON file "
                                   "(e.g. ds_config.json).")
    try:
        loaded = json.loads(_as_json(path.read_text()), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DeepSpeedConfigError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}. Allowed: {_DIALECT}.") \
            from None
    if not isinstance(loaded, dict):
        raise DeepSpeedConfigError(f"DeepSpeed config {str(path)!r}: expected a JSON object, got "
                                   f"{type(loaded).__name__}.")
    return loaded
