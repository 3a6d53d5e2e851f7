"""The T5 recipe's optimisation levers (examples/t5_module.py): the learning-rate schedules after warmup and
the label-smoothed training loss, each checked against a formula written out here."""
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # examples/ is not a package
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from t5_module import LR_SCHEDULES, T5FineTuner  # noqa: E402

PEAK, WARMUP, TOTAL = 1e-2, 10, 110


def _lrs(schedule: str) -> list[float]:
    model = T5FineTuner("t5_tiny", lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL, lr_schedule=schedule)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    out = []
    for _ in range(TOTAL + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("schedule", LR_SCHEDULES)
def test_schedules_warm_up_then_follow_their_formula(schedule):
    lrs = _lrs(schedule)
    assert lrs[0] == pytest.approx(PEAK / (WARMUP + 1))
    assert lrs[WARMUP] == pytest.approx(PEAK)  # the peak right after warmup, whatever comes next
    span = TOTAL - WARMUP
    for step in (WARMUP + span // 4, WARMUP + span // 2, TOTAL):
        frac = (step - WARMUP) / span
        want = {"linear": 1 - frac, "cosine": 0.5 * (1 + math.cos(math.pi * frac)),
                "inverse_sqrt": math.sqrt(WARMUP / step)}[schedule]
        assert lrs[step] == pytest.approx(PEAK * want, abs=1e-12)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\(\)`")
def test_label_smoothing_changes_the_training_loss_only():
    torch.manual_seed(0)
    eps = 0.1
    plain = T5FineTuner("t5_tiny", dropout_rate=0.0)
    smooth = T5FineTuner("t5_tiny", dropout_rate=0.0, label_smoothing=eps)
    smooth.model.load_state_dict(plain.model.state_dict())
    labels = torch.tensor([[5, 6, 7, 1], [8, 9, 1, -100]])
    batch = {"input_ids": torch.tensor([[10, 11, 12, 1], [13, 14, 1, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), "labels": labels, "index": torch.arange(2)}
    inputs = {k: v for k, v in batch.items() if k != "index"}
    with torch.no_grad():
        logits = plain.model(**inputs).logits
        assert plain.training_step(batch, 0).item() == pytest.approx(plain.model(**inputs).loss.item(), rel=1e-6)
        got = smooth.training_step(batch, 0).item()
    # (1 - eps) * NLL of the label + eps * mean over the vocabulary of -log p, averaged over real tokens
    logp = logits.log_softmax(-1)
    keep = labels != -100
    nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    uniform = -logp.mean(-1)
    want = ((1 - eps) * nll + eps * uniform)[keep].mean().item()
    assert got == pytest.approx(want, rel=1e-5)
    assert got != pytest.approx(plain.model(**inputs).loss.item(), rel=1e-3)


def test_bad_schedule_and_smoothing_are_refused():
    with pytest.raises(ValueError, match="allowed linear, cosine, inverse_sqrt"):
        T5FineTuner("t5_tiny", lr_schedule="step")
    with pytest.raises(ValueError, match="0 <= value < 1"):
        T5FineTuner("t5_tiny", label_smoothing=1.0)
