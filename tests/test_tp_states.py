"""Model states under tensor parallelism, on 4 gloo ranks (TP2 x DP2) with tests/tp_models' TinyGPT: the
module handed back in fp32 keeps training, the estimator's bytes equal ``engine.memory_report()``, and the
memory table's DDP column is what DDP of the same TP-split model holds per rank.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.layout import tensor_parallel as TPM
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import TP_FP32, close
from tests.helpers.tp_models import tp_mesh as _mesh
from tests.helpers.tp_models import dp_batch, full_state, lm_loss, make_gpt, parallelize

_close = functools.partial(close, tol=TP_FP32)

LR = 0.1


def _restore_then_train(rank, world_size, mesh):
    """A bf16 TP engine steps once, hands the module back in fp32 (parameter objects swapped), then steps
    again; the reference: DDP of the whole model from the handed-back weights, the same (stateless) SGD step.
    Only the cut (DTensor) parameters train: were their hooks lost, no hook would start the reduction."""
    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    model = parallelize(make_gpt(), mesh["tensor_parallel"])
    frozen = [n for n, p in model.named_parameters() if not TPM.is_dtensor(p)]
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=LR), ZeroConfig(stage=2, reduce_dtype="fp32"),
                        compute_dtype=torch.bfloat16, device_mesh=mesh)
    lm_loss(model, dp_batch(0, 0, dp_rank, dp_size)).backward()
    engine.step()
    engine.restore_fp32_module()
    handed_back = full_state(model)
    loss = lm_loss(model, dp_batch(1, 0, dp_rank, dp_size))
    loss.backward()
    engine.step()
    out = {"dtype": model.block.q.weight.dtype, "loss": loss.item(), "params": full_state(model),
           "moved": max((handed_back[k] - v).abs().max().item() for k, v in full_state(model).items())}
    engine.remove()

    ref = make_gpt()
    ref.load_state_dict(handed_back)
    for n, p in ref.named_parameters():
        p.requires_grad_(n not in frozen)
    ddp = DDP(ref, process_group=mesh.get_group("data_parallel"))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_loss = lm_loss(ddp, dp_batch(1, 0, dp_rank, dp_size))
    ref_loss.backward()
    opt.step()
    out["ref_loss"], out["ref_params"] = ref_loss.item(), {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return out


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _local_bytes(tensors) -> int:
    return sum(TPM.local(t).numel() * t.element_size() for t in tensors if t is not None)


def _memory_table(rank, world_size, mesh):
    """The table's DDP column against DDP of the TP-split model, measured: the TP model with a plain AdamW."""
    import torch.distributed as dist

    from lightning_zero.lightning.memory_summary import ddp_numbers, format_table, rank_numbers

    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    model = parallelize(make_gpt(), mesh["tensor_parallel"])
    engine = ZeroEngine(model, _adamw(model), ZeroConfig(stage=2), device_mesh=mesh)
    lm_loss(model, dp_batch(0, 0, dp_rank, dp_size)).backward()
    engine.step()
    ranks = [None] * world_size
    dist.all_gather_object(ranks, rank_numbers(engine))
    ddp = ddp_numbers(engine, ranks)
    table = format_table(engine.config, world_size, ranks, ddp)
    engine.remove()

    plain = parallelize(make_gpt(), mesh["tensor_parallel"])  # no ZeRO: TP only, every state whole
    opt = _adamw(plain)
    lm_loss(plain, dp_batch(0, 0, dp_rank, dp_size)).backward()
    opt.step()
    measured = {"params": _local_bytes(plain.parameters()), "grads": _local_bytes(p.grad for p in plain.parameters()),
                "optimizer_state": _local_bytes(t for st in opt.state.values() for t in st.values()
                                                if torch.is_tensor(t) and t.dim() > 0)}
    return ddp, measured, table


ESTIMATE_CASES = [(stage, dtype) for stage in (0, 1, 2) for dtype in ("float32", "bfloat16")]


def _estimate_vs_engine(rank, world_size, mesh):
    """Per case: the estimator's model states (TinyGPT + its TP plan, nothing run) and the engine's report,
    measured as tests/test_estimate.py does (after a step and an un-synced micro-batch)."""
    from lightning_zero.tools.estimate import estimate_model_states
    from tests.helpers.tp_models import tp_plan

    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    out = {}
    for stage, dtype_name in ESTIMATE_CASES:
        dtype = getattr(torch, dtype_name)
        est = estimate_model_states(make_gpt(), world_size, precision="32-true" if dtype_name == "float32" else
                                    "bf16-mixed", grad_accumulation=2, settings=[f"zero{stage}"],
                                    tensor_parallel_size=2, tensor_parallel_plan=tp_plan())
        model = parallelize(make_gpt(), mesh["tensor_parallel"])
        engine = ZeroEngine(model, _adamw(model), ZeroConfig(stage=stage, bucket_mb=0.001), compute_dtype=dtype,
                            device_mesh=mesh)
        lm_loss(model, dp_batch(0, 0, dp_rank, dp_size)).backward()
        engine.step()
        with engine.no_sync():
            lm_loss(model, dp_batch(0, 1, dp_rank, dp_size)).backward()
        out[stage, dtype_name] = (est.rows[0].states, engine.memory_report().as_dict(), str(est))
        engine.remove()
    return out


