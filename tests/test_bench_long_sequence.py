"""bench/long_sequence.py's measured step, run as the bench runs it (its own process, the address space capped
after a warm-up step): at 2048 tokens of GPT-2's vocabulary (50257) the plain model's step does not fit in
0.75 GiB -- its whole logits alone are 400 MiB, with copies in backward -- and the tiled model's does, with the
same loss; a bad argument is one clear error before any rank starts; the package imports no transformers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
SMALL = ("--layers", "1", "--embd", "64", "--heads", "4", "--tile", "256", "--warmup", "256")


def child(kind: str, n: int, cap_gib: float) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "long_sequence.py"), "--child", kind, str(n),
                        "--cap-gib", str(cap_gib), *SMALL], capture_output=True, text=True, env=ENV, timeout=240)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.timeout(300)
def test_at_2048_tokens_plain_does_not_fit_in_three_quarters_of_a_gib_and_tiled_does():
    plain, tiled = child("plain", 2048, 0.75), child("tiled", 2048, 0.75)
    assert not plain["ok"] and "allocate" in plain["error"], plain
    assert tiled["ok"], tiled
    assert tiled["peak_bytes"] < 0.75 * 2 ** 30 and tiled["seconds"] > 0 and tiled["wire_bytes"] == 0
    uncapped = child("plain", 2048, 0)  # the same step, the same loss
    assert uncapped["ok"] and uncapped["peak_bytes"] > 0.75 * 2 ** 30, uncapped
    assert abs(uncapped["loss"] - tiled["loss"]) <= 1e-5 * abs(uncapped["loss"])


def test_bad_arguments_are_one_error_and_the_package_imports_no_transformers():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "long_sequence.py"), "--kinds", "tiled,fast"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert p.returncode == 2 and "--kinds takes plain, tiled, tiled_ckpt" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "long_sequence.py"), "--sp", "3"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert p.returncode == 2 and "--sp a positive int dividing --multiple" in p.stderr, p.stderr
    code = ("import sys, lightning_zero.sequence_parallel; "
            "print(sorted(m for m in ('transformers', 'lightning') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr
