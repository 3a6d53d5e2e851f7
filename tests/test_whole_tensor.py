"""Whole-tensor optimizers at ZeRO stages 1-3: the owner-rank step ([Note: owner-rank step]) against torch DDP.

The reference is DDP with the same optimizer classes stepping whole parameters (tests/helpers/whole_tensor_runs.py):
Muon on the hidden matrices + AdamW on the rest (``muon_split``), Adafactor, and LAMB written from its paper, on HF
models built from their configs, with accumulation, global-norm clipping across every optimizer and an LR schedule.
Muon is compared with its Newton-Schulz iteration in fp32 (both runs) at fp32 rtol 1e-5, and as torch ships it (bf16)
at bf16 precision (the band DDP-vs-ZeRO-stage-0 already shows).
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import Tolerance, close
from tests.helpers.whole_tensor_runs import Lamb, fp32_newton_schulz, make_optimizers, run
from tests.helpers.zoo_models import ZOO

# torch's Muon orthogonalizes in bf16: a last-bit difference of a gradient moves a weight by up to
# lr * 2^-8 * |update| (2.2e-4 measured between DDP and ZeRO stage 0, which has no owner step)
BF16_NEWTON_SCHULZ = Tolerance(rtol=1.6e-2, atol=5e-4)

CONFIGS = {
    "zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": dict(stage=3),
    "zero1_offload": dict(stage=1, offload_optimizer=True), "zero2_offload": dict(stage=2, offload_optimizer=True),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
    "zero3_hybrid": dict(stage=3, shard_group_size=2),  # owners within each shard group; replicas agree
}


def _against_ddp(rank, world, name, which, presets, fp32_ns, clip, tol):
    if fp32_ns:
        fp32_newton_schulz()
    ref = run(rank, name, which, None, clip=clip)
    out = {}
    for preset in presets:
        got = run(rank, name, which, ZeroConfig(**CONFIGS[preset]), clip=clip)
        for key in ("losses", "norms", "state"):
            close(got[key], ref[key], f"{preset} {which} {name} {key}", tol)
        out[preset] = got["state_bytes"]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,which", [("gpt2", "muon_adamw"), ("llama", "muon_adamw"), ("t5", "adafactor"),
                                        ("bert", "lamb")])
def test_matches_ddp_at_every_stage_and_offload(name, which):
    presets = [p for p in CONFIGS if "hybrid" not in p]
    per_rank = run_distributed(_against_ddp, 2, name, which, presets, True, 0.5, Tolerance(1e-5, 1e-6))
    for preset in presets:  # the state is split between the ranks, not copied: each holds some, neither all
        assert all(b[preset][0] > 0 for b in per_rank), preset


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,which,presets", [("gpt2", "muon_adamw", ["zero1", "zero3", "zero3_offload",
                                                                        "zero3_hybrid"]),
                                                ("t5", "adafactor", ["zero2"])])
def test_matches_ddp_at_4_ranks(name, which, presets):
    run_distributed(_against_ddp, 4, name, which, presets, True, 0.5, Tolerance(1e-5, 1e-6))


def _bit_exact_stage1(rank, world):
    ref = run(rank, "gpt2", "muon_adamw", None, clip=None)
    got = run(rank, "gpt2", "muon_adamw", ZeroConfig(stage=1), clip=None)
    for k in ref["state"]:
        assert torch.equal(got["state"][k], ref["state"][k]), k


@pytest.mark.timeout(300)
def test_torch_muon_in_bf16_is_bit_exact_where_the_gradients_are():
    """Stage 1 without clipping reduces exactly DDP's sums (two ranks: one addition, commutative): every weight
    equal bit for bit, so the owner step adds no error of its own to torch's bf16 Muon."""
    run_distributed(_bit_exact_stage1, 2)


@pytest.mark.timeout(300)
def test_torch_muon_in_bf16_matches_ddp_at_its_precision():
    run_distributed(_against_ddp, 2, "gpt2", "muon_adamw", ["zero2", "zero3_offload"], False, 0.5,
                    BF16_NEWTON_SCHULZ)


def _bf16_against_stage0(rank, world):
    """A bf16 module: the masters' values travel with the gradients (the parameters are rounded). Stage 0 steps
    the same whole fp32 masters without owners: stages 1-3 agree with it to bf16's precision."""
    ref = run(rank, "t5", "adafactor", ZeroConfig(stage=0), compute_dtype=torch.bfloat16)
    for stage in (1, 2, 3):
        got = run(rank, "t5", "adafactor", ZeroConfig(stage=stage), compute_dtype=torch.bfloat16)
        close(got["losses"], ref["losses"], f"bf16 stage {stage} losses", Tolerance(1.6e-2, 1e-3))
        close(got["state"], ref["state"], f"bf16 stage {stage} state", Tolerance(1.6e-2, 1e-3))


