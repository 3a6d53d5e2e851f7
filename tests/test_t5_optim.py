"""The T5 recipe's optimisation levers (examples/t5_module.py, examples/t5_optim.py): the learning-rate schedules
after warmup and the label-smoothed training loss, each checked against a formula written out here; the optimizer
choice (``optim.name``: AdamW, 1-bit Adam, 0/1 Adam), its config errors, and 1-bit Adam's warmup equal to AdamW
in a 2-rank recipe fit."""
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

from tests.helpers.hydra_recipe import compose_recipe, pairs_file  # noqa: E402,F401  (fixture)
from t5_config import ConfigError, build_strategy  # noqa: E402
from t5_module import LR_SCHEDULES, T5FineTuner  # noqa: E402
from t5_optim import MANUAL, OPTIMIZERS, check_optimizer  # noqa: E402

from lightning_zero.optim import OneBitAdam, ZeroOneAdam  # noqa: E402

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


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n not in MANUAL])  # muon: two optimizers, below
def test_optimizer_choice_keeps_the_decay_groups_and_the_schedule(name):
    model = T5FineTuner("t5_tiny", lr=PEAK, weight_decay=0.05, warmup_steps=WARMUP, total_steps=TOTAL,
                        optimizer=name)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert type(opt) is {"adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor, "onebit_adam": OneBitAdam,
                         "zeroone_adam": ZeroOneAdam}[name]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert sched.optimizer is opt and opt.param_groups[0]["lr"] == pytest.approx(PEAK / (WARMUP + 1))
    if name == "onebit_adam":
        assert opt.freeze_step == round(0.2 * TOTAL)  # null: 20% of the run
    if name == "zeroone_adam":
        assert (opt.var_freeze_step, opt.var_update_scaler, opt.local_step_scaler) == (round(0.2 * TOTAL), 16, 32678)
    explicit = T5FineTuner("t5_tiny", total_steps=TOTAL, optimizer=name, freeze_step=7, var_update_scaler=3,
                           local_step_scaler=5, local_step_clipper=2).configure_optimizers()["optimizer"]
    if name == "onebit_adam":
        assert explicit.freeze_step == 7
    if name == "zeroone_adam":
        assert explicit.var_freeze_step == 7
        assert (explicit.var_update_scaler, explicit.local_step_scaler, explicit.local_step_clipper) == (3, 5, 2)


def _refused(*overrides):
    cfg = compose_recipe(*overrides)
    with pytest.raises(ConfigError) as e:
        check_optimizer(cfg, build_strategy(cfg))
    return str(e.value)


def test_bad_optimizer_config_is_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match="allowed adamw, muon, adafactor, onebit_adam, zeroone_adam"):
        T5FineTuner("t5_tiny", optimizer="lamb")
    assert "Allowed: adamw, muon, adafactor, onebit_adam, zeroone_adam" in _refused("optim.name=lamb")
    assert "freeze_step 0: allowed an int >= 1" in _refused("optim.name=onebit_adam", "strategy=zero0",
                                                           "optim.freeze_step=0")
    assert "local_step_clipper 0: allowed an int >= 1" in _refused("optim.name=zeroone_adam", "strategy=zero0",
                                                                  "optim.local_step_clipper=0")
    # the engine's refusal, before any process starts: what composes is named
    allowed = 'strategy="zero1" (optimizer state sharded) for OneBitAdam'
    msg = _refused("optim.name=zeroone_adam", "strategy=zero1")
    assert "optim.name=zeroone_adam with strategy=zero1 (stage 1)" in msg and "one owner" in msg and allowed in msg
    msg = _refused("optim.name=onebit_adam")  # the recipe's default strategy, zero2
    assert "stage 2 shards the gradients" in msg and allowed in msg
    assert "offload" in _refused("optim.name=onebit_adam", "strategy=zero1_offload")
    assert "fp16 loss scaling" in _refused("optim.name=onebit_adam", "strategy=zero0", "trainer.precision=16-mixed")
    for ok in (("optim.name=adamw",), ("optim.name=onebit_adam", "strategy=zero0"),
               ("optim.name=onebit_adam", "strategy=zero1"), ("optim.name=zeroone_adam", "strategy=zero0")):
        cfg = compose_recipe(*ok)
        check_optimizer(cfg, build_strategy(cfg))
    from t5_finetune import train

    with pytest.raises(ConfigError, match="one owner"):  # the app checks before it loads data or forks
        train(compose_recipe("optim.name=zeroone_adam", "strategy=zero1"))