def _job(rank, world_size):
    mesh = _mesh(world_size)
    return {"restore": _restore_then_train(rank, world_size, mesh),
            "table": _memory_table(rank, world_size, mesh),
            "estimate": _estimate_vs_engine(rank, world_size, mesh)}


@functools.lru_cache(maxsize=None)
def results():
    return run_distributed(_job, 4)


@pytest.mark.timeout(120)
def test_training_after_the_fp32_hand_back_under_tp():
    """restore_fp32_module swaps each DTensor parameter object (set_data): the gradient hooks come along."""
    for res in results():
        out = res["restore"]
        assert out["dtype"] == torch.float32 and out["moved"] > 1e-4  # fp32 now, and the second step moved it
        _close(out["loss"], out["ref_loss"])
        for k, v in out["ref_params"].items():
            _close(out["params"][k], v)


@pytest.mark.timeout(120)
def test_memory_table_ddp_column_counts_local_pieces():
    ddp, measured, table = results()[0]["table"]
    for key, got in measured.items():
        assert ddp[key] == got, (key, ddp, measured)
    assert ddp["master"] == 0 and "tensor parallel 2 x data parallel 2" in table
    assert "vs DDP of the same TP-split model" in table
    for res in results()[1:]:  # every rank's DDP-of-TP holds the same (even cuts)
        assert res["table"][1] == measured


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ESTIMATE_CASES, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_estimator_equals_engine_bytes_under_tp(case):
    """Exact: the local pieces (column/row cuts of TinyGPT's plan) and their shards over the 2 DP ranks."""
    for res in results():
        est, rep, text = res["estimate"][case]
        assert est["params"] == rep["params"]
        assert est["grads"] == rep["grads"] + rep["grad_shards"]
        assert est["master"] == rep["master"]
        assert est["optimizer_state"] == rep["optimizer_state"]
        assert est["device"] == rep["model_states"] - rep["host"]
        assert "tensor parallelism: T=2 x data parallel 2" in text


def test_t5_preset_rule_equals_the_t5_module_cut():
    """The preset formula (q/k/v/o, wi/wo cut; embeddings, norms, relative bias whole) and t5_plan on the
    Hugging Face module give the same local pieces, hence the same rows; stage 3 is left out."""
    from transformers import T5Config, T5ForConditionalGeneration

    from lightning_zero.tools.estimate import estimate_model_states
    from lightning_zero.tools.t5_dims import t5_presets

    with torch.device("meta"):
        m = T5ForConditionalGeneration(T5Config(**t5_presets()["t5_tiny"], feed_forward_proj="relu"))
    a = estimate_model_states(m, world_size=4, precision="bf16-mixed", tensor_parallel_size=2)
    b = estimate_model_states("t5_tiny", world_size=4, precision="bf16-mixed", vocab_size=None, tensor_parallel_size=2)
    assert [r.setting for r in b.rows] == ["zero0", "zero1", "zero1_offload", "zero2", "zero2_offload",
                                           "zero2_offload_nvme"]
    assert [r.states for r in a.rows] == [r.states for r in b.rows]
    tp = b.tensor_parallel
    full = sum(p.numel() for p in m.parameters())
    cut = sum(p.numel() for n, p in m.named_parameters() if n.rsplit(".", 2)[-2] in ("q", "k", "v", "o", "wi", "wo"))
    assert (tp.full, tp.split, tp.local) == (full, cut, full - cut // 2) == (a.tensor_parallel.full,
                                                                              a.tensor_parallel.split,
                                                                              a.tensor_parallel.local)
    plain = estimate_model_states("t5_tiny", world_size=2, precision="bf16-mixed", vocab_size=None)
    # zero0 under TP: exactly the local pieces' states; DP alone holds the whole model
    assert b.row("zero0").states["params"] == 2 * tp.local and plain.row("zero0").states["params"] == 2 * full


def test_cli_estimate_tensor_parallel(capsys):
    from lightning_zero.tools.cli import main as cli_main

    assert cli_main(["estimate", "--model", "t5_small", "--ranks", "8", "--tensor-parallel-size", "2",
                     "--precision", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallelism: T=2 x data parallel 4" in out and "| zero2 " in out and "| zero3" not in out


@pytest.mark.parametrize("model, kwargs, message", [
    (1_000_000, dict(world_size=4, tensor_parallel_size=2), "needs the model's structure"),
    ("t5_tiny", dict(world_size=4, tensor_parallel_size=3), r"tensor_parallel_size=3 does not divide the world of 4"),
    ("t5_tiny", dict(world_size=8, tensor_parallel_size=8), "must divide the T5 heads"),
    ("t5_tiny", dict(world_size=4, tensor_parallel_size=2, shard_group_size=4),
     r"shard_group_size=4 does not divide the 2 data-parallel rank\(s\) \(world 4 / tensor_parallel_size 2\)"),
    ("module", dict(world_size=4, tensor_parallel_size=2), "Allowed: tensor_parallel_plan="),
    ("module", dict(world_size=4, tensor_parallel_size=2, tensor_parallel_plan={"nope": None}), "no submodule"),
])
def test_estimator_refuses_what_tp_cannot_estimate(model, kwargs, message):
    from lightning_zero.tools.estimate import estimate_model_states

    with pytest.raises(ValueError, match=message):
        estimate_model_states(make_gpt() if model == "module" else model, **kwargs)
