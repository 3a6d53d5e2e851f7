"""ZeRO stage 3 in the engine: DDP parity, release after use, order checks, evaluation, generation."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine, model_state_floor
from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer
from tests.helpers.parity import UNITS, close as _close, train_parity_net as _train

CASES = [("adamw", 1, None), ("sgd", 1, None), ("adamw", 2, 0.5), ("adamw", 3, 0.5)]


def _matrix(rank, world_size):
    out = {}
    for case in CASES:
        out[case] = (_train(rank, *case, zero=False), _train(rank, *case, zero=True))
    always = ZeroConfig(stage=3, unit_classes=["Linear"], order_check="always", persist_numel=0)
    out["dynamic"] = (_train(rank, "adamw", 1, None, False, "step"),
                      _train(rank, "adamw", 1, None, True, "step", always))
    return out


@functools.lru_cache(maxsize=None)
def results(world_size):
    return run_distributed(_matrix, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", CASES + ["dynamic"], ids=str)
def test_stage3_matches_ddp(world_size, case):
    for res in results(world_size):
        (rl, rn, rp), (zl, zn, zp) = res[case]
        _close(zl, rl)
        _close(zn, rn)
        for k in rp:
            _close(zp[k], rp[k])


def _divergent(rank, world_size, late):
    model = make_model()
    opt = make_optimizer(model, "adamw")
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=["Linear"], persist_numel=0))
    for step in range(3):
        use = (rank == 0) if (not late or step == 2) else False
        loss_fn(model, batch(step, rank), use).backward()
        engine.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", [False, True], ids=["first-step", "after-recording"])
def test_rank_divergence_raises(late):
    with pytest.raises(RuntimeError, match="diverged|recorded order"):
        run_distributed(_divergent, 2, late)


def _memory(rank, world_size, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(96, 96) for _ in range(6)]
    model = torch.nn.Sequential(*blocks)
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=["Linear"], persist_numel=0),
                        compute_dtype=dtype)
    unit_bytes = blocks[0].weight.numel() * blocks[0].weight.element_size() + 96 * blocks[0].bias.element_size()
    x = torch.randn(4, 96, dtype=dtype)
    model(x).float().sum().backward()
    engine.step()
    model(x).float().sum().backward()
    rep = engine.memory_report().as_dict()
    return numel, unit_bytes, engine.partitioner.peak_gathered_bytes, engine.partitioner.prefetches, rep


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_stage3_memory(dtype_name):
    for numel, unit_bytes, peak, prefetches, rep in run_distributed(_memory, 2, dtype_name):
        # in flight: the unit computing plus the one being prefetched (its all-gather buffer)
        assert prefetches > 0
        assert unit_bytes <= peak <= 2 * unit_bytes, (peak, unit_bytes)
        floor = model_state_floor(3, numel, 2, dtype_name != "float32", state_bytes=8)["device"]
        assert abs(rep["model_states"] - floor) <= 0.05 * floor, (rep, floor)


def _eval_and_generate(rank, world_size):
    model = make_model()
    engine = ZeroEngine(model, None, ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0))
    with torch.inference_mode():
        engine.prepare_forward()
        out1 = model(batch(0, 0)[:, :-1])
    # eval under inference_mode must not poison parameters later used by autograd
    opt_model = make_model()
    opt = make_optimizer(opt_model, "adamw")
    eng2 = ZeroEngine(opt_model, opt, ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0))
    with torch.inference_mode():
        opt_model.eval()
        opt_model(batch(0, rank)[:, :-1])
    opt_model.train()
    loss_fn(opt_model, batch(1, rank), False).backward()
    eng2.step()
    # generation with unequal lengths per rank: no collective inside gathered_params
    steps = 3 + 2 * rank
    with engine.gathered_params():
        tokens = batch(0, 0)[:1, :2]
        for _ in range(steps):
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
    return out1, tokens.shape[1]


@pytest.mark.timeout(120)
def test_stage3_eval_inference_mode_and_unequal_generation():
    ref = make_model()(batch(0, 0)[:, :-1]).detach()
    res = run_distributed(_eval_and_generate, 2)
    for rank, (out, length) in enumerate(res):
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        assert length == 2 + 3 + 2 * rank


def _meta_init(rank, world_size):
    def build():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                   torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = build()
    engine = ZeroEngine(lazy, None, ZeroConfig(stage=3, unit_classes=["Linear"], persist_numel=0),
                        device=torch.device("cpu"))
    biggest_whole = max(p.numel() for p in eager.parameters())
    held = [p.untyped_storage().nbytes() for p in lazy.parameters()]
    x = torch.randn(3, 8)
    out = lazy(x)
    engine.remove()
    return eager(x).detach(), out.detach(), held, biggest_whole, {k: v.clone() for k, v in lazy.state_dict().items()}, \
        eager.state_dict()


def test_meta_init_equals_eager_and_is_sharded():
    for ref_out, out, held, _, lazy_sd, eager_sd in run_distributed(_meta_init, 2):
        torch.testing.assert_close(out, ref_out)
        assert sum(held) == 0  # after construction no rank holds any full parameter
        for k in eager_sd:
            torch.testing.assert_close(lazy_sd[k], eager_sd[k])


def _root_released(rank, world_size):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"),
                        ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0))
    loss_fn(model, batch(0, rank), False).backward()
    after_backward = engine.memory_report().params
    return after_backward, engine.partitioner.shard_bytes(), engine.partitioner.gathered_bytes()


def test_after_backward_only_shards_are_held():
    for held, shards, gathered in run_distributed(_root_released, 2):
        assert gathered == 0 and held == shards


def test_load_state_dict_into_shards_and_clear_refusal():
    model = make_model()
    target = {k: v.clone() + 1.0 for k, v in make_model(5).state_dict().items()}
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0))
    with pytest.raises(RuntimeError, match="only as shards.*load_full_state_dict"):
        model.load_state_dict(target)  # would write into released storage
    engine.load_full_state_dict(target)
    with engine.gathered_params():
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, target[k], rtol=0, atol=0)
    masters = dict(zip(engine.param_names(), engine.full_master_params()))
    torch.testing.assert_close(masters["fc1.weight"], target["fc1.weight"], rtol=0, atol=0)


class _FrozenFirst(torch.nn.Module):
    """A unit whose frozen layer runs first: its grad-input matmul comes after the unit's trainable
    gradients are complete (the LoRA shape: frozen base weight + trainable parameters in one block)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.adapter = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.adapter(self.base(x))


