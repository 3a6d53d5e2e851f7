"""Activation checkpointing and activation offload (engine/memory/activations.py) against the same run without them.

Checkpointing recomputes a forward in backward and offload moves saved tensors to host memory and back:
neither may change a single number. Two gloo ranks, fp32, AdamW: losses and final weights of HF T5 and
GPT-2 (tiny, from configs) at stages 0-3 and the offload presets equal the run without the option at
rtol 1e-6; at stage 3 the recorded unit order and the peak of gathered bytes are unchanged too (the
recompute neither re-records the order nor gathers more), also for a region holding several units
(T5Stack). Saved-activation bytes are measured with a saved-tensors hook and compared with the estimator.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.memory.activations import SavedBytes, checkpoint_modules
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lightning_models import _params, trainer_kwargs
from tests.helpers.zoo_models import ZOO

STEPS = 2
# (name, engine config without the activation options, activation options)
CASES = [
    *[(f"zero{s}", dict(stage=s), dict(activation_checkpointing="auto")) for s in (0, 1, 2, 3)],
    ("zero3 offload only", dict(stage=3), dict(offload_activations=True)),
    ("zero3_offload", dict(stage=3, offload_optimizer=True, offload_params=True),
     dict(activation_checkpointing="auto", offload_activations=True)),
]
T5_ONLY = [  # one checkpointed region holding every block of a stack: its recompute re-runs several units
    ("zero3 T5Stack", dict(stage=3), dict(activation_checkpointing=["T5Stack"])),
    ("zero3_offload T5Stack", dict(stage=3, offload_optimizer=True, offload_params=True),
     dict(activation_checkpointing=["T5Stack"], offload_activations=True)),
]


def _t5_loss(model, ids):
    # HF drops the KV cache inside a checkpointed layer (a recompute would extend it twice); training needs none,
    # and without it the reference runs op for op what the checkpointed model runs
    return model(input_ids=ids, labels=ids.flip(1), use_cache=False).loss


def _train(rank, model_name, cfg):
    builder, make_batch, loss_fn = ZOO[model_name]
    loss_fn = _t5_loss if model_name == "t5" else loss_fn
    torch.manual_seed(0)
    model = builder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=cfg.offload_optimizer or None)
    engine = ZeroEngine(model, opt, cfg)
    losses, saved, offloaded = [], [], []
    for step in range(STEPS):
        before = engine.activations.offloaded_bytes if engine.activations is not None else 0
        engine.prepare_forward()
        counter = SavedBytes(model.parameters())
        with counter.hooks():
            loss = loss_fn(model, make_batch(step, rank))
        loss.backward()
        losses.append(loss.item())
        saved.append(counter.bytes)
        offloaded.append((engine.activations.offloaded_bytes if engine.activations is not None else 0) - before)
        engine.step()
    out = {"losses": losses, "saved": saved, "offloaded": offloaded}
    if engine.partitioner is not None:
        out["order"] = list(engine.partitioner._order)
        out["peak_gathered"] = engine.partitioner.peak_gathered_bytes
    if engine.activations is not None:
        out["regions"] = len(engine.activations.checkpointed)
    engine.restore_fp32_module()
    engine.remove()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _all_cases(rank, world_size, cases):
    results = {}
    for model_name, label, base, options in cases:
        try:
            results[(model_name, label)] = (_train(rank, model_name, ZeroConfig(**base)),
                                            _train(rank, model_name, ZeroConfig(**base, **options)))
        except Exception:  # noqa: BLE001 -- reported by the test, with the case
            results[(model_name, label)] = traceback.format_exc()
    return results


@pytest.mark.timeout(240)
def test_checkpointing_and_offload_equal_the_run_without_them():
    cases = ([("t5", *c) for c in CASES + T5_ONLY]
             + [("gpt2", *c) for c in CASES if c[0] in ("zero3", "zero3_offload")])
    results = run_distributed(_all_cases, 2, cases)
    for rank_results in results:
        for (model_name, label, _base, options) in cases:
            res = rank_results[(model_name, label)]
            assert not isinstance(res, str), f"{model_name} {label}:\n{res}"
            plain, opt = res
            where = f"{model_name} {label}"
            torch.testing.assert_close(torch.tensor(opt["losses"]), torch.tensor(plain["losses"]), rtol=1e-6,
                                       atol=0, msg=where)
            for k, v in plain["state"].items():
                torch.testing.assert_close(opt["state"][k], v, rtol=1e-6, atol=1e-7, msg=f"{where}: {k}")
            if options.get("activation_checkpointing"):
                assert opt["regions"] >= 1
                # only the regions' inputs are saved (on the device, or offloaded)
                assert (opt["saved"][0] or opt["offloaded"][0]) < plain["saved"][0] / 2, where
            if options.get("offload_activations"):
                assert min(opt["offloaded"]) > 0 and opt["saved"] == [0] * STEPS, where  # nothing left on the device
            if "order" in plain:  # the recompute is not part of the recorded order and gathers nothing more
                assert opt["order"] == plain["order"], where
                assert opt["peak_gathered"] <= plain["peak_gathered"], where


def test_bad_values_get_one_clear_error():
    model = ZOO["t5"][0]()
    with pytest.raises(ValueError, match=r"'T5Blok' matches no module of T5ForConditionalGeneration.*'auto' "
                                         r"\(here \['T5Block'\]\).*T5LayerFF"):
        checkpoint_modules(model, ["T5Blok"])
    with pytest.raises(ValueError, match="matches no module"):
        ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   ZeroConfig(stage=0, activation_checkpointing=[torch.nn.Conv2d]))
    for bad in (True, 3, [], ["T5Block", 3], [int]):
        with pytest.raises(ValueError, match="activation_checkpointing must be None, 'auto' or a non-empty list"):
            ZeroConfig(activation_checkpointing=bad)
    with pytest.raises(ValueError, match="offload_activations must be True or False"):
        ZeroConfig(offload_activations="yes")
    assert ZeroConfig(activation_checkpointing="T5Block").activation_checkpointing == ["T5Block"]


class T5Module(LightningModule):
    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.model = ZOO["t5"][0]()
        self.out, self.tag = out, tag
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # forked ranks (see tests/helpers/lightning_models.py)

    def training_step(self, batch, batch_idx):
        loss = _t5_loss(self.model, batch[0])
        self.losses.append(loss.item())
        act = self.trainer.strategy.engine.activations
        self.applied = (len(act.checkpointed), act.offloaded_bytes) if act is not None else (0, 0)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        torch.save({"losses": self.losses, "state": _params(self), "applied": self.applied}, os.path.join(self.out, f"{self.tag}{self.global_rank}.pt"))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 100, (16, 8), generator=g)), batch_size=2)


@pytest.mark.timeout(120)
def test_strategy_kwargs_under_a_trainer(tmp_path):
    for tag, kw in (("plain", {}), ("ckpt", dict(activation_checkpointing=["T5Block"], offload_activations=True))):
        torch.manual_seed(0)
        strategy = ZeroStrategy(stage=3, start_method="fork", **kw)
        Trainer(**trainer_kwargs(max_steps=3), strategy=strategy).fit(T5Module(str(tmp_path), tag))
    for rank in range(2):
        plain, ckpt = (torch.load(tmp_path / f"{t}{rank}.pt") for t in ("plain", "ckpt"))
        torch.testing.assert_close(torch.tensor(ckpt["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0)
        assert plain["applied"] == (0, 0) and ckpt["applied"][0] == 4 and ckpt["applied"][1] > 0  # 4 T5Blocks
        for k, v in plain["state"].items():
            torch.testing.assert_close(ckpt["state"][k], v, rtol=1e-6, atol=1e-7, msg=k)


def test_hydra_keys_reach_the_strategy():
    import sys
    from pathlib import Path

    from lightning_zero.tools.tuning.tune import compose

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "examples"))  # examples/ is not a package
    from t5_config import ConfigError, build_strategy

    cfg = compose(root / "conf", "t5_finetune", ["strategy=zero3_offload", "strategy.activation_checkpointing=[T5Block]",
                                                 "strategy.offload_activations=true"])
    zc = build_strategy(cfg).zero_config
    assert (zc.activation_checkpointing, zc.offload_activations, zc.offload_params) == (["T5Block"], True, True)
    assert build_strategy(compose(root / "conf", "t5_finetune", ["strategy.activation_checkpointing=auto"])
                          ).zero_config.activation_checkpointing == "auto"
    with pytest.raises(ConfigError, match="activation_checkpointing must be None, 'auto'"):
        build_strategy(compose(root / "conf", "t5_finetune", ["strategy.activation_checkpointing=5"]))


@pytest.mark.timeout(180)
def test_tune_searches_the_activation_options(tmp_path):
    from lightning_zero.tools.estimate import MiB, info_from_t5, model_state_bytes, t5_dims
    from lightning_zero.tools.tuning import tune

    from lightning_zero.tools.t5_dims import RECIPE_VOCAB

    # the vocabulary tune measures with (the recipe's BPE)
    info = info_from_t5(t5_dims("t5_tiny", vocab_size=RECIPE_VOCAB))
    states = model_state_bytes(info, 2, False, 2, False, 8, False)["device"]
    out = tmp_path / "tuned.overrides"
    res = tune(["model=t5_tiny", "data.max_source_len=16", "data.max_target_len=8", "trainer.devices=2"],
               memory_mb=(states + 0.7 * MiB) / MiB, out=str(out), stages="2", offload="no", activations="search",
               steps=1, warmup=0, max_batch=4)
    batch = {c.setting: c.max_batch for c in res.candidates}
    assert set(batch) == {"zero2", "zero2+ckpt", "zero2+ckpt+offload"}
    assert 0 < batch["zero2"] < 4 and batch["zero2+ckpt"] == 4, res.report()  # checkpointing fits more
    # the winner is the fastest measured candidate (timing: either may win); its overrides name its options
    lines = out.read_text().split()
    assert "strategy=zero2" in lines
    assert ("strategy.activation_checkpointing=auto" in lines) == ("+ckpt" in res.best.setting)
    assert ("strategy.offload_activations=true" in lines) == ("+offload" in res.best.setting), lines


@pytest.mark.parametrize("preset,batch,src,tgt,dropout", [("t5_tiny", 3, 24, 16, 0.1)])
def test_activation_bytes_match_the_estimator(preset, batch, src, tgt, dropout):
    """Saved bytes per micro-batch, measured with a saved-tensors hook, against tools/t5_dims.py (fp32)."""
    from transformers import T5Config, T5ForConditionalGeneration

    from lightning_zero.engine.memory.activations import ActivationMemory, measure_recompute
    from lightning_zero.engine.placement.location import Location
    from lightning_zero.tools.t5_dims import t5_activation_memory, t5_dims

    d = t5_dims(preset, dropout_rate=dropout)
    cfg = T5Config(vocab_size=d.vocab_size, d_model=d.d_model, d_ff=d.d_ff, num_layers=d.num_layers,
                   num_heads=d.num_heads, d_kv=d.d_kv, dropout_rate=dropout, feed_forward_proj="relu",
                   decoder_start_token_id=0, pad_token_id=0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(2, d.vocab_size, (batch, src), generator=g), torch.randint(2, d.vocab_size, (batch, tgt), generator=g)
    for ckpt, offload in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(cfg).train()
        act = ActivationMemory(model, checkpoint_modules(model, "auto" if ckpt else None), Location.of_knob(offload))
        counter = SavedBytes(model.parameters())
        with counter.hooks():
            loss = model(input_ids=x, labels=y, use_cache=False).loss
        with measure_recompute() as recompute:
            loss.backward()
        est = t5_activation_memory(d, batch, src, tgt, False, ckpt, offload)
        measured_device = counter.bytes + recompute.peak
        where = f"{preset} ckpt={ckpt} offload={offload}: measured {measured_device}, estimated {est['device']}"
        assert measured_device == pytest.approx(est["device"], rel=0.03), where
        if ckpt:
            assert recompute.peak == pytest.approx(est["recompute"], rel=0.01), where
            assert recompute.count == d.num_layers + d.dec_layers
        if offload:
            assert counter.bytes == 0 and act.offloaded_bytes >= est["host"] * 0.97, where


def _gpt2_cache_under_checkpointing(rank, world_size):
    model = ZOO["gpt2"][0]()
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        ZeroConfig(stage=3, activation_checkpointing="auto"))
    engine.prepare_forward()
    ids = torch.randint(0, 100, (2, 8))
    out = model(input_ids=ids, labels=ids)  # the config's use_cache=True, as a user's training step leaves it
    cached = lambda: 0 if out.cache is None else out.cache.get_seq_length()  # noqa: E731
    lengths = [cached()]
    out.loss.backward()
    lengths.append(cached())
    flags = [model.transformer.gradient_checkpointing]
    engine.step()
    engine.remove()
    return lengths, flags + [model.transformer.gradient_checkpointing]


@pytest.mark.timeout(120)
def test_checkpointed_gpt2_blocks_keep_no_kv_cache():
    """GPT2Model passes its KV cache to the blocks positionally unless its own ``gradient_checkpointing`` is set
    (HF's ``gradient_checkpointing_enable`` sets it): the engine sets it too while it checkpoints the blocks, so
    no K / V of the whole sequence is kept through backward, nor extended again by the recompute."""
    (lengths, flags), = run_distributed(_gpt2_cache_under_checkpointing, 1)
    assert lengths == [0, 0] and flags == [True, False]
