"""Pipeline parallelism x ZeRO 1/2 (engine/pipeline/pipeline_zero.py) on a tiny HF GPT-2 cut between blocks.

Reference: the uncut GPT2LMHeadModel trained in this process on the same global batch, cut into the same
D x M micro-batches whose gradients are summed (plain torch AdamW, ``clip_grad_norm_``, accumulation by
summing loss / (D * M * accumulation)): what DDP over D ranks with M accumulation steps computes. The
micro-batch cut matters only through summation order, and only for GPT-2's key bias (its gradient is
analytically zero -- softmax ignores a per-query shift -- so AdamW turns float noise into updates of order
lr * noise / eps, ~1e-5 at lr 1e-2 against 3e-7 for every other weight): hence the reference shares the cut,
and lr is 1e-3. Per-step losses and final weights at rtol 1e-5; GPipe, 1F1B and interleaved 1F1B; P2 x DP2
checkpoints resumed at P2 x DP1 and consolidated into the model's own state dict.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_zero.engine import ZeroConfig
from lightning_zero.engine.comm import collectives
from lightning_zero.checkpoint.pipeline_dir import (consolidate_pipeline_checkpoint, load_pipeline_checkpoint,
                                                    save_pipeline_checkpoint)
from lightning_zero.engine.pipeline.pipeline_zero import PipelineZero, check_pipeline_size, estimate_stage_states, pipeline_layout
from lightning_zero.engine.pipeline.split import split_gpt2
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import is_close as _close
from tests.helpers.pipeline_gpt2 import (BATCH, M, ACCUM, CALLS, RTOL,
    gpt2_model as _model, lm_loss as _loss, global_batch as _batch, adamw as _optimizer,
    single_process_reference as _reference, make_pipeline as _pipeline, train_pipeline as _train,
    named_state as _named)


def _parity_2(rank, world_size):
    out = {}
    for stage, schedule in ((1, "1f1b"), (1, "interleaved"), (2, "1f1b"), (2, "gpipe")):
        pipe = _pipeline(2, stage, schedule)
        out[stage, schedule] = (_train(pipe, CALLS), _named(pipe), float(pipe.last_grad_norm))
    return out


@pytest.mark.timeout(120)
def test_p2_matches_single_process_all_schedules():
    ref_losses, ref_sd = _reference([1] * CALLS)
    results = run_distributed(_parity_2, 2)
    merged = {}
    for key in results[0]:
        merged[key] = stage_sds = {}
        for r, res in enumerate(results):
            losses, sd, _ = res[key]
            assert losses == pytest.approx(ref_losses, rel=RTOL), (key, r)
            stage_sds.update(sd)
        assert set(stage_sds) == set(ref_sd), key  # the ranks' stages together name the whole model
        bad = [k for k in ref_sd if not _close(stage_sds[k], ref_sd[k])]
        assert not bad, (key, bad)
        # the clip used one global norm: the same on every rank
        assert results[0][key][2] == pytest.approx(results[1][key][2], rel=1e-6), key
    for key in merged:  # GPipe, 1F1B and interleaved 1F1B: the same weights
        assert all(_close(merged[key][k], merged[2, "1f1b"][k]) for k in ref_sd), key


def _p2dp2(rank, world_size, path):
    out = {}
    for stage in (1, 2):
        pipe = _pipeline(2, stage, "1f1b", grad_reduce="reduce_scatter")  # NCCL's path: counted below
        groups = len(torch.distributed.distributed_c10d._world.pg_names)
        collectives.stats.reset()
        losses = _train(pipe, 4)  # two optimizer steps
        calls = dict(collectives.stats.group_calls)
        if stage == 2:
            save_pipeline_checkpoint(pipe, os.path.join(path, "mid"))
        out[stage] = (losses, _named(pipe), calls, len(pipe.engine.buckets), groups,
                      pipe.engine.memory_report().as_dict(), pipe.layout.stage_index)
    return out


def _resume_dp1(rank, world_size, path):
    pipe = _pipeline(2, 2, "1f1b")
    load_pipeline_checkpoint(pipe, os.path.join(path, "mid"))
    rows = BATCH
    losses = []
    for call in range(4, CALLS):
        ids = _batch(call)[:rows]
        losses.append(pipe.step(ids, ids).item())
    save_pipeline_checkpoint(pipe, os.path.join(path, "end"))
    return losses


@pytest.mark.timeout(180)
def test_p2_dp2_zero1_zero2_and_resume_at_dp1(tmp_path):
    ref_losses, ref_sd = _reference([2] * 4 + [1] * (CALLS - 4))  # P2 x DP2, then resumed at P2 x DP1
    mid_losses, mid_sd = _reference([2] * 4)
    results = run_distributed(_p2dp2, 4, str(tmp_path))
    whole = _model()
    numels = [sum(p.numel() for p in split_gpt2(whole, 2, i).parameters()) for i in range(2)]
    for stage in (1, 2):
        merged = {}
        for r, res in enumerate(results):
            losses, sd, calls, buckets, groups, mem, index = res[stage]
            assert losses == pytest.approx(mid_losses, rel=RTOL), (stage, r)
            merged.update(sd)
            # stage 1 reduces once per optimizer step (the boundary micro-batch), stage 2 every micro-batch
            per_step = 1 if stage == 1 else ACCUM * M
            assert calls[("data_parallel", "reduce_scatter")] == buckets * per_step * 2, (stage, calls)
            # the global norm: one all-reduce of the stages' squared norms per optimizer step
            assert calls[("pipeline_parallel", "all_reduce")] == 2, calls
            assert groups == results[r][1][4]  # the second pipeline made no new group
            # a rank holds its stage's parameters only, and a 1/D shard of their optimizer state
            floor = estimate_stage_states(numels, 4, stage)[index]
            assert mem["params"] == floor["params"]
            got = mem["optimizer_state"] + mem["master"]
            assert abs(got - floor["optimizer"]) <= 0.05 * floor["optimizer"], (mem, floor)
        bad = [k for k in mid_sd if not _close(merged[k], mid_sd[k])]
        assert not bad, (stage, bad)
    saved = consolidate_pipeline_checkpoint(str(tmp_path / "mid"))
    assert set(saved) == set(mid_sd) and all(_close(saved[k], mid_sd[k]) for k in mid_sd)
    resumed = run_distributed(_resume_dp1, 2, str(tmp_path))
    for losses in resumed:
        assert losses == pytest.approx(ref_losses[4:], rel=RTOL)
    final = consolidate_pipeline_checkpoint(str(tmp_path / "end"))
    assert set(final) == set(ref_sd)
    bad = [k for k in ref_sd if not _close(final[k], ref_sd[k])]
    assert not bad, bad


def _errors(rank, world_size):
    msgs = []
    lay = pipeline_layout(2)
    module = split_gpt2(_model(), 2, lay.stage_index, starts=[0, 1])  # stage 1: 3 blocks + head
    for bad in (dict(max_imbalance=1.5), dict(empty=True)):
        m = torch.nn.Linear(1, 1, bias=False).requires_grad_(False) if bad.pop("empty", False) \
            and lay.stage_index == 1 else module
        try:
            PipelineZero(m, 2, _loss, _optimizer([p for p in module.parameters()]), M, **bad)
        except ValueError as e:
            msgs.append(str(e))
    pipe = _pipeline(2, 1, "1f1b")
    ids = _batch(0)[:3]
    try:
        pipe.step(ids, ids)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


@pytest.mark.timeout(60)
def test_bad_splits_get_one_clear_error():
    with pytest.raises(ValueError, match="does not divide the world of 4 rank.*Allowed: 1, 2, 4"):
        check_pipeline_size(3, 4)
    for r, msgs in enumerate(run_distributed(_errors, 2)):
        assert len(msgs) == 3, msgs
        assert "unbalanced" in msgs[0] and "max_imbalance=1.5" in msgs[0]
        assert "stage(s) [1] have no trainable parameters" in msgs[1]
        assert "does not split into microbatches=2" in msgs[2]
    with pytest.raises(ValueError, match="Allowed stages with pipeline parallelism: 0, 1, 2"):
        PipelineZero(torch.nn.Linear(2, 2), 1, _loss, None, 2, config=ZeroConfig(stage=3))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        m = _model()
        m.config.tie_word_embeddings = True
        split_gpt2(m, 2, 0)


def _overflow(rank, world_size):
    pipe = _pipeline(2, 2, "1f1b", check_finite=True)
    poison = {"on": False}
    if pipe.layout.is_first:  # an inf in one stage's gradient only
        next(pipe.module.parameters()).register_hook(lambda g: g * float("inf") if poison["on"] else g)
    ids = _batch(0)
    pipe.step(ids, ids)
    poison["on"] = True
    before = {k: v.clone() for k, v in pipe.module.state_dict().items()}
    pipe.step(ids, ids)  # the boundary: stage 0 overflows
    skipped = pipe.last_step_skipped
    same = all(torch.equal(before[k], v) for k, v in pipe.module.state_dict().items())
    poison["on"] = False
    pipe.step(ids, ids)
    pipe.step(ids, ids)
    moved = not all(torch.equal(before[k], v) for k, v in pipe.module.state_dict().items())
    return skipped, same, pipe.last_step_skipped, moved


@pytest.mark.timeout(60)
def test_overflow_in_one_stage_skips_the_step_on_every_stage():
    for r, (skipped, same, later_skipped, moved) in enumerate(run_distributed(_overflow, 2)):
        assert skipped and same, r  # stage 1's gradients are finite, yet it skips with stage 0
        assert not later_skipped and moved, r
    with pytest.raises(ValueError, match="need schedule='interleaved' and one optimizer per chunk"):
        chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        PipelineZero(chunks, 1, _loss, [_optimizer(c.parameters()) for c in chunks], 2, schedule="1f1b")


def _fp16(rank, world_size):
    from lightning_zero.engine import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2.0**18, hysteresis=1)
    pipe = _pipeline(2, 2, "1f1b", compute_dtype=torch.float16, loss_scaler=scaler)
    return _train(pipe, CALLS), pipe.engine.loss_scale, pipe.engine.skipped_steps


@pytest.mark.timeout(60)
def test_fp16_loss_scaler_decides_for_all_stages():
    ref_losses, _ = _reference([1] * CALLS)
    (losses, scale, skipped), other = run_distributed(_fp16, 2)
    assert other == (losses, scale, skipped)  # both stages: the same skips, the same scale, the same losses
    assert 1 <= skipped < CALLS // ACCUM and scale < 2.0**18  # fp16 gradients overflowed at first, then trained
    # the loss is scaled in fp32: fp16 (max 65504) would overflow at 4.2 x 2**18 and report inf
    assert losses == pytest.approx(ref_losses, rel=2e-3)
