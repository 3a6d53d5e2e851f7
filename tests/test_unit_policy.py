"""Stage 3 unit policy on module trees (cheap, no process group), ownership of shared modules/parameters, the
persistence threshold, the setup line, and the released-parameter guard (on demand / one clear error)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.stage3.guard import ReleasedParameterError
from lightning_zero.engine.stage3.unit_policy import CONTAINERS, choose_unit_modules
from lightning_zero.engine.stage3.units import build_units
from tests.helpers.dist_utils import run_distributed
from tests.helpers.zoo_models import ZOO, MoE, SharedBlock, SharedModel, TorchTransformer, gpt2


def _units(model, **kw):
    units = build_units(model, 2, 0, **kw)
    return {u.name: u for u in units}, units


def _on_meta(builder, *args):
    with torch.device("meta"):
        return builder(*args)


# -- which modules -------------------------------------------------------------------------------------------
class Wrapper(nn.Module):  # a LightningModule holds the HF model as an attribute
    def __init__(self, inner):
        super().__init__()
        self.model = inner


def test_declared_no_split_modules_on_root_and_on_a_submodule():
    for model, prefix in ((gpt2(), ""), (Wrapper(gpt2()), "model.")):
        names, units = _units(model)
        assert list(names) == [f"{prefix}transformer.h.0", f"{prefix}transformer.h.1", "<root>"]
        assert units.policy == "declared _no_split_modules ['GPT2Block']"
    # BERT declares on BertModel (a submodule of BertForMaskedLM), not on the head class
    _, units = _units(ZOO["bert"][0]())
    assert {type(u.module).__name__ for u in units[:-1]} == {"BertEmbeddings", "BertLayer"}


def test_repeated_children_are_the_units_never_their_container():
    _, units = _units(TorchTransformer())  # encoder and decoder layers: both outermost lists count
    assert [u.name for u in units[:-1]] == [f"transformer.{p}.layers.{i}" for p in ("encoder", "decoder") for i in (0, 1)]
    assert units.policy.startswith("repeated children")
    # an MoE: the blocks, not the experts inside them (routing differs per rank: one unit per expert diverges)
    _, units = _units(MoE())
    assert [u.name for u in units[:-1]] == ["blocks.0", "blocks.1"]
    # a Sequential root: its Linear children
    mlp = nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 4))
    assert [u.name for u in build_units(mlp, 2, 0)[:-1]] == ["0", "2", "4"]


class Lucid(nn.Module):
    """Blocks as a ModuleList of ModuleLists that the parent unpacks: the inner lists never run forward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList([nn.MultiheadAttention(16, 2), nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))]) for _ in range(2))

    def forward(self, x):
        for attn, ff in self.layers:
            x = x + attn(x, x, x)[0]
            x = x + ff(x)
        return x


def test_no_rule_picks_a_container_or_splits_multihead_attention():
    cases = [(Lucid(), {}), (TorchTransformer(), {"unit_bytes": 2000}), (Lucid(), {"unit_bytes": 500})]
    cases += [(ZOO[n][0](), {"unit_bytes": b}) for n in ("gpt2", "bert", "resnet", "t5") for b in (400, 4000, 50_000)]
    for model, kw in cases:
        modules, policy = choose_unit_modules(model, **kw)
        for m in modules:
            assert not isinstance(m, CONTAINERS), (type(model).__name__, kw, policy)
            inside_mha = any(m is x for a in model.modules() if isinstance(a, nn.MultiheadAttention)
                             for x in a.modules() if x is not a)
            assert not inside_mha, (type(model).__name__, kw)


