"""Pretrained weights streamed into stage-3 shards (issue 27, item 3): a model built on the meta device loads a
``save_pretrained`` directory (safetensors single / sharded by index, ``pytorch_model.bin``) or a consolidated
state-dict file, each rank reading only the rows covering its own slices. At 2 and 4 ranks the gathered model
equals ``from_pretrained`` bit for bit, and the parameter bytes a rank held while loading (counted by the
loader) stay within its own shards plus the largest unit -- below the model's size."""

from __future__ import annotations

import contextlib
import sys
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroConfig, ZeroEngine, ZeroStrategy, load_pretrained
from lightning_zero.engine.stage3.pretrained_source import PretrainedSource
from tests.helpers.dist_utils import run_distributed
from tests.helpers.lightning_models import trainer_kwargs
from tests.helpers.zoo_models import SEQ, VOCAB, ZOO, ZooTokens

KINDS = ("single", "sharded", "bin", "file")
RTOL, ATOL = 1e-5, 1e-6


def _save(root, name: str, kind: str):
    """A checkpoint of a seeded model and what ``from_pretrained`` (a file: ``load_state_dict``) makes of it."""
    torch.manual_seed(0)
    model = ZOO[name][0]()
    path = root / f"{name}_{kind}"
    if kind == "single":
        model.save_pretrained(path)
        assert (path / "model.safetensors").is_file()
    elif kind == "sharded":  # several files and model.safetensors.index.json
        model.save_pretrained(path, max_shard_size="20KB")
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 3
    elif kind == "bin":  # every key, the tied aliases too, as older transformers wrote it
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:  # one consolidated state dict of a LightningModule holding the model as ``self.model`` (what
        # lightning-zero consolidate writes), not a directory
        path = root / f"{name}_consolidated.pt"
        torch.save({f"model.{k}": v for k, v in model.state_dict().items() if k != "lm_head.weight"}, path)
    if kind == "file":
        ref = type(model)(model.config)
        ref.load_state_dict({k[len("model."):]: v for k, v in torch.load(path).items()}, strict=False)
        ref.tie_weights()
    else:
        ref = type(model).from_pretrained(path)
    return str(path), model.config, {k: v.clone() for k, v in ref.state_dict().items()}


def _load_job(rank, world_size, cases):
    torch.set_num_threads(1)
    out = {}
    for key, (path, config, cls) in cases.items():
        with torch.device("meta"):
            model = cls(config)
        load_pretrained(model, path)
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=3))
        stats = engine.partitioner.load_stats
        units = engine.partitioner.units
        with engine.gathered_params():
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[key] = {"state": state, "peak": stats.peak_bytes, "shards": stats.shard_bytes,
                    "own": sum(u.shard.numel() * 4 for u in units if u.shard is not None),
                    "largest_unit": max(u.full_bytes for u in units),
                    "full": sum(p.numel() * 4 for p in model.parameters())}
        engine.remove(hand_back=False)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_streamed_load_equals_from_pretrained_within_the_byte_bound(tmp_path, world_size, monkeypatch):
    # blocks of 512 bytes (the widest row here, GPT-2's c_fc, is 512 B): every slice is read in several blocks
    monkeypatch.setattr(PretrainedSource, "READ_BLOCK_BYTES", 512)  # the forked ranks inherit it
    cases, refs = {}, {}
    for name in ("gpt2", "t5"):
        for kind in KINDS:
            path, config, ref = _save(tmp_path, name, kind)
            cases[name, kind] = (path, config, type(ZOO[name][0]()))
            refs[name, kind] = ref
    results = run_distributed(_load_job, world_size, cases)
    for (name, kind), ref in refs.items():
        for rank, res in enumerate(results):
            got = res[name, kind]
            assert got["state"].keys() == ref.keys()
            for k, v in ref.items():
                assert torch.equal(got["state"][k], v), (name, kind, rank, k)
            # the shards a rank keeps are exactly what it filled; in flight at most one tensor's rows
            assert got["shards"] == got["own"]
            assert got["peak"] <= got["largest_unit"] + got["own"], (name, kind, rank, got)
            assert got["peak"] <= got["own"] + 512  # one block of rows in flight
            assert got["peak"] < got["full"], (name, kind, rank, got)
            if kind == "sharded":
                print(f"{name} N={world_size} rank {rank}: peak {got['peak']} B while loading, own shards "
                      f"{got['own']} B, largest unit {got['largest_unit']} B, model {got['full']} B")


