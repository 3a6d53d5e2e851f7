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
from lightning_zero.engine import tensor_parallel as TPM
from tests.dist_utils import run_distributed
from tests.test_tensor_parallel import _close, _mesh
from tests.tp_models import dp_batch, full_state, lm_loss, make_gpt, parallelize

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


def _job(rank, world_size):
    mesh = _mesh(world_size)
    return {"restore": _restore_then_train(rank, world_size, mesh),
            "table": _memory_table(rank, world_size, mesh)}


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