def test_the_issue_widths_never_make_a_modulelist_a_unit():
    """GPT-2 n_embd=512, n_layer=4 with 8 MiB units chose transformer.h (a ModuleList, never gathered)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = _on_meta(GPT2LMHeadModel, GPT2Config(n_embd=512, n_layer=4, n_head=8, vocab_size=100, n_positions=32))
    for kw in ({}, {"unit_bytes": 8 * 2**20}, {"unit_bytes": 2**20}):
        names, _ = _units(model, **kw)
        assert "transformer.h" not in names and all(not isinstance(u.module, CONTAINERS) for u in names.values())
    names, units = _units(model)
    assert len(units) == 5 and not any(u.persistent for u in units[:-1])  # one unit per block, all sharded


def test_unit_classes_misspelt_or_container_entries_are_refused():
    model = gpt2()
    with pytest.raises(ValueError, match=r"'GPT2Blok' matches no module .*Did you mean 'GPT2Block'.*GPT2Block"):
        build_units(model, 2, 0, ["GPT2Block", "GPT2Blok"])
    with pytest.raises(ValueError, match=r"'transformer.h', a ModuleList: it has no forward.*GPT2Block"):
        build_units(model, 2, 0, ["transformer.h"])
    with pytest.raises(ValueError, match="matches no module"):
        build_units(model, 2, 0, [nn.GRU])
    names, units = _units(model, unit_classes=["GPT2Attention", "transformer.h.1.mlp"])  # user override still wins
    assert units.policy == "user unit_classes" and "transformer.h.1.mlp" in names and "transformer.h.0.attn" in names


# -- ownership ----------------------------------------------------------------------------------------------
def test_shared_module_and_shared_parameter_belong_to_the_common_ancestor_unit():
    model = SharedModel()
    names, units = _units(model)
    assert [u.name for u in units[:-1]] == ["blocks.0", "blocks.1", "blocks.2"]
    root = {id(p) for p in names["<root>"].params}
    shared, tied = model.blocks[0].shared, model.blocks[0].fc.weight
    assert all(id(p) in root for p in shared.parameters())  # the Linear registered in all three blocks
    assert id(tied) in root  # the Parameter registered in blocks 0 and 1
    assert [p for p in names["blocks.2"].params] == [model.blocks[2].fc.weight, model.blocks[2].fc.bias]
    # both paths inside one unit (a Linear registered on the block and on a submodule of it): that unit
    blk = SharedBlock(32, nn.Linear(32, 32))
    blk.sub = nn.Module()
    blk.sub.again = blk.shared
    holder = nn.Sequential(nn.Embedding(10, 32), blk, SharedBlock(32, nn.Linear(32, 32)))
    names, _ = _units(holder, unit_classes=["SharedBlock"])
    assert all(any(p is q for q in names["1"].params) for p in blk.shared.parameters())
    # a shared unit module (the same block instance registered twice) keeps its own parameters
    twice = nn.Sequential(nn.Embedding(10, 8))
    blk = nn.Linear(8, 8)
    twice.append(blk)
    twice.append(blk)
    units = build_units(twice, 2, 0, unit_classes=[nn.Linear])
    assert [u.params for u in units if u.module is blk] == [[blk.weight, blk.bias]]


# -- persistence ------------------------------------------------------------------------------------------
def test_small_models_still_partition_and_the_threshold_follows_the_units():
    from transformers import GPT2Config, GPT2LMHeadModel

    for width in (32, 128, 256):  # ~30 K to ~3 M parameters
        model = _on_meta(GPT2LMHeadModel, GPT2Config(n_embd=width, n_layer=4, n_head=4, vocab_size=100, n_positions=32))
        _, units = _units(model)
        assert len(units) == 5 and not any(u.persistent for u in units[:-1]), units.describe()
        assert units.persist_numel <= min(10_000, min(sum(p.numel() for p in u.params) for u in units[:-1]))
    # ResNet's tiny convolutions stay gathered, the large ones are sharded
    _, units = _units(ZOO["resnet"][0]())
    small = [u for u in units[:-1] if u.persistent]
    assert small and len(small) < len(units) - 1 and all(sum(p.numel() for p in u.params) < units.persist_numel
                                                            for u in small)
    # explicit values still override
    _, units = _units(gpt2(), persist_numel=10**9)
    assert all(u.persistent for u in units)
    with pytest.raises(ValueError, match="persist_numel must be"):
        ZeroConfig(stage=3, persist_numel=-1)


def test_setup_logs_one_line_on_rank_zero(caplog):
    model = gpt2()
    with caplog.at_level(logging.INFO, logger="lightning_zero"):
        ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_zero")]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0] == ("ZeRO-3 units: 2 + root, params min/median/max 12.7K/12.7K/12.7K, 0 persistent "
                        "(< 3.18K params), root 4.29K (persistent); policy: declared _no_split_modules ['GPT2Block']")


# -- the guard ----------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    """``mode``: how the parent reaches block 0 besides calling it."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.emb = nn.Embedding(100, 16)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(16, 100)

    def forward(self, ids):
        x = self.emb(ids)
        if self.mode == "weight":  # reads a parameter of another unit: no module of that unit runs
            x = nn.functional.linear(x, self.blocks[0].fc.weight)
        elif self.mode == "module":  # runs a module of another unit outside that unit's forward
            x = self.blocks[0].fc(x)
        for b in self.blocks:  # iterated: a Sequential named as the unit never runs its own forward
            x = b(x)
        return self.head(x)