# -- the Trainer: configure_model on meta + load_weights_from / load_pretrained, against DDP + from_pretrained ---
Tokens = ZooTokens


class FineTune(pl.LightningModule):
    def __init__(self, name: str, path: str, out: str, tag: str, how: str) -> None:
        super().__init__()
        self.name, self.path, self.out, self.tag, self.how = name, path, out, tag, how
        cls = type(ZOO[name][0]())
        self.cls, self.config = cls, cls.config_class.from_pretrained(path)
        self.model = cls.from_pretrained(path) if how == "eager" else None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.cls(self.config)  # meta under ZeroStrategy(stage=3)
            self.built_on_meta = all(p.is_meta for p in self.model.parameters())
            if self.how == "load_pretrained":
                load_pretrained(self.model, self.path)

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def training_step(self, batch, batch_idx):
        loss = ZOO[self.name][2](self.model, batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def on_train_end(self) -> None:
        gathered = getattr(self.trainer.strategy, "gathered_params", None)
        with gathered() if gathered is not None else contextlib.nullcontext():
            final = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        out = {"losses": self.losses, "final": final, "meta": getattr(self, "built_on_meta", None)}
        torch.save(out, os.path.join(self.out, f"{self.tag}_rank{self.global_rank}.pt"))

    def train_dataloader(self):
        return DataLoader(Tokens(), batch_size=2)


def _fit(tmp_path, name, path, tag, how, strategy):
    module = FineTune(name, path, str(tmp_path), tag, how)
    Trainer(strategy=strategy, **trainer_kwargs(devices=2, max_steps=3)).fit(module)
    return [torch.load(tmp_path / f"{tag}_rank{r}.pt") for r in range(2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,how", [("t5", "load_weights_from"), ("gpt2", "load_pretrained")])
def test_trainer_fine_tune_from_streamed_weights_equals_ddp_from_pretrained(tmp_path, name, how):
    path, _, _ = _save(tmp_path, name, "sharded")
    knob = path if how == "load_weights_from" else None
    strategy = ZeroStrategy(stage=3, start_method="fork", load_weights_from=knob)
    zero = _fit(tmp_path, name, path, "zero", how, strategy)
    assert zero[0]["meta"] is True
    ddp = _fit(tmp_path, name, path, "ddp", "eager", DDPStrategy(start_method="fork", find_unused_parameters=True))
    for r in range(2):
        torch.testing.assert_close(torch.tensor(zero[r]["losses"]), torch.tensor(ddp[r]["losses"]),
                                   rtol=RTOL, atol=ATOL)
    for k, v in ddp[0]["final"].items():
        torch.testing.assert_close(zero[0]["final"][k], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


# -- bad checkpoints: one clear error each ----------------------------------------------------------------
def _meta(name):
    with torch.device("meta"):
        return ZOO[name][0]()


def test_checkpoint_that_does_not_fit_is_refused_by_name(tmp_path):
    path, _, _ = _save(tmp_path, "gpt2", "file")
    state = {k[len("model."):]: v for k, v in torch.load(path).items()}
    del state["transformer.h.1.mlp.c_fc.weight"]
    state["transformer.ln_f.weight"] = torch.ones(7)
    torch.save(state, tmp_path / "broken.pt")
    with pytest.raises(ValueError, match=r"no tensor for transformer\.h\.1\.mlp\.c_fc\.weight; shape mismatch "
                                         r"transformer\.ln_f\.weight \(32,\) <- transformer\.ln_f\.weight \(7,\)"):
        load_pretrained(_meta("gpt2"), tmp_path / "broken.pt")


def test_base_model_checkpoint_loads_into_the_head_model(tmp_path):
    """GPT2Model's keys have no ``transformer.`` prefix; the tied head reads the embedding (as from_pretrained)."""
    torch.manual_seed(0)
    head = ZOO["gpt2"][0]()
    head.transformer.save_pretrained(tmp_path / "base")
    model = load_pretrained(type(head)(head.config), tmp_path / "base")  # eager: loaded in place
    for k, v in head.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_untrusted_index_and_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="No pretrained checkpoint at .*Allowed: a save_pretrained directory"):
        load_pretrained(_meta("gpt2"), tmp_path / "nope")
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../../etc/passwd"}}')
    with pytest.raises(ValueError, match="names '../../etc/passwd', not a file in"):
        load_pretrained(_meta("gpt2"), tmp_path / "evil")
    torch.save({"w": object()}, tmp_path / "object.pt")
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        load_pretrained(_meta("gpt2"), tmp_path / "object.pt")


class HeadOnTop(pl.LightningModule):
    """An HF model and a module of its own, both built in configure_model: the checkpoint covers only one."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def configure_model(self) -> None:
        self.model = ZOO["gpt2"][0]()
        self.head = nn.Linear(VOCAB, 2)

    def training_step(self, batch, batch_idx):
        return self.head(self.model(input_ids=batch).logits).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Tokens(), batch_size=2)


def test_meta_parameters_outside_the_checkpoint_are_refused(tmp_path):
    path, _, _ = _save(tmp_path, "gpt2", "single")
    trainer = Trainer(strategy=ZeroStrategy(stage=3, load_weights_from=path), **trainer_kwargs(devices=1, max_steps=1))
    outside = r"head\.weight, head\.bias are outside the module\(s\) given to load_pretrained"
    with pytest.raises(ValueError, match=outside):
        trainer.fit(HeadOnTop(path))


# -- the recipe: model.pretrained=DIR under ZeRO-3 streams the checkpoint -------------------------------------
class _Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(3, 300, (SEQ,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids.flip(0)}


class _Recorder(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        with trainer.strategy.gathered_params():
            state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        stats = trainer.strategy.engine.partitioner.load_stats  # None unless the shards were read from DIR
        torch.save({"state": state, "peak": stats.peak_bytes if stats else None,
                    "full": sum(p.numel() * 4 for p in pl_module.model.parameters())},
                   os.path.join(self.out, f"recipe_rank{trainer.global_rank}.pt"))


@pytest.mark.timeout(240)
def test_recipe_pretrained_streams_into_stage3_shards(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from t5_module import T5FineTuner, make_t5_config
    from t5_tokenizer import bytes_tokenizer
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    T5ForConditionalGeneration(make_t5_config("t5_tiny", bytes_tokenizer())).save_pretrained(
        tmp_path / "hf", max_shard_size="100KB")
    ref = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").state_dict()
    module = T5FineTuner(pretrained=str(tmp_path / "hf"), total_steps=1, warmup_steps=0)
    module.train_dataloader = lambda: DataLoader(_Pairs(), batch_size=2)
    trainer = Trainer(strategy=ZeroStrategy(stage=3, start_method="fork"), callbacks=[_Recorder(str(tmp_path))],
                      **trainer_kwargs(devices=2, max_steps=1))
    trainer.fit(module)
    for r in range(2):
        got = torch.load(tmp_path / f"recipe_rank{r}.pt")
        assert got["peak"] is not None and got["peak"] < got["full"]
        for k, v in ref.items():
            assert torch.equal(got["state"][k], v), k


# -- Fabric: init_module(empty_init=True) + load_pretrained ---------------------------------------------------
def _fabric_job(rank, world_size, path, config, cls):
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    torch.set_num_threads(1)
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=3), accelerator="cpu", devices=world_size)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = cls(config)
    meta = all(p.is_meta for p in model.parameters())
    load_pretrained(model, path)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(RuntimeError, match="already partitioned by a stage-3 engine. Allowed: call it in configure"):
        load_pretrained(model, path)
    stats = fabric.strategy.engine.partitioner.load_stats
    with fabric.strategy.gathered_params():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric.strategy.teardown()
    return {"meta": meta, "state": state, "peak": stats.peak_bytes}


@pytest.mark.timeout(120)
def test_fabric_empty_init_loads_streamed_weights(tmp_path):
    path, config, ref = _save(tmp_path, "t5", "sharded")
    for res in run_distributed(_fabric_job, 2, path, config, type(ZOO["t5"][0]())):
        assert res["meta"] and res["peak"] > 0
        for k, v in ref.items():
            assert torch.equal(res["state"][k], v), k


class _Seen(pl.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


def test_load_weights_from_below_stage3_loads_in_place(tmp_path):
    """Stages 0-2 (the model built eagerly, randomly initialized): the knob overwrites it with the checkpoint."""
    path, _, ref = _save(tmp_path, "gpt2", "sharded")
    module = FineTune("gpt2", path, str(tmp_path), "z2", how="built")
    module.model = module.cls(module.config)  # random weights
    seen = _Seen()
    Trainer(strategy=ZeroStrategy(stage=2, load_weights_from=path), callbacks=[seen],
            **trainer_kwargs(devices=1, max_steps=1)).fit(module)
    for k, v in ref.items():
        assert torch.equal(seen.state[k], v), k
