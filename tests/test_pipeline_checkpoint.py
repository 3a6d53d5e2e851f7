"""Pipeline checkpoints as one sharded DCP directory per stage: each rank writes only its own slice (nothing
gathered), P2 x DP2 resumes at P2 x DP2 (ZeRO-1) and P2 x DP1 (ZeRO-0) as the uninterrupted run, the
directory consolidates into the uncut model's state dict, and interrupted saves keep the previous copy."""

from __future__ import annotations

import os
import shutil
import warnings
from collections import defaultdict

import pytest
import torch.distributed.checkpoint as dcp

from lightning_zero.checkpoint.pipeline_dir import (consolidate_pipeline_checkpoint, load_pipeline_checkpoint,
                                                    read_manifest, save_pipeline_checkpoint)
from lightning_zero.engine.comm import collectives
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import is_close
from tests.helpers.pipeline_gpt2 import (BATCH, CALLS, RTOL, global_batch as _batch, gpt2_model as _model,
    named_state as _named, make_pipeline as _pipeline, single_process_reference as _reference)

SAVED_AT = 4  # step() calls before the checkpoint: two optimizer steps


def _run(pipe, calls):
    lay, rows = pipe.layout, BATCH // pipe.layout.dp_size
    return [pipe.step(ids, ids).item() for ids in
            (_batch(c)[lay.dp_rank * rows:(lay.dp_rank + 1) * rows] for c in calls)]


def _save_at_dp2(rank, world_size, path):
    pipe = _pipeline(2, 2, "1f1b")  # ZeRO-2, P2 x DP2
    first = _run(pipe, range(SAVED_AT))
    collectives.stats.reset()
    save_pipeline_checkpoint(pipe, os.path.join(path, "mid"))
    save_calls = collectives.stats.total_calls
    slices = {n: (spec.lo, spec.hi) for n, _, spec, _ in pipe.engine.master_items()}
    uninterrupted = _run(pipe, range(SAVED_AT, CALLS))
    resumed = _pipeline(2, 1, "1f1b")  # the same P2 x DP2 at ZeRO-1, from the directory
    load_pipeline_checkpoint(resumed, os.path.join(path, "mid"))
    again = _run(resumed, range(SAVED_AT, CALLS))
    return {"first": first, "uninterrupted": uninterrupted, "resumed": again, "save_calls": save_calls,
            "slices": slices, "stage": pipe.layout.stage_index, "dp_rank": pipe.layout.dp_rank,
            "named": _named(resumed), "uninterrupted_named": _named(pipe)}


def _resume_at_dp1(rank, world_size, path):
    pipe = _pipeline(2, 0, "1f1b")  # ZeRO-0, P2 x DP1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load_pipeline_checkpoint(pipe, os.path.join(path, "mid"))  # only mid.zero-old exists: crashed between renames
    losses = _run(pipe, range(SAVED_AT, CALLS))
    real_save = dcp.save
    dcp.save = lambda *a, **kw: (_ for _ in ()).throw(OSError("disk full"))  # every rank fails while writing
    try:
        save_pipeline_checkpoint(pipe, os.path.join(path, "mid"))
        failed = False
    except OSError:
        failed = True
    finally:
        dcp.save = real_save
    try:  # one stage over both ranks: another pipeline shape
        load_pipeline_checkpoint(_pipeline(1, 0, "1f1b"), os.path.join(path, "mid"))
        shape_error = ""
    except ValueError as err:
        shape_error = str(err)
    return {"losses": losses, "warnings": [str(w.message) for w in seen], "failed": failed, "named": _named(pipe),
            "shape_error": shape_error}


def _close_sd(got, ref):
    assert set(got) == set(ref)
    bad = [k for k in ref if not is_close(got[k], ref[k])]
    assert not bad, bad


def _written_by_rank(stage_dir):
    """Per DCP file (one per writing rank: ``__<rank>_*.distcp``), the bytes and the (tensor, offset) slices."""
    meta = dcp.FileSystemReader(str(stage_dir)).read_metadata()
    nbytes, where = defaultdict(int), {}
    for index, info in meta.storage_data.items():
        writer = int(info.relative_path.split("_")[2])
        nbytes[writer] += info.length
        where[index.fqn, tuple(index.offset)] = writer
    return meta, nbytes, where


