"""Model zoo under the plain zero3 / zero3_offload presets at default settings (no unit_classes) against torch DDP.

HF GPT-2, BERT, T5, Llama, Mixtral (fused experts in transformers 5.x), a hand-written MoE with one module per
expert, ResNet with BatchNorm, torch nn.Transformer, blocks calling a shared module / sharing a Parameter, and a
model the size rule partitions; plus the widths/unit sizes where the old size rule picked a container (GPT-2's
transformer.h, BERT's encoder.layer, ResNet's encoder.stages). 2 gloo ranks, AdamW, fp32: losses and final
weights at rtol 1e-5. All cases run in one distributed job (one fork and process group for all of them).
"""

from __future__ import annotations

import functools
import traceback
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero.engine import ZeroConfig, ZeroEngine, model_state_floor
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lightning_models import TokenDataset, _params, trainer_kwargs
from tests.helpers.parity import close as _close
from tests.helpers.zoo_models import ZOO, zoo_adamw, zoo_ddp_reference

STEPS = 3
PRESETS = ("zero3", "zero3_offload")
# unit sizes at which the old size rule chose a ModuleList (never gathered): its children are units now
SIZED = {"gpt2": 0.05, "bert": 0.04, "resnet": 0.002}
CASES = [(m, p) for m in ZOO for p in PRESETS] + [(m, f"unit_mb={mb}") for m, mb in SIZED.items()]


def _config(preset: str) -> ZeroConfig:
    if preset.startswith("unit_mb="):
        return ZeroConfig(stage=3, unit_mb=float(preset.split("=")[1]))
    return StrategyRegistry.get(f"{preset}_fork").zero_config  # exactly what Trainer(strategy=...) builds


def _train(rank, name, cfg):
    builder, make_batch, loss_fn = ZOO[name]
    torch.manual_seed(0)
    model = builder()
    opt = zoo_adamw(model)
    engine = ZeroEngine(model, opt, cfg)
    losses, report = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            engine.prepare_forward()  # rank 0's buffers (BatchNorm), as DDP broadcasts them; what the strategy calls
            loss = loss_fn(model, make_batch(step, rank))
            loss.backward()
            losses.append(loss.item())
            if step == STEPS - 1:  # after a backward, with optimizer state: every model state is there
                report = engine.memory_report()
            engine.step()
    out = {"losses": losses, "on_demand": [str(w.message) for w in caught if "on demand" in str(w.message)]}
    units = engine.partitioner.units
    out["units"] = units.describe()
    out["n_units"] = len(units) - 1
    out["report"] = report.as_dict()
    numel = sum(p.numel() for p in model.parameters())
    out["floor"] = model_state_floor(3, numel, 2, False, 8, cfg.offload_optimizer)
    engine.restore_fp32_module()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _zoo(rank, world_size, cases):
    res = {}
    for name in dict.fromkeys(m for m, _ in cases):
        res[(name, "ddp")] = zoo_ddp_reference(rank, name, STEPS)
        if (name, "zero3_offload") in cases:
            res[(name, "ddp_fused")] = zoo_ddp_reference(rank, name, STEPS, fused=True)
    for name, preset in cases:
        try:
            res[(name, preset)] = _train(rank, name, _config(preset))
        except Exception:  # one model's failure must not hide the others'
            res[(name, preset)] = traceback.format_exc()
    return res


@functools.lru_cache(maxsize=None)
def results():
    return run_distributed(_zoo, 2, CASES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,preset", CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_zoo_matches_ddp(name, preset):
    for rank, res in enumerate(results()):
        got, ref = res[(name, preset)], res[(name, "ddp_fused" if preset == "zero3_offload" else "ddp")]
        assert not isinstance(got, str), f"rank {rank}:\n{got}"
        assert got["n_units"] >= 2, got["units"]  # stage 3 really partitions, at default settings too
        assert not got["on_demand"], got["on_demand"]  # every parameter gathered by its own unit's hooks
        _close(got["losses"], ref["losses"], f"rank {rank} losses")
        assert ref["state"].keys() == got["state"].keys()
        for k in ref["state"]:
            _close(got["state"][k], ref["state"][k], f"rank {rank} {k}")
        # bytes per rank against the 16 Psi / N floor (device and host together): shards, padding, and nothing
        # held whole after backward
        rep, floor = got["report"], got["floor"]
        assert rep["model_states"] <= 1.05 * (floor["device"] + floor["host"]) + 4096, (rep, floor)
        if rank == 0:
            print(f"{name:15s} {preset:14s} {got['units']} | model states {rep['model_states']} B/rank "
                  f"(host {rep['host']}) vs floor {floor['device'] + floor['host']:.0f}")


# -- through the Trainer: the registered preset name on an HF model held by a LightningModule ---------------
class _HFModule(pl.LightningModule):
    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ZOO["gpt2"][0]()  # an attribute: the policy finds its _no_split_modules on the submodule
        self.out, self.tag, self.losses, self.units = out, tag, [], None

    def setup(self, stage):
        torch.set_num_threads(1)  # forked ranks (see tests/helpers/lightning_models.py)

    def train_dataloader(self):
        return DataLoader(TokenDataset(length=32, seq=8), batch_size=2)

    def training_step(self, batch, batch_idx):
        ids, _ = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def on_train_start(self):
        engine = getattr(self.trainer.strategy, "engine", None)
        self.units = engine.partitioner.units.describe() if engine is not None else None

    def on_train_end(self):
        torch.save({"losses": self.losses, "params": _params(self), "units": self.units},
                   f"{self.out}/{self.tag}rank{self.global_rank}.pt")


@pytest.mark.timeout(300)
def test_trainer_zero3_preset_on_hf_gpt2_matches_ddp(tmp_path):
    runs = {}
    for strategy in ("ddp_fork", "zero3_fork"):
        pl.Trainer(strategy=strategy, **trainer_kwargs(max_steps=3)).fit(_HFModule(str(tmp_path), strategy))
        runs[strategy] = [torch.load(tmp_path / f"{strategy}rank{r}.pt", weights_only=False) for r in range(2)]
    for ref, got in zip(runs["ddp_fork"], runs["zero3_fork"]):
        assert "declared _no_split_modules ['GPT2Block']" in got["units"] and got["units"].startswith("ZeRO-3 units: 2")
        _close(got["losses"], ref["losses"], "losses")
        for k in ref["params"]:
            _close(got["params"][k], ref["params"][k], k)
