"""Tensor parallelism x hybrid sharding: T=2 and shard groups of K=2 inside D=4 data-parallel ranks (2 replicas).

The smallest genuinely hybrid TP layout is 8 ranks: (D=4, T=2) with K=2 gives two shard groups and two
replicas per data-parallel group; tests/tp_models' TinyGPT keeps 8 forked gloo ranks fast (a few seconds per
run). The reference is torch DDP of the whole model over the mesh's data-parallel group (each DP rank on its
rows of the same global batch), as in tests/test_tensor_parallel.py: stages 0-2 (and offload), clipping,
accumulation, a BatchNorm's buffers, the groups each collective ran over, the estimator's bytes, an overflow on
one rank; the Trainer and Fabric; checkpoints saved at TP x hybrid resumed at TP only, at 4 ranks and without
TP; a K that does not divide N / T refused with the allowed ones, before any process starts.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm import collectives
from tests.helpers.dist_utils import clip_and_step, run_distributed
from tests.helpers.parity import TP_FP32, close
from tests.helpers.tp_models import CLIP, DIM, T, TinyGPT, dp_batch, full_state, lm_loss, make_gpt, parallelize
from tests.helpers.tp_models import engine_step, fabric_step, fit_tp, tp_mesh

_close = functools.partial(close, tol=TP_FP32)

WORLD, K, STEPS, ACCUM = 8, 2, 3, 2
CASES = {  # name -> ZeroConfig keywords; tiny buckets: several per step
    "zero0": dict(stage=0),  # shards nothing: K changes nothing
    "zero1": dict(stage=1, grad_reduce="reduce_scatter"),
    "zero2": dict(stage=2),
    "zero2_offload": dict(stage=2, offload_optimizer=True, offload_kernel="user"),
}


class BufferedGPT(TinyGPT):
    """TinyGPT with a BatchNorm over the embeddings: running statistics that differ by data-parallel rank
    until DDP's rule broadcasts the first data-parallel rank's over the whole data-parallel group."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        return self.head(self.ln_f(self.block(h)))


def _make() -> BufferedGPT:
    torch.manual_seed(0)  # TinyGPT's draws as make_gpt's; the BatchNorm draws none
    return BufferedGPT()


def _train(mesh, cfg):
    """ZeRO at TP x hybrid (``cfg``) or DDP of the whole model (``cfg=None``), ACCUM micro-batches, clipped:
    losses, pre-clip norms, full weights and (ZeRO) what went over which group."""
    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    model = _make()
    if cfg is not None:
        parallelize(model, mesh["tensor_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    engine = runner = None
    if cfg is not None:
        engine = ZeroEngine(model, opt, ZeroConfig(shard_group_size=K, bucket_mb=0.0004, **cfg), device_mesh=mesh)
        runner = model
    else:
        runner = DDP(model, process_group=mesh.get_group("data_parallel"))
    collectives.stats.reset()
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            ctx = (engine.no_sync() if engine else runner.no_sync()) if micro < ACCUM - 1 else torch.enable_grad()
            with ctx:
                if engine is not None:  # DDP's buffer broadcast rule (Trainer and Fabric call it themselves)
                    engine.prepare_forward()
                loss = lm_loss(runner, dp_batch(step, micro, dp_rank, dp_size)) / ACCUM
                loss.backward()
            losses.append(loss.item())
        clip_and_step(engine, model, opt, CLIP, norms)
    extra = {}
    if engine is not None and engine.replicate_group is not None:
        extra = {"calls": dict(collectives.stats.group_calls), "buckets": len(engine.buckets),
                 "spec_sizes": {s.world_size for b in engine.buckets for s in b.specs},
                 "shard": dist.get_process_group_ranks(engine.shard_group),
                 "replicate": dist.get_process_group_ranks(engine.replicate_group),
                 "process_groups": len(dist.distributed_c10d._world.pg_names)}
    return losses, norms, full_state(model), extra


def _bad_k(mesh, size):
    model = parallelize(make_gpt(), mesh["tensor_parallel"])
    try:
        ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2, shard_group_size=size),
                   device_mesh=mesh)
    except ValueError as err:
        return str(err)
    return None


