"""Trainable-only checkpoints ([Note: trainable-only checkpoints]) under the Trainer: a LoRA (peft) GPT-2 at
stage 3 on 2 forked gloo ranks saves its adapter (+ optimizer state, loops) and a reference to the base;
resuming equals the uninterrupted run bit for bit; the directory is a fraction of the full one; it
consolidates, loads with ``load_from_checkpoint`` and exports as the adapter alone or merged. The refusals
(base changed, base missing) are in test_trainable_only_errors.py, Fabric in test_trainable_only_fabric.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.names import INFO_FILE
from lightning_zero.tools.cli import main as cli
from tests.helpers.lightning_models import trainer_kwargs
from tests.helpers.lora_models import LoraModule, dir_bytes, lora_gpt2, peft, transformers, write_base


def _fit(root: Path, base: Path, tag: str, max_steps: int, every: int = 0, ckpt_path=None, **knobs) -> None:
    callbacks = [ModelCheckpoint(dirpath=root, filename=tag + "-{step}", every_n_train_steps=every,
                                 save_top_k=-1)] if every else []
    trainer = Trainer(strategy=ZeroStrategy(stage=3, start_method="fork", **knobs), callbacks=callbacks,
                      **trainer_kwargs(devices=2, max_steps=max_steps, enable_checkpointing=bool(every),
                                       default_root_dir=str(root)))
    trainer.fit(LoraModule(str(base), str(root), tag), ckpt_path=ckpt_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """full: 4 steps uninterrupted, a full checkpoint at step 2; lora: 2 steps, a trainable-only one;
    resumed: from it to step 4."""
    root = tmp_path_factory.mktemp("trainable_only")
    base = write_base(root / "base")
    _fit(root, base, "full", 4, every=2)
    _fit(root, base, "lora", 2, every=2, checkpoint_trainable_only=True, checkpoint_base=str(base))
    _fit(root, base, "resumed", 4, ckpt_path=str(root / "lora-step=2.ckpt"), checkpoint_trainable_only=True,
         checkpoint_base=str(base))
    return root, base


@pytest.mark.timeout(600)
def test_resume_equals_the_uninterrupted_run_bit_for_bit(runs):
    root, _ = runs
    for rank in range(2):
        full = torch.load(root / f"fulllosses_rank{rank}.pt")
        resumed = torch.load(root / f"resumedlosses_rank{rank}.pt")
        assert len(full) == 4 and resumed == full[2:], (rank, full, resumed)
    full, resumed = torch.load(root / "fullweights.pt"), torch.load(root / "resumedweights.pt")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    # the LoRA weights moved: B starts at zero
    assert any(full[k].abs().sum() > 0 for k in full if "lora_B" in k)


def test_checkpoint_holds_the_trained_part_and_a_reference(runs):
    root, base = runs
    lora, full = root / "lora-step=2.ckpt", root / "full-step=2.ckpt"
    info = json.loads((lora / INFO_FILE).read_text())
    entry = info["trainable_only"]
    assert info["version"] == 2 and entry["base"] == {"source": str(base), "kind": "pretrained"}
    assert entry["hash"].startswith("sha256:") and len(entry["hash"]) == 7 + 64
    stored = set(info["tensors"])
    assert stored and all("lora_" in n for n in stored if n.endswith("weight") and "ln_" not in n)
    assert not stored & set(entry["frozen"]) and "model.base_model.model.transformer.wte.weight" in entry["frozen"]
    assert set(info["optimizer_state"]) == set(entry["trainable"])  # every trained parameter, nothing frozen
    lora_bytes, full_bytes = dir_bytes(lora), dir_bytes(full)
    print(f"\ncheckpoint bytes at step 2: full {full_bytes}, trainable-only {lora_bytes} "
          f"({lora_bytes / full_bytes:.1%})")
    assert lora_bytes < full_bytes / 4


def test_load_from_checkpoint_and_consolidate_read_the_base(runs, tmp_path):
    root, base = runs
    lora, full = root / "lora-step=2.ckpt", root / "full-step=2.ckpt"
    want = LoraModule.load_from_checkpoint(str(full), base=str(base)).state_dict()
    got = LoraModule.load_from_checkpoint(str(lora), base=str(base)).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert cli(["consolidate", str(lora), str(tmp_path / "whole.safetensors"), "--quiet"]) == 0
    from safetensors.torch import load_file

    whole = load_file(str(tmp_path / "whole.safetensors"))
    assert whole.keys() == want.keys() and all(torch.equal(whole[k], want[k]) for k in want)


def test_export_adapter_alone_and_merged(runs, tmp_path):
    root, base = runs
    lora, full = root / "lora-step=2.ckpt", root / "full-step=2.ckpt"
    trained = LoraModule.load_from_checkpoint(str(full), base=str(base)).model  # a PeftModel
    # the adapter in peft's format: PeftModel.from_pretrained over the base gives the trained model
    assert cli(["export", str(lora), str(tmp_path / "adapter"), "--adapter", "--quiet"]) == 0
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    loaded = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(str(base)),
                                            str(tmp_path / "adapter"))
    want = trained.state_dict()
    assert loaded.state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    # merged: a plain GPT-2 save_pretrained directory holding W + B A scaling, as peft's merge_and_unload
    assert cli(["export", str(lora), str(tmp_path / "merged"), "--hf", "--quiet"]) == 0
    merged = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged")).state_dict()
    reference = lora_gpt2(str(base))
    reference.load_state_dict(want)
    reference = reference.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(merged[k], reference[k], rtol=1e-6, atol=1e-7, msg=k)
    assert any(not torch.equal(merged[k], v) for k, v in
               transformers.GPT2LMHeadModel.from_pretrained(str(base)).state_dict().items())
    # the same forms as files: the adapter under the module's names, merged under the plain model's
    assert cli(["consolidate", str(lora), str(tmp_path / "a.pt"), "--adapter", "--quiet"]) == 0
    assert set(torch.load(tmp_path / "a.pt")) == {"model." + k for k, v in trained.named_parameters() if v.requires_grad}
    assert cli(["consolidate", str(lora), str(tmp_path / "m.pt"), "--merged", "--quiet"]) == 0
    m = torch.load(tmp_path / "m.pt")
    assert all(torch.equal(m["model." + k], merged[k]) for k in merged if "model." + k in m)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["full-step=2.ckpt", "lora-step=2.ckpt"])
def test_base_may_be_an_earlier_checkpoint(runs, tmp_path, source):
    """The base recorded as a lightning_zero checkpoint directory: a full one, or a trainable-only one whose own
    base is then read first (a chain). Its frozen tensors are the pretrained base's, so the hash agrees."""
    root, base = runs
    trainer = Trainer(strategy=ZeroStrategy(stage=2, checkpoint_trainable_only=True, checkpoint_base=str(root / source)),
                      callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="c", every_n_train_steps=1)],
                      **trainer_kwargs(devices=1, max_steps=1, enable_checkpointing=True, default_root_dir=str(tmp_path)))
    module = LoraModule(str(base))
    trainer.fit(module)
    info = json.loads((tmp_path / "c.ckpt" / INFO_FILE).read_text())
    assert info["trainable_only"]["base"] == {"source": str(root / source), "kind": "lightning_zero"}
    want = module.state_dict()
    got = LoraModule.load_from_checkpoint(str(tmp_path / "c.ckpt"), base=str(base)).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
