"""Tensor parallelism composed with ZeRO: TP=2 x DP=2 on 4 gloo ranks against torch DDP of the unsharded model.

The TP model is a GPT-2-style block cut by torch's ColwiseParallel / RowwiseParallel over the mesh's
"tensor_parallel" dim; ZeRO shards each parameter's local piece over "data_parallel". The reference is DDP
over the data-parallel group on the whole model, each DP rank on its rows of the same global batch.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.layout import tensor_parallel as TPM
from tests.helpers.dist_utils import clip_and_step, run_distributed
from tests.helpers.parity import TP_FP32, close
from tests.helpers.tp_models import CLIP, T, dp_batch, full_state, lm_loss, make_gpt, parallelize
from tests.helpers.tp_models import engine_step
from tests.helpers.tp_models import fit_tp as _fit_tp
from tests.helpers.tp_models import tp_mesh as _mesh

_close = functools.partial(close, tol=TP_FP32)

STEPS = 3
CASES = {  # name -> (ZeroConfig keywords, accumulation, clip)
    "zero1": (dict(stage=1, grad_reduce="reduce_scatter"), 2, CLIP),
    "zero2": (dict(stage=2), 2, CLIP),
    "zero2_overlap": (dict(stage=2, overlap_publish=True, bucket_mb=0.001), 2, CLIP),
    "zero0": (dict(stage=0), 2, CLIP),
    "zero2_offload": (dict(stage=2, offload_optimizer=True, grad_reduce="reduce_scatter"), 2, CLIP),
}


def _train(rank, world_size, cfg, accum, clip, mesh, compute_dtype=None):
    """ZeRO on the TP model (``cfg``) or DDP on the whole model (``cfg=None``): losses, norms, full weights."""
    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    model = make_gpt()
    if cfg is not None:
        parallelize(model, mesh["tensor_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    if cfg is not None:
        engine = ZeroEngine(model, opt, ZeroConfig(**cfg), compute_dtype=compute_dtype, device_mesh=mesh)
        runner = model
    else:
        runner = DDP(model, process_group=mesh.get_group("data_parallel"))
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(accum):
            ctx = torch.enable_grad()
            if micro < accum - 1:
                ctx = engine.no_sync() if cfg is not None else runner.no_sync()
            with ctx:
                loss = lm_loss(runner, dp_batch(step, micro, dp_rank, dp_size)) / accum
                loss.backward()
            losses.append(loss.item())
        clip_and_step(engine if cfg is not None else None, model, opt, clip, norms)
    extra = {}
    if cfg is not None:
        extra["memory"] = engine.memory_report().as_dict()
        extra["local_numel"] = sum(TPM.local(p).numel() for p in model.parameters())
        extra["sharded"] = sorted(n for n, p in model.named_parameters() if TPM.is_dtensor(p))
        engine.restore_fp32_module()  # mixed precision: the DTensors take their fp32 masters back
        extra["dtype"] = (type(model.block.q.weight).__name__, model.block.q.weight.dtype)
    return losses, norms, full_state(model), extra


def _engine_errors(mesh):
    """The message of each refused engine construction (4 ranks: the mesh exists)."""
    def error(make):
        try:
            make()
        except ValueError as e:
            return str(e)
        return None

    def engine(cfg, parallel=True, **kw):
        model = make_gpt()
        if parallel:
            parallelize(model, mesh["tensor_parallel"])
        return ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, **kw)

    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("data_parallel",))
    return {
        "stage3": error(lambda: engine(ZeroConfig(stage=3), device_mesh=mesh)),
        "no_mesh": error(lambda: engine(ZeroConfig(stage=2))),
        "group": error(lambda: engine(ZeroConfig(stage=2), device_mesh=mesh, group=mesh.get_group(0))),
        "hybrid": error(lambda: engine(ZeroConfig(stage=2, shard_group_size=4), device_mesh=mesh)),
        "flat_mesh": error(lambda: engine(ZeroConfig(stage=2), parallel=False, device_mesh=flat)),
        "wrong_dim": error(lambda: ZeroEngine(parallelize(make_gpt(), mesh["data_parallel"]), None,
                                              ZeroConfig(stage=2), device_mesh=mesh)),
    }


def _matrix(rank, world_size):
    mesh = _mesh(world_size)
    out = {"errors": _engine_errors(mesh)}
    refs = {}
    for name, (cfg, accum, clip) in CASES.items():
        key = (accum, clip)
        if key not in refs:
            refs[key] = _train(rank, world_size, None, accum, clip, mesh)
        out[name] = (refs[key], _train(rank, world_size, cfg, accum, clip, mesh))
    bf16 = _train(rank, world_size, dict(stage=2, reduce_dtype="fp32"), 2, CLIP, mesh, torch.bfloat16)
    out["bf16"] = (refs[(2, CLIP)], bf16, None)
    return out


@functools.lru_cache(maxsize=None)
def results():
    return run_distributed(_matrix, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_tp_engine_matches_ddp(name):
    for rank, res in enumerate(results()):
        (rl, rn, rp, _), (zl, zn, zp, extra) = res[name]
        _close(zl, rl)
        assert zp.keys() == rp.keys()
        for k in rp:
            _close(zp[k], rp[k])
        assert "block.q.weight" in extra["sharded"] and "ln_f.weight" not in extra["sharded"]


@pytest.mark.timeout(120)
def test_tp_bf16_trains_close_to_fp32_ddp():
    """bf16 compute, fp32 masters: the same run within bf16 rounding, handed back as fp32 DTensors."""
    for res in results():
        (rl, rn, rp, _), (zl, zn, zp, extra), _ = res["bf16"]
        assert extra["dtype"] == ("DTensor", torch.float32)
        torch.testing.assert_close(torch.tensor(zl), torch.tensor(rl), rtol=0, atol=0.03)
        torch.testing.assert_close(torch.tensor(zn), torch.tensor(rn), rtol=0.03, atol=0)
        for k in rp:  # per tensor, relative to its norm (Adam moves single near-cancelling elements more)
            assert (zp[k] - rp[k]).norm() <= 0.02 * rp[k].norm(), k


@pytest.mark.timeout(120)
def test_tp_global_norm_equals_unsharded_norm():
    """Sharded pieces add over TP, replicated parameters (LayerNorms, row-parallel biases) count once."""
    for res in results():
        for name in ("zero1", "zero2", "zero0"):
            (_, rn, _, _), (_, zn, _, _) = res[name]
            assert len(zn) == len(rn) == 3 and min(rn) > 4 * CLIP  # clipping is active
            _close(zn, rn)


@pytest.mark.timeout(120)
def test_tp_memory_report_counts_local_pieces():
    for res in results():
        _, (_, _, _, extra) = res["zero2"]
        n = extra["local_numel"]
        mem = extra["memory"]
        assert mem["params"] == 4 * n  # fp32 local pieces, not the global shapes
        # AdamW: two fp32 moments of this rank's slice of every local piece (about n / DP each)
        assert n * 8 // 2 <= mem["optimizer_state"] <= (n + 64) * 8 // 2


# -- Lightning --------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_lightning_tensor_parallel_matches_ddp(tmp_path):
    """ZeroStrategy(stage=2, tensor_parallel_size=2) on 4 ranks equals ddp_fork on 2 (the DP ranks' data)."""
    from lightning_zero import ZeroStrategy

    ref, ref_val = _fit_tp(tmp_path, "ddp", "ddp_fork", 2, False)
    zero, zero_val = _fit_tp(tmp_path, "zero", ZeroStrategy(stage=2, tensor_parallel_size=2, start_method="fork"), 4,
                             True)
    _close(zero_val, ref_val)
    for rank, z in enumerate(zero):
        r = ref[rank // T]  # ranks (d, 0) and (d, 1) of the (DP, TP) mesh are DDP's rank d
        assert z["sampler"] == {"num_replicas": 2, "rank": rank // T}
        _close(z["losses"], r["losses"])
        for k in r["params"]:
            _close(z["params"][k], r["params"][k])
    from lightning_zero.checkpoint.consolidate import consolidate  # the checkpoint the TP fit wrote

    consolidate(tmp_path / "zero_ckpts" / "last.ckpt", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt")
    for k in ref[0]["params"]:
        _close(full["net." + k], ref[0]["params"][k])  # the LightningModule holds the model as .net


@pytest.mark.timeout(120)
def test_engine_refuses_what_it_cannot_do():
    errors = results()[0]["errors"]
    assert "Allowed stages with tensor parallelism: 0, 1, 2" in errors["stage3"]
    assert "pass device_mesh=" in errors["no_mesh"]
    assert "device_mesh and group are exclusive" in errors["group"]
    assert ("shard_group_size=4 does not divide the 2 data-parallel rank(s) (world 4 / tensor_parallel_size 2) into "
            "equal shard groups. Allowed: 1, 2 or None (all 2 data-parallel ranks).") == errors["hybrid"]
    assert "2-D DeviceMesh with mesh_dim_names ('data_parallel', 'tensor_parallel')" in errors["flat_mesh"]
    assert "Parameter 'block.q.weight' is a DTensor on mesh ('data_parallel',)" in errors["wrong_dim"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=3, tensor_parallel_size=2), "Allowed stages with tensor parallelism: 0, 1, 2"),
    (dict(stage=1, tensor_parallel_size=2, pipeline_parallel_size=2), "cannot be combined with pipeline_parallel_size"),
    (dict(stage=2, tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
    (dict(stage=2, tensor_parallel_size="2"), "tensor_parallel_size must be an int >= 1"),
    (dict(stage=2, tensor_parallel_size=2, checkpoint_format="full"), "Allowed: checkpoint_format='sharded'"),
])
def test_strategy_refuses_bad_tensor_parallel_settings(kwargs, message):
    from lightning_zero import ZeroPipelineStrategy, ZeroStrategy

    with pytest.raises(ValueError, match=message):
        (ZeroPipelineStrategy if "pipeline_parallel_size" in kwargs else ZeroStrategy)(**kwargs)


def test_tensor_parallel_size_must_divide_the_world():
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the world of 4 rank\(s\). "
                                         r"Allowed: 1, 2, 4."):
        ZeroStrategy(stage=2, tensor_parallel_size=3).tensor_parallel.build(4, torch.device("cpu"))
    with pytest.raises(AttributeError, match="tensor_parallel_size=T only"):
        ZeroStrategy(stage=2).device_mesh


def test_hydra_key_reaches_the_strategy():
    from tests.helpers.hydra_recipe import compose_recipe  # puts examples/ on sys.path (not a package)
    from t5_config import build_strategy

    assert build_strategy(compose_recipe("strategy=zero2", "strategy.tensor_parallel_size=2")).tensor_parallel.size == 2
    assert build_strategy(compose_recipe("strategy=zero2")).tensor_parallel is None
    with pytest.raises(ValueError, match="Allowed stages with tensor parallelism"):
        build_strategy(compose_recipe("strategy=zero3", "strategy.tensor_parallel_size=2"))


# -- checkpoints ------------------------------------------------------------------------------------------
def _ckpt_engine(mesh, stage, tensor_parallel, seed=1):
    model = make_gpt(seed)  # loaders (seed 1) start from other values than the saved run (seed 0)
    if tensor_parallel:
        parallelize(model, mesh["tensor_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    kw = dict(device_mesh=mesh) if tensor_parallel else {}
    return model, ZeroEngine(model, opt, ZeroConfig(stage=stage), **kw)


def _save_tp(rank, world_size, path):
    """Train 2 steps at TP2 x DP2, save, then step 3; reload the checkpoint at TP2 x DP2 (stage 1) and step 3;
    load it at DP4 without TP, save that as a flat checkpoint and load the flat one at TP2 x DP2 again."""
    from lightning_zero.checkpoint.format import load_checkpoint_dir, save_engine_checkpoint

    mesh = _mesh(world_size)
    dp = mesh.get_local_rank("data_parallel"), mesh.size(0)
    model, engine = _ckpt_engine(mesh, 2, True, seed=0)
    for step in range(2):
        engine_step(model, engine, step, *dp)
    save_engine_checkpoint(path, model, engine)
    saved = full_state(model)
    loss3 = engine_step(model, engine, 2, *dp)
    after = full_state(model)
    model2, engine2 = _ckpt_engine(mesh, 1, True)
    load_checkpoint_dir(path, model2, engine2)
    loaded = full_state(model2)
    reloss3 = engine_step(model2, engine2, 2, *dp)
    model3, engine3 = _ckpt_engine(mesh, 2, True)  # a full state dict (global tensors) into a TP engine
    engine3.load_full_state_dict(saved)
    with pytest.raises(NotImplementedError, match="Allowed: sharded checkpoints"):
        engine3.optimizer_state_dict()
    plain, plain_engine = _ckpt_engine(None, 2, False)  # DP4, no TP, and back through a flat checkpoint
    load_checkpoint_dir(path, plain, plain_engine)
    save_engine_checkpoint(f"{path}.flat", plain, plain_engine)
    model4, engine4 = _ckpt_engine(mesh, 2, True)
    load_checkpoint_dir(f"{path}.flat", model4, engine4)
    loaded4 = full_state(model4)
    engine_step(model4, engine4, 2, *dp)
    return (saved, after, loss3, loaded, full_state(model2), reloss3, full_state(model3),
            {k: v.clone() for k, v in plain.state_dict().items()}, loaded4, full_state(model4))


def _resume_plain(rank, world_size, path, stage):
    """The TP checkpoint at DP=world_size without tensor parallelism: loaded values, then step 3."""
    from lightning_zero.checkpoint.format import load_checkpoint_dir

    model, engine = _ckpt_engine(None, stage, False)
    load_checkpoint_dir(path, model, engine)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    loss3 = engine_step(model, engine, 2, rank, world_size)
    return loaded, {k: v.clone() for k, v in model.state_dict().items()}, loss3


@pytest.mark.timeout(150)
def test_tp_checkpoint_loads_without_tp_and_on_one_rank(tmp_path):
    from lightning_zero.checkpoint.consolidate import consolidate

    path = tmp_path / "tp.ckpt"
    tp = run_distributed(_save_tp, 4, path)
    saved, after, loss3 = tp[0][:3]
    for r in tp:  # every rank gathers the same global values
        for k in saved:
            _close(r[0][k], saved[k])
            _close(r[1][k], after[k])
        for k in saved:  # TP2 x DP2 -> TP2 x DP2 (stage 2 -> 1): same values, same next step
            _close(r[3][k], saved[k])
            _close(r[4][k], after[k])
            _close(r[6][k], saved[k])
            _close(r[7][k], saved[k])  # TP2 x DP2 -> DP4
            _close(r[8][k], saved[k])  # DP4 (flat) -> TP2 x DP2: values, and the moments for the next step
            _close(r[9][k], after[k])
    info = json.loads((path / "zero_checkpoint.json").read_text())
    assert info["layout"] == "natural" and info["tensors"]["block.q.weight"]["shape"] == [16, 16]
    assert "layout" not in json.loads((tmp_path / "tp.ckpt.flat" / "zero_checkpoint.json").read_text())
    for world, stage in ((2, 1), (1, 2)):  # TP1 x DP2, and one rank
        for rank, (loaded, stepped, l3) in enumerate(run_distributed(_resume_plain, world, path, stage)):
            for k in saved:
                _close(loaded[k], saved[k])
                _close(stepped[k], after[k])  # the optimizer state came along: the next step is the same
            if world == 2:
                _close(l3, tp[2 * rank][2])  # DP rank r of the TP run saw the same rows
    consolidate(path, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt")
    assert full.keys() == saved.keys()
    for k in saved:
        _close(full[k], saved[k])