def _estimate_vs_engine(mesh):
    """Per stage: the estimator's model states at T=2, K=2 on 8 ranks (nothing run) and the engine's report,
    measured as tests/test_tp_states.py does (after a step and an un-synced micro-batch)."""
    from lightning_zero.tools.estimate import estimate_model_states
    from tests.helpers.tp_models import tp_plan

    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    out = {}
    for stage in (1, 2):
        est = estimate_model_states(make_gpt(), WORLD, precision="32-true", grad_accumulation=2,
                                    settings=[f"zero{stage}"], tensor_parallel_size=T, tensor_parallel_plan=tp_plan(),
                                    shard_group_size=K)
        model = parallelize(make_gpt(), mesh["tensor_parallel"])
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()),
                            ZeroConfig(stage=stage, shard_group_size=K, bucket_mb=0.001), device_mesh=mesh)
        lm_loss(model, dp_batch(0, 0, dp_rank, dp_size)).backward()
        engine.step()
        with engine.no_sync():
            lm_loss(model, dp_batch(0, 1, dp_rank, dp_size)).backward()
        out[stage] = (est.rows[0].states, est.rows[0].states_world, engine.memory_report().as_dict(), str(est))
        engine.remove()
    return out


def _overflow(rank, mesh):
    """A non-finite loss on the last rank only (second shard group, second replica, TP position 1)."""
    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    model = parallelize(make_gpt(), mesh["tensor_parallel"])
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2, shard_group_size=K),
                        device_mesh=mesh, check_finite=True)
    stepped = []
    for step in range(2):
        loss = lm_loss(model, dp_batch(step, 0, dp_rank, dp_size))
        (loss * float("inf") if step == 1 and rank == WORLD - 1 else loss).backward()
        stepped.append(engine.step())
    out = (stepped, full_state(model))
    engine.remove()
    return out


def _matrix(rank, world_size):
    mesh = tp_mesh(world_size)
    out = {"ref": _train(mesh, None)}
    for name, cfg in CASES.items():
        out[name] = _train(mesh, cfg)
    out["bad"] = {size: _bad_k(mesh, size) for size in (3, 8)}
    out["estimate"] = _estimate_vs_engine(mesh)
    out["overflow"] = _overflow(rank, mesh)
    return out


@functools.lru_cache(maxsize=None)
def results():
    return run_distributed(_matrix, WORLD)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CASES))