def test_unit_with_frozen_params_is_not_released_before_its_backward_ends():
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), _FrozenFirst(), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    ref, ref_opt = build()
    model, opt = build()
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=[_FrozenFirst], persist_numel=0))
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x).pow(2).mean().backward()  # released too early, the frozen weight had no storage here
        engine.step()
    engine.restore_fp32_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_units_with_frozen_params_are_released_during_backward():
    """The LoRA shape in every block: each unit is released once its inputs' gradients are computed, so
    when backward reaches the first block the later ones hold no gathered storage (not all at once)."""
    torch.manual_seed(0)
    blocks = [_FrozenFirst() for _ in range(4)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(8, 1))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=[_FrozenFirst], persist_numel=0))
    part = engine.partitioner
    units = {u.module: u for u in part.units}
    seen = []
    # when the gradient reaches the first block's output, blocks 2-4 must be released already
    blocks[0].register_full_backward_pre_hook(lambda *_: seen.append([units[b].gathered for b in blocks[1:]]))
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).requires_grad_()
        model(x).pow(2).mean().backward()
        engine.step()
    assert seen == [[False, False, False]] * 2, seen


def _frozen_blocks_on_subgroups(rank, world_size):
    """Two data-parallel groups {0, 1} and {2, 3}; each trains the LoRA-shaped model on its own data."""
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    group = groups[rank // 2]

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[_FrozenFirst() for _ in range(3)], torch.nn.Linear(8, 1))
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)

    ref, ref_opt = build()
    ddp = DDP(ref, process_group=group)
    model, opt = build()
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=[_FrozenFirst], persist_numel=0), group=group)
    losses = []
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        ddp(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        engine.step()
        losses.append(loss.item())
    engine.remove()  # hands the module back whole and destroys the engine's own reduce-scatter group
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, \
        {k: v.clone() for k, v in ref.state_dict().items()}


def test_stage3_on_data_parallel_subgroups_matches_ddp():
    """group= a subgroup: only its members build the engine (no hang), and each group equals DDP on it."""
    res = run_distributed(_frozen_blocks_on_subgroups, 4)
    for losses, got, want in res:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    for a, b in ((0, 1), (2, 3)):  # the members of a group end with the same weights ...
        for k, v in res[a][1].items():
            torch.testing.assert_close(v, res[b][1][k], rtol=0, atol=0, msg=k)
    assert res[0][1]["0.adapter.weight"].ne(res[2][1]["0.adapter.weight"]).any()  # ... the groups differ


class _Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.fc.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def test_fully_frozen_units_are_released_once_gradients_pass_through():
    """A frozen encoder under a trainable embedding: its units are gathered in backward only to pass the
    gradient through, and released right after (not all held until the end of backward); training still
    equals plain PyTorch."""
    def build():
        torch.manual_seed(0)
        blocks = [_Frozen() for _ in range(3)]
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), *blocks, torch.nn.Linear(8, 1))
        return model, blocks, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    ref, _, ref_opt = build()
    model, blocks, opt = build()
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=[_Frozen], persist_numel=0))
    units = {u.module: u for u in engine.partitioner.units}
    seen = []
    model[0].register_full_backward_pre_hook(lambda *_: seen.append([units[b].gathered for b in blocks]))
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x.requires_grad_()).pow(2).mean().backward()  # (an input needing a gradient: no hook warning)
        engine.step()
    assert seen == [[False, False, False]] * 2, seen
    engine.restore_fp32_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