def _fit(tmp_path, pairs_file, name, *overrides):
    from t5_finetune import train

    out = tmp_path / name
    summary = train(compose_recipe(
        "model=t5_tiny", "trainer=cpu", "trainer.devices=2", "data=jsonl", f"data.path={pairs_file}",
        "data.source_field=code", "data.target_field=doc", "data.batch_size=4", "data.limit_train=32",
        "data.limit_val=8", "data.max_source_len=48", "data.max_target_len=16", "tokenizer.vocab_size=400",
        "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.enable_progress_bar=false",
        "model.num_gen_batches=0", "optim.warmup_steps=1", "output.tensorboard=false", f"output.dir={out}",
        *overrides))
    from transformers import T5ForConditionalGeneration

    return summary, T5ForConditionalGeneration.from_pretrained(summary["run_info"]["hf_model"]).state_dict()


@pytest.mark.timeout(300)
def test_onebit_adam_warmup_is_the_recipes_adamw(tmp_path, pairs_file, restore_threads):
    """freeze_step beyond the run: every step is the warmup's AdamW on the all-reduced gradient (with the
    recipe's clipping, weight-decay groups and schedule), so the weights equal AdamW's bit for bit."""
    _, adamw = _fit(tmp_path, pairs_file, "adamw", "strategy=zero0", "optim.name=adamw")
    summary, onebit = _fit(tmp_path, pairs_file, "onebit", "strategy=zero0", "optim.name=onebit_adam",
                           "optim.freeze_step=100")
    assert adamw.keys() == onebit.keys()
    assert all(torch.equal(adamw[k], onebit[k]) for k in adamw), \
        max((adamw[k] - onebit[k]).abs().max().item() for k in adamw)
    phases = summary["run_info"]["ranks"][0]["comm"]["phases"]
    assert list(phases) == ["warmup"] and phases["warmup"][:2] == [3, 3]  # 3 steps, one all-reduce each


@pytest.mark.timeout(300)
def test_recipe_reports_the_compressed_phase_bytes(tmp_path, pairs_file, restore_threads, capsys):
    """1-bit Adam at stage 1 in the recipe: one warmup step, then the compressed phase; the summary prints the
    bytes per step of each phase (rank 0's comm_report). A compressed step moves about half the warmup's
    bytes (the first one more: it rebuilds the whole momentum, engine/optim/onebit/sharded.py)."""
    summary, _ = _fit(tmp_path, pairs_file, "zero1", "strategy=zero1", "optim.name=onebit_adam",
                      "optim.freeze_step=1")
    phases = summary["run_info"]["ranks"][0]["comm"]["phases"]
    assert set(phases) == {"warmup", "compressed"} and phases["warmup"][0] == 1 and phases["compressed"][0] == 2
    last = summary["run_info"]["ranks"][0]["comm"]["last_step_wire_bytes"]  # a compressed step
    assert 0.4 * phases["warmup"][3] < last < 0.6 * phases["warmup"][3]
    assert "comm (rank 0): warmup 1 steps " in capsys.readouterr().out


