"""Trainable-only checkpoints under Fabric ([Note: trainable-only checkpoints]): a LoRA (peft) GPT-2 at stage 2
on 2 forked gloo ranks; ``fabric.save`` at step 2 writes the adapter and a reference to the base, a fresh
model built from the base (its LoRA drawn with another seed) ``fabric.load``s it and trains on to equal the
uninterrupted run bit for bit; the engine-level save / load the same at stages 0, 1 and 3 with both offloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric

from lightning_zero import ZeroFabricStrategy
from lightning_zero.checkpoint.format import load_checkpoint_dir, save_engine_checkpoint
from lightning_zero.checkpoint.names import INFO_FILE
from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lora_models import lora_gpt2, tokens, write_base


def _steps(fabric, model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = tokens(step, fabric.global_rank)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _setup(fabric, base: str, seed: int):
    model = lora_gpt2(base, seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return fabric.setup(model, opt)


def _fabric_job(rank: int, world: int, root: str, base: str) -> dict:
    torch.set_num_threads(1)
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2, checkpoint_trainable_only=True, checkpoint_base=base),
                    accelerator="cpu", devices=world)
    fabric.launch()
    model, opt = _setup(fabric, base, seed=1)
    losses = _steps(fabric, model, opt, range(2))
    fabric.save(Path(root) / "ckpt", {"model": model, "optimizer": opt, "step": 2})
    losses += _steps(fabric, model, opt, range(2, 4))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model2, opt2 = _setup(fabric, base, seed=7)  # other LoRA matrices: the load must replace them
    rest = fabric.load(Path(root) / "ckpt", {"model": model2, "optimizer": opt2})
    resumed = _steps(fabric, model2, opt2, range(rest["step"], 4))
    same = all(torch.equal(v, weights[k]) for k, v in model2.state_dict().items())
    return {"losses": losses, "resumed": resumed, "same_weights": same}


@pytest.mark.timeout(300)
def test_fabric_stage2_resume_is_bit_exact(tmp_path):
    base = write_base(tmp_path / "base")
    for r in run_distributed(_fabric_job, 2, str(tmp_path), str(base)):
        assert r["resumed"] == r["losses"][2:] and r["same_weights"], r
    info = json.loads((tmp_path / "ckpt" / INFO_FILE).read_text())
    assert info["stage"] == 2 and info["trainable_only"]["base"]["source"] == str(base)
    assert all("lora_" in n for n in info["tensors"])


def _engine_job(rank: int, world: int, root: str, base: str, knobs: dict) -> dict:
    torch.set_num_threads(1)

    def build(seed):
        model = lora_gpt2(base, seed)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, ZeroEngine(model, opt, ZeroConfig(**knobs))

    def steps(model, engine, r):
        out = []
        for step in r:
            ids = tokens(step, rank)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.step()
            out.append(loss.item())
        return out

    model, engine = build(1)
    losses = steps(model, engine, range(2))
    save_engine_checkpoint(Path(root) / "eng", model, engine, trainable_only_base=base)
    losses += steps(model, engine, range(2, 4))
    model2, engine2 = build(7)
    load_checkpoint_dir(Path(root) / "eng", model2, engine2)
    return {"losses": losses, "resumed": steps(model2, engine2, range(2, 4))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("knobs", [dict(stage=0), dict(stage=1),
                                   dict(stage=3, offload_optimizer=True, offload_params=True)], ids=str)
def test_engine_level_save_and_load(tmp_path, knobs):
    base = write_base(tmp_path / "base")
    for r in run_distributed(_engine_job, 2, str(tmp_path), str(base), knobs):
        assert r["resumed"] == r["losses"][2:], r
    info = json.loads((tmp_path / "eng" / INFO_FILE).read_text())
    assert info["stage"] == knobs["stage"] and all("lora_" in n for n in info["tensors"])