@pytest.mark.timeout(180)
def test_p2_dp2_checkpoint_is_sharded_and_resumes_at_dp2_and_dp1(tmp_path):
    # first: the forked ranks then inherit the imported transformers
    _, ref_mid = _reference([2] * SAVED_AT)
    ref_losses, ref_dp1_sd = _reference([2] * SAVED_AT + [1] * (CALLS - SAVED_AT))
    results = run_distributed(_save_at_dp2, 4, str(tmp_path))
    mid = tmp_path / "mid"
    manifest = read_manifest(mid)
    assert (manifest["pipeline_parallel_size"], manifest["chunks"], manifest["data_parallel_size"],
            manifest["zero_stage"]) == (2, 1, 2, 2)
    merged, uninterrupted = {}, {}
    for r, res in enumerate(results):
        assert res["first"] == pytest.approx(ref_losses[:SAVED_AT], rel=RTOL), r  # DDP's (single process) losses
        # the continued run from the directory (at another ZeRO stage) equals the uninterrupted one
        assert res["resumed"] == pytest.approx(res["uninterrupted"], rel=RTOL), r
        merged.update(res["named"])
        uninterrupted.update(res["uninterrupted_named"])
        assert res["save_calls"] == 0, res["save_calls"]  # saving ran no engine collective: nothing gathered
    _close_sd(merged, uninterrupted)
    # each stage's DCP metadata: every master and moment in two slices, each written by its own replica
    for stage in (0, 1):
        meta, nbytes, where = _written_by_rank(mid / f"stage{stage}")
        replicas = [res for res in results if res["stage"] == stage]
        for res in replicas:
            for name, (lo, hi) in res["slices"].items():
                for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
                    chunks = meta.state_dict_metadata[key].chunks
                    assert sorted(c.offsets[0] for c in chunks) == sorted(r["slices"][name][0] for r in replicas)
                    assert where[key, (lo,)] == res["dp_rank"], key
        total = sum(nbytes.values())
        assert len(nbytes) == 2 and max(nbytes.values()) <= 0.55 * total, dict(nbytes)
    # consolidated: the uncut model's own state dict, strict-loadable
    full = consolidate_pipeline_checkpoint(mid)
    _close_sd(full, ref_mid)
    _model().load_state_dict(full, strict=True)

    # a crash between the two renames of a later save: only mid.zero-old is left, and loads fall back to it
    os.rename(mid, tmp_path / "mid.zero-old")
    resumed = run_distributed(_resume_at_dp1, 2, str(tmp_path))
    merged = {}
    for res in resumed:
        assert any("interrupted while replacing it" in w for w in res["warnings"]), res["warnings"]
        assert res["losses"] == pytest.approx(ref_losses[SAVED_AT:], rel=RTOL)
        merged.update(res["named"])
        assert res["failed"]
        assert "pipeline_parallel_size=2 and 1 chunk(s) per rank; this run has 1 and 1. Allowed: resume with " \
               "the same pipeline shape" in res["shape_error"], res["shape_error"]
    _close_sd(merged, ref_dp1_sd)
    # the save that died while writing put the complete copy back under its name and left it as it was
    _close_sd(consolidate_pipeline_checkpoint(mid), ref_mid)
    # ... and removed its own partial temporary on the way out
    assert not (tmp_path / "mid.zero-tmp").exists() and not (tmp_path / "mid.zero-old").exists()


def test_not_a_pipeline_checkpoint_or_an_old_format_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is not a pipeline checkpoint directory.*Allowed: a directory written by"):
        read_manifest(tmp_path)
    old = tmp_path / "old"  # the per-stage .pt files of a development build
    old.mkdir()
    (old / "zero_checkpoint.json").write_text('{"format": "lightning_zero.pipeline", "version": 1}')
    with pytest.raises(ValueError, match="format version 1 .*Allowed: a checkpoint saved by this release"):
        consolidate_pipeline_checkpoint(old)
    shutil.rmtree(old)