def test_a_released_parameter_read_directly_raises_one_clear_error():
    torch.manual_seed(0)
    model = Net("weight")
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    assert [u.name for u in engine.partitioner.units[:-1]] == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(ReleasedParameterError) as e:
        engine.prepare_forward()
        model(torch.randint(0, 100, (2, 5)))
    msg = str(e.value)
    assert "'blocks.0.fc.weight' of unit 'blocks.0'" in msg and "linear()" in msg
    assert "unit_classes=['blocks.1', 'blocks.2'] (every unit but 'blocks.0'" in msg
    assert not torch.overrides._get_current_function_mode_stack()  # the probe left no mode behind


def test_the_probe_stops_after_the_first_backward():
    model = Net("none")
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    guard = engine.partitioner.guard
    assert guard._probe_handles
    model(torch.randint(0, 100, (2, 5))).sum().backward()
    assert not guard._probe_handles and guard._mode is None
    engine.step()
    eval_model = Net("none").eval()
    eval_engine = ZeroEngine(eval_model, None, ZeroConfig(stage=3))
    with torch.no_grad():
        eval_model(torch.randint(0, 100, (2, 5)))
    assert not eval_engine.partitioner.guard._probe_handles


def _on_demand(rank, world_size, mode, unit_classes):
    out = []
    for zero in (False, True):
        torch.manual_seed(0)
        model = Net(mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        runner = model if zero else DDP(model)
        engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=unit_classes)) if zero else None
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                g = torch.Generator().manual_seed(10 * step + rank)
                loss = nn.functional.cross_entropy(runner(torch.randint(0, 100, (2, 5), generator=g)).reshape(-1, 100),
                                                   torch.randint(0, 100, (10,), generator=g))
                loss.backward()
                losses.append(loss.item())
                (engine.step() if zero else (opt.step(), opt.zero_grad()))
        if zero:
            engine.restore_fp32_module()
        out.append((losses, {k: v.detach().clone() for k, v in model.state_dict().items()},
                    sorted({str(w.message) for w in caught if "on demand" in str(w.message)})))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,unit_classes", [("module", None), ("none", ["Sequential"])])
def test_modules_run_outside_their_unit_are_gathered_on_demand_and_match_ddp(mode, unit_classes):
    for (ref_l, ref_s, _), (got_l, got_s, warned) in run_distributed(_on_demand, 2, mode, unit_classes):
        torch.testing.assert_close(torch.tensor(got_l), torch.tensor(ref_l), rtol=1e-5, atol=1e-6)
        for k in ref_s:
            torch.testing.assert_close(got_s[k], ref_s[k], rtol=1e-5, atol=1e-6)
        unit = "blocks.0" if mode == "module" else "blocks"
        assert len(warned) == 1 and f"unit '{unit}' was gathered on demand" in warned[0], warned


def test_estimator_uses_the_same_units_as_the_engine():
    from lightning_zero.tools.estimate import estimate_model_states, info_from_module

    for name in ("gpt2", "moe", "uneven"):
        model = ZOO[name][0]()
        units = build_units(model, 1, 0)
        info = info_from_module(model)
        assert info.largest_unit == max(sum(p.numel() for p in u.params) for u in units[:-1])
        assert info.root_unit == sum(p.numel() for p in units[-1].params)
    model = gpt2()
    units = build_units(model, 1, 0)
    block = sum(p.numel() for p in units[0].params)
    est = estimate_model_states(model, world_size=2).row("zero3")
    assert est.buffers["backward"] == 4 * (sum(p.numel() for p in units[-1].params) + 4 * block)  # root + 4 blocks
