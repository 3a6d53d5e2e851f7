"""Tests for the fp16 loss scalers.

Expected values are hand-computed or come from ``_reference_update`` below, a
literal transcription of DeepSpeed's ``DynamicLossScaler.update_scale``, kept
independent of the code under test on purpose.
"""

import copy
import io
import random

import pytest
import torch

from lightning_zero.engine.optim.loss_scaler import DynamicLossScaler, LossScalerError, StaticLossScaler

O, C = True, False  # overflow / clean step


def _reference_update(s, overflow):
    """DeepSpeed update_scale on a plain dict (delayed_shift == hysteresis)."""
    if overflow:
        if s["cur_hysteresis"] == 1:
            if s["scale"] == s["min_scale"] and s["raise_at_min"]:
                raise Exception("min scale")
            s["scale"] = max(s["scale"] / s["factor"], s["min_scale"])
        else:
            s["cur_hysteresis"] -= 1
        s["last_overflow_iter"] = s["cur_iter"]
    else:
        if s["consecutive"]:
            s["cur_hysteresis"] = s["hysteresis"]
        if (s["cur_iter"] - s["last_overflow_iter"]) % s["window"] == 0:
            if not s["consecutive"]:
                s["cur_hysteresis"] = s["hysteresis"]
            s["scale"] *= s["factor"]
    s["cur_iter"] += 1


def _run(scaler, pattern):
    scales, skips = [], []
    for ov in pattern:
        skips.append(scaler.update(ov))
        scales.append(scaler.scale)
    return scales, skips


def test_defaults():
    s = DynamicLossScaler()
    assert s.scale == 2.0**16
    assert s.dynamic is True
    assert s.skipped_steps == 0
    assert (s.scale_window, s.hysteresis, s.min_scale, s.scale_factor) == (1000, 2, 1.0, 2.0)


def test_no_overflow_doubles_every_window_of_3():
    s = DynamicLossScaler(scale_window=3)
    scales, skips = _run(s, [C] * 10)
    assert scales == [2.0**e for e in (16, 16, 17, 17, 17, 18, 18, 18, 19, 19)]
    assert skips == [False] * 10
    assert s.skipped_steps == 0