@pytest.mark.timeout(300)
def test_bf16_module_matches_stage0_at_bf16_precision():
    run_distributed(_bf16_against_stage0, 2)


# -- where the state lives ----------------------------------------------------------------------------------
def _state_by_rank(rank, world, stage):
    torch.manual_seed(0)
    model = ZOO["llama"][0]()
    opts = make_optimizers(model, "muon_adamw")
    engine = ZeroEngine(model, opts, ZeroConfig(stage=stage))
    _, make_batch, loss_fn = ZOO["llama"]
    loss_fn(model, make_batch(0, rank)).backward()
    engine.step()
    muon = engine.shardeds[0]
    held = {name for name, m, _, _ in engine.master_items() if muon.state_holder(m) is not None
            and muon.optimizer.state.get(muon.state_holder(m))}
    out = dict(held=held, muon_bytes=muon.state_bytes(), adamw_bytes=engine.shardeds[1].state_bytes(),
               cost=muon.owner.cost_by_rank())
    engine.remove()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_each_parameters_state_lives_on_one_rank_balanced_by_cost(world):
    torch.manual_seed(0)
    model = ZOO["llama"][0]()
    muon_params = make_optimizers(model, "muon_adamw")[0].param_groups[0]["params"]
    whole_bytes = sum(p.numel() * 4 for p in muon_params)  # Muon's momentum: one fp32 tensor per matrix
    outs = run_distributed(_state_by_rank, world, 3)
    held = [o["held"] for o in outs]
    assert sum(len(h) for h in held) == len(muon_params) and len(set().union(*held)) == len(muon_params)
    assert sum(o["muon_bytes"] for o in outs) == whole_bytes  # nothing duplicated, nothing missing
    assert all(o["muon_bytes"] < whole_bytes for o in outs)
    cost = outs[0]["cost"]
    assert max(cost) <= 2 * sum(cost) / world, cost  # greedy largest-first: within 2x of an even share
    # AdamW, elementwise, still holds exactly its slice: 2 fp32 moments of this rank's elements (+ the step counts)
    assert len({o["adamw_bytes"] for o in outs}) <= 2


# -- what a bad setting gets --------------------------------------------------------------------------------
def test_lbfgs_is_refused_at_every_stage():
    for stage in (0, 1, 2, 3):
        model = ZOO["gpt2"][0]()
        with pytest.raises(ValueError, match="LBFGS re-evaluates the loss through a closure.*Allowed: "):
            ZeroEngine(model, torch.optim.LBFGS(model.parameters()), ZeroConfig(stage=stage))


def test_whole_tensor_state_on_nvme_is_refused(tmp_path):
    model = ZOO["gpt2"][0]()
    cfg = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params=True, nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="Adafactor updates whole tensors.*Allowed: Adafactor with its state on "
                                         "the device or offloaded to host memory"):
        ZeroEngine(model, torch.optim.Adafactor(model.parameters()), cfg)


def _tensor_parallel_refused(rank, world):
    from tests.helpers.tp_models import make_gpt, parallelize, tp_mesh

    mesh = tp_mesh(world)
    model = parallelize(make_gpt(), mesh["tensor_parallel"])
    with pytest.raises(ValueError, match="tensor parallelism splits them.*Allowed: "):
        ZeroEngine(model, torch.optim.Adafactor(model.parameters()), ZeroConfig(stage=1, tensor_parallel_size=2),
                   device_mesh=mesh)


@pytest.mark.timeout(120)
def test_whole_tensor_with_tensor_parallelism_is_refused():
    run_distributed(_tensor_parallel_refused, 2)


# -- add_param_group: new owners for new parameters --------------------------------------------------------
def _add_group(rank, world, stage):
    _, make_batch, loss_fn = ZOO["gpt2"]

    def train(engine_cfg):
        torch.manual_seed(0)
        model = ZOO["gpt2"][0]()
        blocks = [p for n, p in model.named_parameters() if ".h.1." in n]
        rest = [p for n, p in model.named_parameters() if ".h.1." not in n]
        opt = Lamb(rest, lr=1e-2)
        engine = ZeroEngine(model, opt, engine_cfg) if engine_cfg is not None else None
        runner = model if engine else torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        for step in range(3):
            if step == 1:
                opt.add_param_group({"params": blocks, "lr": 5e-3})
            loss_fn(runner, make_batch(step, rank)).backward()
            if engine:
                engine.step()
            else:
                opt.step()
                opt.zero_grad()
        if engine:
            engine.restore_fp32_module()
            engine.remove(hand_back=False)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    close(train(ZeroConfig(stage=stage)), train(None), f"stage {stage} add_param_group")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_add_param_group_after_setup_matches_ddp(stage):
    from lightning_zero import register_whole_tensor_optimizer

    register_whole_tensor_optimizer(Lamb)
    run_distributed(_add_group, 2, stage)