def test_tensor_hybrid_matches_ddp(name):
    """Losses, clipped norms and weights equal DDP's; gradients cross shard groups only in the replicate
    all-reduce (one per bucket per step, under accumulation too); every group is inside a DP group."""
    for rank, res in enumerate(results()):
        rl, rn, rp, _ = res["ref"]
        zl, zn, zp, extra = res[name]
        assert len(rn) == STEPS and min(rn) > 4 * CLIP  # clipping bites every step
        _close(zl, rl)
        _close(zn, rn)
        _close(zp, rp)  # the BatchNorm's running statistics too: broadcast over the whole DP group, as DDP's
        assert "bn.running_mean" in zp
        if name == "zero0":
            continue
        d, t = divmod(rank, T)  # rank d * T + t of the (D, T) mesh
        first = d - d % K
        assert extra["shard"] == [t + T * e for e in range(first, first + K)]
        assert extra["replicate"] == [t + T * e for e in range(d % K, WORLD // T, K)]
        assert extra["spec_sizes"] == {K}
        # made by the first hybrid engine only ([Note: why a group is never re-created])
        assert extra["process_groups"] == res["zero1"][3]["process_groups"]
        calls = extra["calls"]
        assert calls[("replicate", "all_reduce")] == extra["buckets"] * STEPS, calls
        assert calls[("shard", "all_gather")] > 0, calls  # the publish stays inside the shard group


@pytest.mark.timeout(240)
def test_overflow_on_one_rank_skips_the_step_everywhere():
    """The replicate all-reduce carries it across shard groups, the norm's TP sum across the TP group."""
    first = results()[0]["overflow"][1]
    for res in results():
        stepped, params = res["overflow"]
        assert stepped == [True, False]
        torch.testing.assert_close(params, first, rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_bad_shard_group_size_names_the_data_parallel_divisors():
    """K must divide the N/T data-parallel ranks: K=8 divides the world of 8 but not the 4 DP ranks."""
    for res in results():
        for size in (3, 8):
            msg = res["bad"][size]
            assert msg is not None and f"shard_group_size={size} does not divide the 4 data-parallel rank(s) " \
                "(world 8 / tensor_parallel_size 2)" in msg and "Allowed: 1, 2, 4 or None" in msg, msg


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2])
def test_estimator_equals_engine_bytes_under_tensor_hybrid(stage):
    """Exact: each rank's local pieces sharded over its K=2 shard group (not the 4 DP ranks, not the world)."""
    for res in results():
        est, at_dp, rep, text = res["estimate"][stage]
        assert est["params"] == rep["params"]
        assert est["grads"] == rep["grads"] + rep["grad_shards"]
        assert est["master"] == rep["master"] and est["optimizer_state"] == rep["optimizer_state"]
        assert est["device"] == rep["model_states"] - rep["host"]
        assert at_dp["optimizer_state"] * 2 == pytest.approx(est["optimizer_state"], rel=0.05)  # K = 4: half
        assert "ZeRO shards over 2 of the 4 data-parallel rank(s)" in text
        assert "replicated 2x); device states per rank at K=4 vs K=2" in text


# -- checkpoints ------------------------------------------------------------------------------------------
def _engine(mesh, stage, shard_group_size=None, seed=1):
    model = make_gpt(seed)  # loaders (seed 1) start from other values than the saved run (seed 0)
    if mesh is not None:
        parallelize(model, mesh["tensor_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    cfg = ZeroConfig(stage=stage, shard_group_size=shard_group_size)
    return model, ZeroEngine(model, opt, cfg, **(dict(device_mesh=mesh) if mesh is not None else {}))


def _dp(mesh, rank, world_size):
    return (mesh.get_local_rank("data_parallel"), mesh.size(0)) if mesh is not None else (rank, world_size)


def _save(rank, world_size, path):
    """Two steps at TP2 x hybrid (K=2, 2 replicas), save, step 3 (the uninterrupted run); then the checkpoint
    loaded on the same 8 ranks at TP2 only (no hybrid, stage 1) and its step 3."""
    from lightning_zero.checkpoint.format import load_checkpoint_dir, save_engine_checkpoint

    mesh = tp_mesh(world_size)
    model, engine = _engine(mesh, 2, K, seed=0)
    for step in range(2):
        engine_step(model, engine, step, *_dp(mesh, rank, world_size))
    save_engine_checkpoint(path, model, engine)
    saved = full_state(model)
    engine_step(model, engine, 2, *_dp(mesh, rank, world_size))
    after = full_state(model)
    model2, engine2 = _engine(mesh, 1)
    load_checkpoint_dir(path, model2, engine2)
    loaded = full_state(model2)
    save_engine_checkpoint(f"{path}.tp_only", model2, engine2)  # the same state, no replicas: the bytes to match
    engine_step(model2, engine2, 2, *_dp(mesh, rank, world_size))
    return saved, after, (loaded, full_state(model2))


def _resume(rank, world_size, path, tensor_parallel, stage, shard_group_size):
    """The TP x hybrid checkpoint at another layout: loaded values, then step 3."""
    from lightning_zero.checkpoint.format import load_checkpoint_dir

    mesh = tp_mesh(world_size) if tensor_parallel else None
    model, engine = _engine(mesh, stage, shard_group_size)
    load_checkpoint_dir(path, model, engine)
    loaded = full_state(model)
    engine_step(model, engine, 2, *_dp(mesh, rank, world_size))
    return loaded, full_state(model)


@pytest.mark.timeout(240)
def test_tensor_hybrid_checkpoint_resumes_at_other_layouts(tmp_path):
    """Saved at TP2 x K2 x 2 replicas (8 ranks): resumed at TP2 only (8 ranks), TP2 on 4 ranks and, without
    TP, hybrid K2 on 4 ranks, each equal to the uninterrupted run: values and the next step (moments)."""
    path = tmp_path / "tp_hybrid.ckpt"
    saved_runs = run_distributed(_save, WORLD, path)
    saved, after, _ = saved_runs[0]
    resumed = {"TP2, 8 ranks, stage 1": [r[2] for r in saved_runs],
               "TP2, 4 ranks": run_distributed(_resume, 4, path, True, 2, None),
               "no TP, 4 ranks, K=2, stage 1": run_distributed(_resume, 4, path, False, 1, K)}
    for r in saved_runs:  # every rank gathers the same global values
        _close(r[0], saved)
        _close(r[1], after)
    written = {p: sum(f.stat().st_size for f in p.glob("*.distcp")) for p in (path, tmp_path / f"{path.name}.tp_only")}
    assert len(set(written.values())) == 1, written  # the replicas' copies are written once
    for what, per_rank in resumed.items():
        for rank, (loaded, stepped) in enumerate(per_rank):
            _close(loaded, saved, f"{what} rank {rank} loaded")
            _close(stepped, after, f"{what} rank {rank} step 3")


# -- Lightning --------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_trainer_tensor_hybrid_matches_ddp(tmp_path):
    """ZeroStrategy(stage=2, tensor_parallel_size=2, shard_group_size=2) on 8 ranks equals ddp_fork on the 4
    data-parallel ranks: losses, weights, validation, and the checkpoint it wrote (consolidated)."""
    from lightning_zero import ZeroStrategy
    from lightning_zero.checkpoint.consolidate import consolidate

    ref, ref_val = fit_tp(tmp_path, "ddp", "ddp_fork", WORLD // T, False)
    strategy = ZeroStrategy(stage=2, tensor_parallel_size=T, shard_group_size=K, start_method="fork")
    zero, zero_val = fit_tp(tmp_path, "zero", strategy, WORLD, True)
    _close(zero_val, ref_val)
    for rank, z in enumerate(zero):
        r = ref[rank // T]  # ranks (d, 0) and (d, 1) of the (DP, TP) mesh are DDP's rank d
        assert z["sampler"] == {"num_replicas": WORLD // T, "rank": rank // T}
        d, t = divmod(rank, T)  # the engine Lightning built shards over K data-parallel ranks, replicates across
        assert z["groups"] == {"shard": [t + T * e for e in range(d - d % K, d - d % K + K)],
                               "replicate": [t + T * e for e in range(d % K, WORLD // T, K)]}, z["groups"]
        _close(z["losses"], r["losses"])
        _close(z["params"], r["params"])
    consolidate(tmp_path / "zero_ckpts" / "last.ckpt", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt")
    _close({k: full["net." + k] for k in ref[0]["params"]}, ref[0]["params"])  # the module holds the model as .net


@pytest.mark.parametrize("make", ["trainer", "fabric"])
def test_strategies_refuse_a_bad_shard_group_size_before_launch(make):
    """K=4 divides the world of 4 but not its 2 data-parallel ranks: one error, before any process starts."""
    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    knobs = dict(stage=2, tensor_parallel_size=2, shard_group_size=4)
    with pytest.raises(ValueError, match=r"^shard_group_size=4 does not divide the 2 data-parallel rank\(s\) \(world 4 "
                                         r"/ tensor_parallel_size 2\) into equal shard groups\. Allowed: 1, 2 or None "
                                         r"\(all 2 data-parallel ranks\)\.$"):
        if make == "trainer":
            from lightning.pytorch import Trainer

            Trainer(strategy=ZeroStrategy(**knobs), accelerator="cpu", devices=4, logger=False)
        else:
            from lightning.fabric import Fabric

            Fabric(strategy=ZeroFabricStrategy(**knobs), accelerator="cpu", devices=4)


def test_hydra_keys_reach_the_strategy():
    from tests.helpers.hydra_recipe import compose_recipe  # puts examples/ on sys.path (not a package)
    from t5_config import build_strategy

    strategy = build_strategy(compose_recipe("strategy=zero2", "strategy.tensor_parallel_size=2",
                                             "strategy.shard_group_size=2"))
    assert strategy.tensor_parallel.size == 2 and strategy.zero_config.shard_group_size == 2
    assert strategy.tensor_parallel.shard_group_size == 2


def _fabric_job(rank, world_size, tensor_parallel):
    """3 steps of 2 micro-batches, clipped, SGD with momentum, through Fabric: ZeroFabricStrategy(stage=1, T=2,
    K=2) when ``tensor_parallel``, else Fabric's DDP (the reference, on the data-parallel ranks)."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from lightning_zero import ZeroFabricStrategy
    from tests.helpers.tp_models import TokenRows

    strategy = (ZeroFabricStrategy(stage=1, tensor_parallel_size=T, shard_group_size=K,
                                   parallelize_fn=lambda m, mesh: parallelize(m, mesh["tensor_parallel"]))
                if tensor_parallel else "ddp")
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    model = fabric.setup_module(make_gpt())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    it = iter(fabric.setup_dataloaders(DataLoader(TokenRows(), batch_size=2, shuffle=False)))
    losses = [loss for _ in range(STEPS) for loss in fabric_step(fabric, model, opt, it)]
    return losses, full_state(model)


@pytest.mark.timeout(240)
def test_fabric_tensor_hybrid_matches_ddp():
    """ZeroFabricStrategy(stage=1, tensor_parallel_size=2, shard_group_size=2) on 8 ranks equals Fabric's DDP
    on the 4 data-parallel ranks (DP rank d = DDP rank d): losses and weights."""
    ref = run_distributed(_fabric_job, WORLD // T, False)
    for rank, (losses, params) in enumerate(run_distributed(_fabric_job, WORLD, True)):
        _close(losses, ref[rank // T][0])
        _close(params, ref[rank // T][1])