def test_no_overflow_doubles_every_1000_by_default():
    s = DynamicLossScaler()
    for step in range(1, 3001):
        s.update(False)
        assert s.scale == 2.0 ** (16 + step // 1000), step
    assert s.scale == 2.0**19


def test_persistent_overflow_hysteresis_then_halving_then_error():
    s = DynamicLossScaler(init_scale=16.0, hysteresis=2, min_scale=1.0)
    scales, skips = _run(s, [O] * 5)
    # First overflow only consumes the hysteresis budget.
    assert scales == [16.0, 8.0, 4.0, 2.0, 1.0]
    assert skips == [True] * 5
    assert s.skipped_steps == 5
    with pytest.raises(LossScalerError) as exc:
        s.update(True)
    assert isinstance(exc.value, RuntimeError)
    msg = str(exc.value)
    assert "minimum" in msg and "bf16" in msg and "raise_at_min_scale" in msg
    assert s.scale == 1.0


def test_persistent_overflow_default_hysteresis_from_2_16():
    s = DynamicLossScaler()
    scales, _ = _run(s, [O] * 17)
    assert scales == [2.0**16] + [2.0**e for e in range(15, -1, -1)]
    with pytest.raises(LossScalerError):
        s.update(True)


def test_min_scale_clamps_non_power_of_two():
    s = DynamicLossScaler(init_scale=10.0, min_scale=3.0, hysteresis=1)
    scales, _ = _run(s, [O, O])
    assert scales == [5.0, 3.0]  # max(2.5, 3.0)
    with pytest.raises(LossScalerError):
        s.update(True)


def test_no_raise_at_min_scale_keeps_skipping():
    s = DynamicLossScaler(init_scale=4.0, hysteresis=1, raise_at_min_scale=False)
    scales, skips = _run(s, [O] * 10)
    assert scales == [2.0, 1.0] + [1.0] * 8
    assert skips == [True] * 10
    assert s.skipped_steps == 10
    # Recovery: growth restarts one full window after the last overflow.
    s2 = DynamicLossScaler(init_scale=1.0, hysteresis=1, scale_window=2, raise_at_min_scale=False)
    assert _run(s2, [O, C, C, C, C])[0] == [1.0, 1.0, 2.0, 2.0, 4.0]


def test_mixed_pattern_exact():
    s = DynamicLossScaler(init_scale=1024.0, scale_window=3, hysteresis=2)
    pattern = [O, C, C, C, O, O, C, C, O, C, C, C, C, C, C]
    expected_scales = [1024, 1024, 1024, 2048, 2048, 1024, 1024, 1024, 512, 512, 512, 1024, 1024, 1024, 2048]
    expected_hyst = [1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    for i, ov in enumerate(pattern):
        assert s.update(ov) is ov
        assert s.scale == expected_scales[i], i
        assert s.cur_hysteresis == expected_hyst[i], i
    assert s.skipped_steps == 4
    assert s.cur_iter == 15
    assert s.last_overflow_iter == 8


def test_consecutive_hysteresis_resets_after_clean_step():
    pattern = [O, C, O, C, O, C, O]
    plain = DynamicLossScaler(init_scale=1024.0, scale_window=100, hysteresis=2)
    assert _run(plain, pattern)[0] == [1024, 1024, 512, 512, 256, 256, 128]
    consec = DynamicLossScaler(init_scale=1024.0, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    scales, _ = _run(consec, pattern)
    # Isolated overflows separated by clean steps never exhaust the hysteresis.
    assert scales == [1024] * 7
    assert consec.cur_hysteresis == 1
    assert consec.skipped_steps == plain.skipped_steps == 4
    # Two overflows in a row still shrink the scale.
    consec.update(True)
    assert consec.scale == 512


def test_consecutive_hysteresis_growth_same_window():
    s = DynamicLossScaler(init_scale=8.0, scale_window=3, consecutive_hysteresis=True)
    assert _run(s, [O, C, C, C, C, C, C])[0] == [8, 8, 8, 16, 16, 16, 32]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("window", [1, 2, 5])
def test_matches_reference_on_random_patterns(consecutive, hysteresis, window):
    rng = random.Random(1234 + hysteresis * 10 + window)
    for _ in range(5):
        s = DynamicLossScaler(init_scale=2.0**8, scale_window=window, hysteresis=hysteresis,
                              consecutive_hysteresis=consecutive, raise_at_min_scale=False)
        ref = dict(scale=2.0**8, cur_hysteresis=hysteresis, hysteresis=hysteresis, last_overflow_iter=-1,
                   cur_iter=0, window=window, factor=2.0, min_scale=1.0, consecutive=consecutive,
                   raise_at_min=False)
        skipped = 0
        for _ in range(300):
            ov = rng.random() < 0.3
            _reference_update(ref, ov)
            skipped += ov
            assert s.update(ov) is ov
            assert s.scale == ref["scale"]
            assert s.cur_hysteresis == ref["cur_hysteresis"]
            assert s.last_overflow_iter == ref["last_overflow_iter"]
            assert s.cur_iter == ref["cur_iter"]
        assert s.skipped_steps == skipped


def test_state_dict_round_trip_continues_identically():
    rng = random.Random(0)
    pattern = [rng.random() < 0.25 for _ in range(400)]
    kwargs = dict(init_scale=2.0**12, scale_window=7, hysteresis=3, consecutive_hysteresis=True,
                  min_scale=0.5, raise_at_min_scale=False)
    uninterrupted = DynamicLossScaler(**kwargs)
    full = _run(uninterrupted, pattern)

    first = DynamicLossScaler(**kwargs)
    head = _run(first, pattern[:150])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # checkpoints go through torch.save
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    resumed = DynamicLossScaler()  # different config on purpose: must come from the state
    resumed.load_state_dict(state)
    tail = _run(resumed, pattern[150:])
    assert (head[0] + tail[0], head[1] + tail[1]) == full
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert resumed.skipped_steps == sum(pattern)


def test_state_dict_contents_and_isolation():
    s = DynamicLossScaler(scale_window=3)
    _run(s, [O, C, C])
    sd = s.state_dict()
    for k in ("scale", "cur_hysteresis", "last_overflow_iter", "cur_iter", "skipped_steps",
              "init_scale", "scale_window", "hysteresis", "consecutive_hysteresis", "min_scale",
              "scale_factor", "raise_at_min_scale"):
        assert k in sd
    snapshot = copy.deepcopy(sd)
    s.update(True)
    assert sd == snapshot  # state_dict is a snapshot, not a live view


def test_load_state_dict_rejects_bad_state():
    s = DynamicLossScaler()
    sd = s.state_dict()
    del sd["cur_hysteresis"]
    with pytest.raises(ValueError, match="cur_hysteresis"):
        DynamicLossScaler().load_state_dict(sd)
    with pytest.raises(ValueError):
        DynamicLossScaler().load_state_dict(StaticLossScaler(8.0).state_dict())
    with pytest.raises(ValueError):
        StaticLossScaler().load_state_dict(s.state_dict())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(init_scale=1.0, min_scale=2.0), "init_scale"),
        (dict(scale_window=0), "scale_window"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(scale_factor=1.0), "scale_factor"),
        (dict(scale_factor=0.5), "scale_factor"),
    ],
)
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


def test_static_loss_scaler():
    s = StaticLossScaler(128.0)
    assert s.dynamic is False
    assert s.scale == 128.0
    scales, skips = _run(s, [O] * 50 + [C] * 2000 + [O])
    assert set(scales) == {128.0}  # never grows, never shrinks, never raises
    assert skips == [True] * 50 + [False] * 2000 + [True]
    assert s.skipped_steps == 51
    other = StaticLossScaler()
    other.load_state_dict(s.state_dict())
    assert (other.scale, other.skipped_steps) == (128.0, 51)
    with pytest.raises(ValueError):
        StaticLossScaler(0.0)