# -- bytes on the wire ------------------------------------------------------------------------------------
def _owner_traffic(rank, world, stage, dtype):
    torch.manual_seed(0)
    model = ZOO["gpt2"][0]()
    opt = torch.optim.Adafactor(model.parameters())
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage), compute_dtype=dtype)
    _, make_batch, loss_fn = ZOO["gpt2"]
    for step in range(2):
        engine.prepare_forward()
        loss_fn(model, make_batch(step, rank)).float().backward()
        engine.step()
    ops = engine.comm_report().by_op()
    owner = engine.shardeds[0].owner
    mine = [it for it in owner.items if it.owner == rank]
    buckets = len(engine.shardeds[0].buckets)
    engine.remove()
    return ops, sum(it.spec.shard_numel for it in owner.items), sum(it.spec.shard_numel for it in mine), buckets


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,dtype,per", [(2, None, 1), (3, None, 2), (2, torch.bfloat16, 2)])
def test_owner_step_traffic_is_one_gather_and_one_scatter_per_bucket(stage, dtype, per):
    """Gradients travel always; the masters' values only where the owner cannot read them from the module
    (stage 3, or rounded bf16 parameters): exact payload bytes of the step's all-to-alls, one each way per bucket."""
    outs = run_distributed(_owner_traffic, 2, stage, dtype)
    for rank, (ops, all_chunks, mine, buckets) in enumerate(outs):
        assert ops["gather_to_owner"][:2] == [buckets, per * all_chunks * 4], (rank, ops)
        assert ops["scatter_from_owner"][:2] == [buckets, 2 * mine * 4], (rank, ops)  # owned chunks, to both ranks
    assert outs[0][3] > 1 or stage != 3  # stage 3's buckets are its units


def _direct_state_dict(rank, world):
    torch.manual_seed(0)
    model = ZOO["gpt2"][0]()
    opt = torch.optim.Adafactor(model.parameters())
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2))
    _, make_batch, loss_fn = ZOO["gpt2"]
    loss_fn(model, make_batch(0, rank)).backward()
    engine.step()
    local = opt.state_dict()  # torch's own call on the user's object: this rank's parameters
    owned = len(engine.shardeds[0].owner.owned(rank))
    assert len(local["state"]) == owned and sum(len(g["params"]) for g in local["param_groups"]) == owned
    before = {k: {n: v.clone() for n, v in st.items()} for k, st in local["state"].items()}
    opt.load_state_dict(local)  # and back
    close(opt.state_dict()["state"], before, "local state round trip", Tolerance(0, 0))
    engine.remove()
    return owned


@pytest.mark.timeout(120)
def test_direct_optimizer_state_dict_is_this_ranks_part():
    """A callback's ``optimizer.state_dict()`` on the user's object works (torch's own would look the whole masters
    up in groups that hold slices): it returns this rank's owned parameters, and loads back."""
    owned = run_distributed(_direct_state_dict, 2)
    assert sum(owned) == sum(1 for _ in ZOO["gpt2"][0]().parameters())


def _memory_rows(rank, world):
    torch.manual_seed(0)
    model = ZOO["llama"][0]()
    opts = make_optimizers(model, "muon_adamw")
    engine = ZeroEngine(model, opts, ZeroConfig(stage=3))
    _, make_batch, loss_fn = ZOO["llama"]
    loss_fn(model, make_batch(0, rank)).backward()
    engine.step()
    report = engine.memory_report()
    owned = [it for it in engine.shardeds[0].owner.items if it.owner == rank]
    engine.remove()
    return report, sum(it.spec.numel for it in owned)


@pytest.mark.timeout(120)
def test_memory_report_counts_each_ranks_state_and_the_owner_steps_transient_bytes():
    torch.manual_seed(0)
    model = ZOO["llama"][0]()
    opts = make_optimizers(model, "muon_adamw")
    muon = opts[0].param_groups[0]["params"]
    outs = run_distributed(_memory_rows, 2)
    # Muon's momentum is whole on owners; AdamW's two moments are sliced: together every element once
    adamw_elements = sum(p.numel() for p in opts[1].param_groups[0]["params"])
    total_state = sum(r.optimizer_state for r, _ in outs)
    assert total_state - 4 * sum(p.numel() for p in muon) - 8 * adamw_elements < 4 * 64 * 2  # + AdamW's step scalars
    for report, owned_elements in outs:
        # at least the owned whole masters and gradients in fp32, at most that plus one bucket's fp32 buffers
        assert 8 * owned_elements < report.owner_step <= 8 * owned_elements + 4 * 2 * 2 * max(
            p.numel() for p in model.parameters()) * 8
