"""Sequence parallelism under the ZeRO engine, the engine unchanged: 2 ranks splitting every sequence (S=2),
stages 1-3, gradient accumulation over 2 micro-batches and clipping, 3 SGD-with-momentum steps of HF Llama,
against one process training on the whole sequences (fp32, rtol 1e-5). SGD, not Adam: the split sums each
gradient over positions in another order, and Adam's normalization turns those ulps into weight changes of
~1e-6 where a gradient is near zero (TP's case, tests/helpers/parity.py); SGD keeps them ulps. The engine
averages the ranks' gradients as if they were data-parallel; every rank ending with the whole loss makes that
average the whole sequence's gradient ([Note: every rank computes the whole loss])."""
from __future__ import annotations

import contextlib

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.tools.launch import run_ranks
from tests.helpers.parity import close
from tests.helpers.sp_models import causal_batch, causal_lm, t5, t5_batch

STEPS, ACCUM, CLIP, LENGTH = 3, 2, 0.5, 22


def _batch(step: int, micro: int, dp: int = 0) -> dict:
    return causal_batch(LENGTH, pad_last=3 * micro + dp, seed=100 + 10 * step + micro + 1000 * dp)


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def _reference(replicas: int = 1):
    """One process; with ``replicas`` data-parallel ranks, DDP's loss: the mean of theirs."""
    model = causal_lm("llama")
    opt = _optimizer(model)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            loss = sum(model(**_batch(step, micro, dp)).loss for dp in range(replicas)) / (ACCUM * replicas)
            loss.backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, _state(model)


def _split(stage: int, group=None, dp: int = 0):
    from lightning_zero.sequence_parallel import apply_sequence_parallel

    model = causal_lm("llama")
    sharding = apply_sequence_parallel(model, group)
    engine = ZeroEngine(model, _optimizer(model), ZeroConfig(stage=stage))
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            with engine.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
                loss = model(**sharding.shard_batch(_batch(step, micro, dp))).loss / ACCUM
                loss.backward()
            losses.append(loss.item())
        norms.append(float(engine.clip_grad_norm_(CLIP)))
        engine.step()
    engine.restore_fp32_module()
    return losses, norms, _state(model)


def _rank(rank, world, stages):
    return {"ref": _reference(), **{stage: _split(stage) for stage in stages}}


@pytest.mark.timeout(400)
def test_zero_stages_over_the_sequence_parallel_ranks_train_as_one_process_on_whole_sequences():
    results = run_ranks(_rank, 2, ((1, 2, 3),), timeout_s=360)
    for res in results:
        ref_losses, ref_norms, ref_state = res["ref"]
        for stage in (1, 2, 3):
            losses, norms, state = res[stage]
            close(losses, ref_losses, f"stage {stage} losses")
            close(norms, ref_norms, f"stage {stage} pre-clip norms")
            close(state, ref_state, f"stage {stage} weights")


def _grid_rank(rank, world, stage):
    """4 ranks: 2 data-parallel replicas x 2 sequence-parallel ranks (groups of consecutive ranks)."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = rank // 2
    split = _split(stage, groups[dp], dp)
    losses = torch.tensor(split[0])
    dist.all_reduce(losses)  # 2 replicas x the same loss on both SP ranks: their mean over 4 is the replicas' mean
    return {"ref": _reference(replicas=2), "split": ([x / 4 for x in losses.tolist()],) + split[1:]}


@pytest.mark.timeout(400)
def test_zero3_over_data_parallel_times_sequence_parallel_ranks_trains_as_ddp_on_whole_sequences():
    """Parameters, gradients and optimizer state sharded over the 4 ranks together (stage 3)."""
    for res in run_ranks(_grid_rank, 4, (3,), timeout_s=360):
        ref_losses, ref_norms, ref_state = res["ref"]
        losses, norms, state = res["split"]
        close(losses, ref_losses, "losses")
        close(norms, ref_norms, "pre-clip norms")
        close(state, ref_state, "weights")


def _t5_run(split: bool):
    from lightning_zero.sequence_parallel import apply_sequence_parallel

    model = t5()
    opt = _optimizer(model)
    sharding = apply_sequence_parallel(model) if split else None
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3)) if split else None
    losses = []
    for step in range(STEPS):
        batch = t5_batch(19, seed=step)
        loss = model(**(sharding.shard_batch(batch) if split else batch)).loss
        loss.backward()
        losses.append(loss.item())
        if split:
            engine.clip_grad_norm_(CLIP)
            engine.step()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    if split:
        engine.restore_fp32_module()
    return losses, _state(model)


def _t5_rank(rank, world):
    return {"ref": _t5_run(False), "split": _t5_run(True)}


@pytest.mark.timeout(400)
def test_zero3_trains_a_split_t5_as_one_process_on_whole_sequences():
    """T5's encoder split at S=2 under stage 3 (its units the T5Blocks: the relative bias's rows of each rank's
    heads read from the gathered unit)."""
    for res in run_ranks(_t5_rank, 2, timeout_s=360):
        close(res["split"][0], res["ref"][0], "losses")
        close(res["split"][1], res["ref"][1], "weights")
