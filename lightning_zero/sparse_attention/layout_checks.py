"""The checks of every sparsity-config knob, made when a config is built (before any layout, rank or step).

DeepSpeed's classes check only a few relations (``num_local_blocks % num_global_blocks``, start < end of a
global range) and take the rest as given, so ``num_random_blocks=-1`` drew all blocks but one (a near-dense
layout, ``randperm(n)[:-1]``), a negative window silently became no window, a negative global index counted
from the end, ``num_global_blocks=0`` raised ``ZeroDivisionError`` and a string where a flag belongs was read as
true. Here each knob is one ``ValueError`` naming the knob, the value and what is allowed; the recipe turns it
into its config error before any process starts.

Lengths are not known when a config is built: a count larger than the blocks of a sequence is the layout's
business (``layouts.py`` covers the whole sequence then), and a global block index past the end of a short
sequence is skipped, as in DeepSpeed.
"""
from __future__ import annotations

from numbers import Integral
from typing import Any, Mapping, Sequence

ATTENTION_KINDS = ("bidirectional", "unidirectional")


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int) -> int:
    """An integer ``>= minimum`` (bool refused: ``True`` is not a count)."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r}: allowed an integer >= {minimum}.")
    return int(value)


def check_flag(name: str, value: Any) -> bool:
    """A bool (``"yes"``, ``1`` and ``"false"`` refused: a string would always read as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: allowed true or false (a bool).")
    return value


def check_attention(value: Any) -> str:
    if value not in ATTENTION_KINDS:
        raise ValueError(f"attention={value!r}: allowed {', '.join(map(repr, ATTENTION_KINDS))}.")
    return value


def check_int_list(name: str, value: Any, minimum: int, *, empty: bool) -> list[int]:
    """A list of integers ``>= minimum`` (a bare integer refused: DeepSpeed takes lists here)."""
    ok = isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and (empty or len(value) > 0)
    if not ok or not all(_is_int(v) and v >= minimum for v in value):
        what = "a list" + ("" if empty else " of one or more") + f" of integers >= {minimum}"
        example = "[0]" if minimum == 0 else "[4]"
        raise ValueError(f"{name}={value!r}: allowed {what}, e.g. {example}.")
    return [int(v) for v in value]


def check_global_ranges(starts: list[int], ends: Any) -> list[int] | None:
    """``global_block_end_indices``: None, or one end per start, each after its start."""
    if ends is None:
        return None
    ends = check_int_list("global_block_end_indices", ends, 0, empty=True)
    if len(starts) != len(ends):
        raise ValueError(f"global_block_indices has {len(starts)} entries but global_block_end_indices "
                         f"{len(ends)}: allowed one end per start (or null: one block per start).")
    for s, e in zip(starts, ends):
        if s >= e:
            raise ValueError(f"global block start index {s} must be smaller than its end index {e} "
                             "(global_block_end_indices are exclusive).")
    return ends


def check_horizontal(horizontal: Any, attention: str) -> bool:
    horizontal = check_flag("horizontal_global_attention", horizontal)
    if attention != "bidirectional" and horizontal:
        raise ValueError("horizontal_global_attention=True needs attention='bidirectional'.")
    return horizontal


def check_options(options: Any, more: dict) -> dict:
    """A drop-in's ``options`` (the recipe's ``model.sparse.options``): a mapping of option names, merged with
    the keyword options."""
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"options={options!r}: allowed a mapping of the layout's options, e.g. "
                         "{'num_sliding_window_blocks': 3}.")
    return {**(options or {}), **more}