def test_muon_is_muon_on_the_hidden_matrices_and_adamw_on_the_rest():
    from lightning_zero import muon_split

    model = T5FineTuner("t5_tiny", lr=PEAK, weight_decay=0.05, warmup_steps=WARMUP, total_steps=TOTAL,
                        optimizer="muon")
    assert not model.automatic_optimization  # two optimizers: the module steps them (manual optimization)
    (muon, adamw), scheds = model.configure_optimizers()
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    hidden, rest = muon_split(model.model)
    assert [p for g in muon.param_groups for p in g["params"]] == hidden and len(hidden) > 0
    assert {id(p) for g in adamw.param_groups for p in g["params"]} == {id(p) for p in rest}
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert [g["weight_decay"] for g in muon.param_groups] == [0.05]  # the hidden matrices: all decayed
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.05, 0.0]  # embeddings / head; norms
    assert [s["scheduler"].optimizer for s in scheds] == [muon, adamw]
    assert all(o.param_groups[0]["lr"] == pytest.approx(PEAK / (WARMUP + 1)) for o in (muon, adamw))
    untied = T5FineTuner("t5_tiny", optimizer="muon", total_steps=TOTAL, tie_word_embeddings=False)  # T5 v1.1
    u_muon, u_adamw = untied.configure_optimizers()[0]
    assert any(p is untied.model.lm_head.weight for g in u_adamw.param_groups for p in g["params"])
    assert not any(p is untied.model.lm_head.weight for g in u_muon.param_groups for p in g["params"])


def test_whole_tensor_choices_are_refused_where_they_cannot_run():
    for name in ("muon", "adafactor"):  # the engine's own refusal, before any process starts
        msg = _refused(f"optim.name={name}", "strategy=zero2_offload_nvme", "strategy.nvme_path=/tmp")
        assert "with its state on the device or offloaded to host memory" in msg, msg
    for ok in (("optim.name=adafactor", "trainer.accumulate_grad_batches=2"), ("optim.name=muon", "strategy=zero3"),
               ("optim.name=muon", "trainer.accumulate_grad_batches=2"),
               ("optim.name=muon", "strategy=zero3_offload"), ("optim.name=adafactor", "strategy=zero1_offload")):
        cfg = compose_recipe(*ok)
        check_optimizer(cfg, build_strategy(cfg))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,strategy,accumulate", [("muon", "zero2", 2), ("adafactor", "zero1", 1),
                                                     ("muon", "zero3_offload", 1)])
def test_whole_tensor_choices_train_at_zero_stages(tmp_path, pairs_file, restore_threads, name, strategy, accumulate):
    """Each choice trains a 2-rank recipe fit at a sharded stage (the owner-rank step): the val loss falls
    from the untrained model's, and ``trainer.max_steps`` counts optimizer steps as with AdamW (Muon's manual
    optimization accumulates itself: one step per ``accumulate`` batches, DeepSpeed #8600's bug)."""
    summary, weights = _fit(tmp_path, pairs_file, name, f"strategy={strategy}", f"optim.name={name}",
                            "trainer.max_steps=6", f"trainer.val_check_interval={6 * accumulate}",
                            "trainer.validate_before_fit=true", f"trainer.accumulate_grad_batches={accumulate}")
    assert summary["run_info"]["global_step"] == 6
    assert summary["run_info"]["batches"] == 6 * accumulate
    assert summary["last_val"]["val_loss"] < summary["baseline_val"]["val_loss"] - 0.5, summary["last_val"]
    # the optimizer that ran is the one named: its state's bytes over both ranks are those of the same
    # optimizers stepped once on the whole model here (Muon's momentum vs Adam's two moments, Adafactor's factors)
    from transformers import T5ForConditionalGeneration
    from t5_optim import make_muon_adamw

    model = T5ForConditionalGeneration.from_pretrained(summary["run_info"]["hf_model"])
    opts = (make_muon_adamw(model, [{"params": list(model.parameters())}], 1e-3) if name == "muon"
            else [torch.optim.Adafactor(model.parameters())])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    for o in opts:
        o.step()
    want = sum(t.numel() * t.element_size() for o in opts for st in o.state.values() for t in st.values()
               if torch.is_tensor(t) and t.ndim > 0)
    ranks = summary["run_info"]["ranks"]
    assert sum(r["optimizer_state"] for r in ranks) == want  # offloaded: host bytes
    # `lightning-zero estimate --optimizer NAME` books each rank's share of the owner-rank step as measured
    from lightning_zero import estimate_model_states

    est = estimate_model_states(model, world_size=2, optimizer=name, settings=[strategy])
    assert est.whole_tensor.per_rank(2) == [r["optimizer_state"] for r in ranks]
    assert est.rows[0].states["optimizer_state"] == pytest.approx(max(r["optimizer_state"] for r in ranks))
