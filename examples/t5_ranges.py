"""The T5 recipe's numeric knobs and their ranges, in one table, checked before any process starts.

Hydra's schema (t5_config.py) types every field, so ``trainer.accumulate_grad_batches=two`` stops while
composing; a value of the right type can still be out of range (``trainer.gradient_clip_val=-1`` would train
without clipping, ``data.max_source_len=-5`` would cut every source short, ``trainer.accumulate_grad_batches=0``
divides by zero inside the ranks). :func:`check_ranges` refuses all of them at once, naming each knob and
what it allows. The strategy's own numbers (``strategy.bucket_mb``, ``strategy.prefetch``, ...) are
``ZeroConfig``'s to check (``build_strategy``); this table is what the recipe passes on to Lightning, the
data, the tokenizer, the model and the optimizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

_ABSENT = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def ints(lo: int, hi: Optional[int] = None, null: bool = False) -> tuple[Callable[[Any], bool], str]:
    """An int in [lo, hi] (and None when ``null``)."""
    text = f"an int >= {lo}" if hi is None else f"an int from {lo} to {hi}"
    return (lambda v: (null and v is None) or (_is_int(v) and v >= lo and (hi is None or v <= hi)),
            f"null or {text}" if null else text)


def nums(lo: float, hi: Optional[float] = None, lo_open: bool = False, hi_open: bool = False,
         null: bool = False) -> tuple[Callable[[Any], bool], str]:
    """A finite number in the interval (open ends where asked), and None when ``null``."""
    def ok(v: Any) -> bool:
        if null and v is None:
            return True
        return (_is_num(v) and (v > lo if lo_open else v >= lo)
                and (hi is None or (v < hi if hi_open else v <= hi)))

    if hi is None:
        text = f"a number {'>' if lo_open else '>='} {lo:g}"
    else:
        text = f"a number with {lo:g} {'<' if lo_open else '<='} value {'<' if hi_open else '<='} {hi:g}"
    return ok, f"null or {text}" if null else text


def count_or_fraction(int_lo: int, frac_lo_open: bool) -> tuple[Callable[[Any], bool], str]:
    """Lightning's int-or-float knobs: an int count, or a float fraction of the epoch."""
    fraction, text = nums(0.0, 1.0, lo_open=frac_lo_open)
    return (lambda v: (_is_int(v) and v >= int_lo) or (isinstance(v, float) and fraction(v)),
            f"an int >= {int_lo} (batches) or a float fraction with {'0 <' if frac_lo_open else '0 <='} value <= 1")


@dataclass(frozen=True)
class Range:
    path: str  # the Hydra override's key
    rule: tuple  # (predicate, what it allows)


def _subword(cfg: Any) -> bool:
    return cfg.tokenizer.kind == "subword" and not cfg.model.pretrained


def _min_subword_vocab() -> int:
    from t5_tokenizer import NUM_SENTINELS, SPECIALS

    return len(SPECIALS) + NUM_SENTINELS + 256


RANGES: tuple[Range, ...] = (
    # Lightning's Trainer
    Range("trainer.num_nodes", ints(1)),
    Range("trainer.max_steps", ints(-1)),  # -1: no limit
    Range("trainer.max_epochs", ints(-1)),
    Range("trainer.val_check_interval", count_or_fraction(1, frac_lo_open=True)),
    Range("trainer.check_val_every_n_epoch", ints(1, null=True)),
    Range("trainer.limit_val_batches", count_or_fraction(0, frac_lo_open=False)),
    Range("trainer.num_sanity_val_steps", ints(-1)),  # -1: all
    Range("trainer.log_every_n_steps", ints(1)),
    Range("trainer.gradient_clip_val", nums(0.0, null=True)),  # null or 0: no clipping
    Range("trainer.accumulate_grad_batches", ints(1)),
    # the data
    Range("data.batch_size", ints(1)),
    Range("data.max_source_len", ints(2)),  # tokens, the eos included
    Range("data.max_target_len", ints(2)),
    Range("data.limit_train", ints(1, null=True)),
    Range("data.limit_val", ints(1, null=True)),
    Range("data.num_workers", ints(0)),
    Range("data.max_pairs", ints(1, null=True)),
    Range("data.max_source_chars", ints(1)),
    # the model and its generation
    Range("model.dropout_rate", nums(0.0, 1.0, hi_open=True)),
    Range("model.num_gen_batches", ints(0, null=True)),
    Range("model.num_samples", ints(0)),
    Range("model.max_new_tokens", ints(1)),
    Range("model.no_repeat_ngram_size", ints(0)),  # 0: off
    Range("model.sparse.block", ints(1)),
    # the optimizer and its schedule
    Range("optim.lr", nums(0.0, lo_open=True)),
    Range("optim.weight_decay", nums(0.0)),
    Range("optim.warmup_steps", ints(0)),
    Range("optim.total_steps", ints(1, null=True)),
    Range("optim.label_smoothing", nums(0.0, 1.0, hi_open=True)),
    Range("optim.freeze_step", ints(1, null=True)),
    Range("optim.var_update_scaler", ints(1)),
    Range("optim.local_step_scaler", ints(1)),
    Range("optim.local_step_clipper", ints(1)),
    # outputs, seed
    Range("output.save_top_k", ints(-1)),  # -1: every checkpoint
    Range("seed", ints(0, 2**32 - 1)),  # Lightning's seed_everything range (it picks another seed outside it)
    # t5_pretrain.py's span corruption
    Range("pretrain.chunk_len", ints(2)),  # a span of noise and a token kept
    Range("pretrain.noise_density", nums(0.0, 1.0, lo_open=True, hi_open=True)),
    Range("pretrain.mean_span", nums(1.0)),
    Range("pretrain.val_every", ints(2)),  # 1 would hold every chunk out
    Range("pretrain.max_val", ints(1)),
)


def check_ranges(cfg: Any) -> list[str]:
    """Every knob of :data:`RANGES` in ``cfg`` that is out of range, as ``"path=value (allowed: ...)"``; the
    subword tokenizer's vocabulary against its minimum too."""
    bad = []
    for r in RANGES:
        value = OmegaConf.select(cfg, r.path, default=_ABSENT)
        if value is _ABSENT:  # pretrain.* in the fine-tuning recipe
            continue
        ok, allowed = r.rule
        if not ok(value):
            bad.append(f"{r.path}={value!r} (allowed: {allowed})")
    vocab = OmegaConf.select(cfg, "tokenizer.vocab_size", default=_ABSENT)
    if vocab is not _ABSENT and _subword(cfg) and not (_is_int(vocab) and vocab >= _min_subword_vocab()):
        bad.append(f"tokenizer.vocab_size={vocab!r} (allowed: an int >= {_min_subword_vocab()} with "
                   f"tokenizer=subword: 3 specials, the sentinels and 256 bytes)")
    return bad
