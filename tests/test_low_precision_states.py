"""bf16 optimizer states (engine/optim/low_precision.py): bf16 moments and Kahan-compensated bf16 masters at
stages 0-3 and with offload, equal to a one-process reference of the same algorithm written here from its
definition (fp32 value x = hi + lo, torch's optimizer on fp32 copies, hi = bf16(x), lo = bf16(x - hi), moments
rounded to nearest, lo toward zero); their bytes counted exactly; checkpoints in their dtype and converted across dtypes."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import transformers

from lightning_zero import checkpoint as ck
from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import run_distributed

BF16 = torch.bfloat16
STEPS = 4


def _gpt2() -> torch.nn.Module:
    torch.set_num_threads(1)  # the same kernels' summation order in every process (forked ranks and reference)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _batch(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 12), generator=torch.Generator().manual_seed(seed))


def _optimizer(name: str, params):
    if name == "sgd":  # lr x grad far below half a bf16 ulp of the weights: a plain bf16 master would never move
        return torch.optim.SGD(params, lr=2e-4, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def _toward_zero(d: torch.Tensor) -> torch.Tensor:
    """bf16 of an fp32 tensor rounded toward zero: its low 16 bits cut."""
    return (d.view(torch.int32) & -65536).view(torch.float32).to(BF16)


@functools.lru_cache(maxsize=None)
def same_batch_reference(opt_name: str, masters_bf16: bool):
    """The reference over batches 0..STEPS-1 (what every rank takes in the same-batch runs), computed once."""
    return one_process([_batch(s) for s in range(STEPS)], opt_name, masters_bf16, True)


def one_process(batches, opt_name: str, masters_bf16: bool, moments_bf16: bool):
    """:func:`reference` in a process of its own, single-threaded like the ranks."""
    return run_distributed(lambda rank, world: reference(batches, opt_name, masters_bf16, moments_bf16), 1)[0]


def reference(batches: list[torch.Tensor], opt_name: str, masters_bf16: bool, moments_bf16: bool):
    """One process, the whole batch, the algorithm from its definition: the fp32 master rebuilt from hi + lo,
    torch's optimizer on fp32 tensors, then split again / rounded. Returns (losses, published params)."""
    model = _gpt2()
    x0 = [p.detach().clone() for p in model.parameters()]
    if masters_bf16:
        model.to(BF16)
    params = list(model.parameters())
    work = [x.clone() for x in x0]  # the fp32 tensors the optimizer steps
    opt = _optimizer(opt_name, work)
    lo = [_toward_zero(x - p.detach().float()) for x, p in zip(x0, params)] if masters_bf16 else None
    kept: dict[tuple[int, str], torch.Tensor] = {}
    losses = []
    for ids in batches:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        for i, (w, p) in enumerate(zip(work, params)):
            w.grad = p.grad.float()
            if masters_bf16:
                w.data.copy_(p.detach().float() + lo[i].float())
            for key, v in opt.state.get(w, {}).items():
                if (i, key) in kept:
                    opt.state[w][key] = kept[(i, key)].float()
        opt.step()
        with torch.no_grad():
            for i, (w, p) in enumerate(zip(work, params)):
                if masters_bf16:
                    p.copy_(w)  # round to nearest: hi
                    lo[i] = _toward_zero(w - p.float())
                else:
                    p.copy_(w)
                if moments_bf16:
                    for key, v in opt.state[w].items():
                        if torch.is_tensor(v) and v.dim() > 0:
                            kept[(i, key)] = v.to(BF16)
    # the masters' values: hi + lo exactly (what the engine's full_master_params returns), else the parameters
    names = [n for n, _ in model.named_parameters()]
    values = [p.detach().float() + c.float() for p, c in zip(params, lo)] if masters_bf16 else params
    return losses, {n: v.detach().reshape(-1).clone() for n, v in zip(names, values)}


def _train_step(model, engine, ids: torch.Tensor) -> float:
    engine.prepare_forward()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    engine.step()
    return loss.item()


def _full_masters(model, engine) -> dict[str, torch.Tensor]:
    """The engine's fp32 master values by parameter name, flat."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: v.reshape(-1) for p, v in zip(engine.bucket_params, engine.full_master_params())}


def _run(rank, world, stage, opt_name, masters_bf16, offload, same_batch, nvme_path=None, shard_group_size=None):
    model = _gpt2()
    opt = _optimizer(opt_name, model.parameters())
    nvme = dict(nvme_path=nvme_path) if offload == "nvme" else {}
    nvme.update(shard_group_size=shard_group_size) if shard_group_size else None
    cfg = ZeroConfig(stage=stage, optimizer_state_dtype="bf16", master_dtype="bf16" if masters_bf16 else "fp32",
                     offload_optimizer=offload, offload_kernel="user", grad_reduce="all_to_all", **nvme,
                     **(dict(unit_classes=["GPT2Block"]) if stage == 3 else {}))
    engine = ZeroEngine(model, opt, cfg, compute_dtype=BF16 if masters_bf16 else None)
    losses = [_train_step(model, engine, _batch(step if same_batch else 100 * step + rank)) for step in range(STEPS)]
    s = engine.sharded
    dtypes = {str(v.dtype) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0}
    out = dict(losses=losses, dtypes=dtypes, state_bytes=s.state_bytes(), master_bytes=s.master_bytes(),
               slice_numel=sum(m.numel() for row in s.masters for m in row),
               aliased=all(s._aliased), comm_buffers=engine.memory_report().comm_buffers)
    out["params"] = _full_masters(model, engine)  # widens bf16 masters: after the bytes were counted
    engine.remove(hand_back=False)
    return out


CASES = [  # (stage, optimizer, bf16 masters, offload)
    (0, "adamw", True, False), (1, "adamw", True, False), (2, "adamw", True, False), (3, "adamw", True, False),
    (2, "adamw", True, True), (3, "adamw", True, True), (2, "adamw", True, "nvme"), (3, "adamw", False, "nvme"),
    (2, "sgd", True, False), (3, "sgd", True, False),
    (1, "adamw", False, False), (2, "adamw", False, True), (3, "adamw", False, False)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage,opt_name,masters_bf16,offload", CASES)
def test_bf16_states_equal_the_one_process_algorithm_bit_for_bit(stage, opt_name, masters_bf16, offload, tmp_path):
    """Every rank takes the same batch (the reduced gradient is then that batch's, exactly): the engine at 2 ranks
    is bit for bit the one-process algorithm -- losses, published parameters, and the states stay bf16 (on
    the device, in host memory, or streamed from NVMe scratch files)."""
    ref_losses, ref_params = same_batch_reference(opt_name, masters_bf16)
    for r in run_distributed(_run, 2, stage, opt_name, masters_bf16, offload, True, str(tmp_path)):
        assert r["losses"] == ref_losses
        assert r["dtypes"] == {"torch.bfloat16"}
        assert r["params"].keys() == ref_params.keys()
        for n, want in ref_params.items():
            assert torch.equal(r["params"][n], want), n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_with_bf16_states_is_the_algorithm_bit_for_bit(stage):
    """4 ranks, shards of 2 replicated twice (the same batch everywhere: a reduce-scatter of halves, then an
    all-reduce of halves, is that batch's gradient exactly)."""
    ref_losses, ref_params = same_batch_reference("adamw", True)
    for r in run_distributed(_run, 4, stage, "adamw", True, False, True, None, 2):
        assert r["losses"] == ref_losses
        assert all(torch.equal(r["params"][n], w) for n, w in ref_params.items())


def test_compensation_keeps_updates_below_a_bf16_ulp():
    """The SGD case above moves weights by ~2e-4 x grad a step, far below half a bf16 ulp of most weights: the
    compensated master moves them (the reference proves the engine equal); a plain bf16 master would not."""
    _, comp = same_batch_reference("sgd", True)
    model = _gpt2().to(BF16)
    plain = [p.detach().clone() for p in model.parameters()]
    moved = sum(int((c.to(BF16) != p.reshape(-1)).sum()) for c, p in zip(comp.values(), plain))
    opt = _optimizer("sgd", model.parameters())  # the plain bf16 master: torch's SGD on bf16 parameters
    for s in range(STEPS):
        ids = _batch(s)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    moved_plain = sum(int((p.detach() != q).sum()) for p, q in zip(model.parameters(), plain))
    assert moved > 2 * moved_plain, (moved, moved_plain)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_four_ranks_with_their_own_batches_match_the_algorithm_at_bf16_precision(stage):
    """Different batches per rank: the reduced gradient is the whole batch's up to summation order, so the
    engine equals the one-process algorithm on the concatenated batch to bf16 precision."""
    batches = [torch.cat([_batch(100 * s + r) for r in range(4)]) for s in range(STEPS)]
    ref_losses, ref_params = one_process(batches, "adamw", True, True)
    results = run_distributed(_run, 4, stage, "adamw", True, False, False)
    mean_losses = [sum(r["losses"][s] for r in results) / 4 for s in range(STEPS)]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-2)
    off, total = 0, 0
    for n, want in ref_params.items():
        got = results[0]["params"][n]
        assert (got - want).abs().max() <= 2 * 3e-3 * STEPS  # Adam: a gradient near zero may move +-lr a step
        off += int(((got - want).abs() > 2e-3 + 1.6e-2 * want.abs()).sum())
        total += want.numel()
    assert off <= total // 500, (off, total)  # the rest at bf16 precision


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_of_bf16_states_are_counted_exactly(stage):
    """Mixed precision with both knobs: the master is the bf16 parameter slice (no copy), only its 2-byte
    compensation is extra, and Adam's two moments are 2 bytes each; nothing kept in communication buffers."""
    for r in run_distributed(_run, 2, stage, "adamw", True, False, False):
        n = r["slice_numel"]
        assert r["aliased"]
        assert r["master_bytes"] == 2 * n
        assert r["state_bytes"] == 2 * 2 * n
        assert r["comm_buffers"] == 0


def _resume(rank, world, path, stage, masters_bf16, saved_masters_bf16):
    """Load the checkpoint ``_run`` saved after step 1 into a fresh engine and train steps 2-3."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("lightning_zero.checkpoint.load_dir").addHandler(handler)
    model = _gpt2()
    opt = _optimizer("adamw", model.parameters())
    states = "bf16" if masters_bf16 else "fp32"
    cfg = ZeroConfig(stage=stage, optimizer_state_dtype=states, master_dtype="bf16" if masters_bf16 else "fp32",
                     offload_kernel="user", grad_reduce="all_to_all",
                     **(dict(unit_classes=["GPT2Block"]) if stage == 3 else {}))
    engine = ZeroEngine(model, opt, cfg, compute_dtype=BF16)
    ck.load_checkpoint_dir(path, model, engine)
    loaded = {str(v.dtype) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0}
    masters = _full_masters(model, engine)
    losses = [_train_step(model, engine, _batch(100 * step + rank)) for step in range(2, STEPS)]
    out = dict(losses=losses, params=_full_masters(model, engine), loaded=loaded, masters=masters,
               notices=[m for m in records if "converted on load" in m])
    engine.remove(hand_back=False)
    return out


def _run_mixed(rank, world, stage, masters_bf16, path):
    """``_run`` in bf16 compute whatever the masters; saves after step 1."""
    model = _gpt2()
    opt = _optimizer("adamw", model.parameters())
    cfg = ZeroConfig(stage=stage, optimizer_state_dtype="bf16" if masters_bf16 else "fp32",
                     master_dtype="bf16" if masters_bf16 else "fp32", offload_kernel="user",
                     grad_reduce="all_to_all", **(dict(unit_classes=["GPT2Block"]) if stage == 3 else {}))
    engine = ZeroEngine(model, opt, cfg, compute_dtype=BF16)
    losses = []
    for step in range(STEPS):
        losses.append(_train_step(model, engine, _batch(100 * step + rank)))
        if step == 1:
            saved = _full_masters(model, engine)
            ck.save_engine_checkpoint(path, model, engine, {"step": step})
    out = dict(losses=losses[2:], params=_full_masters(model, engine), saved=saved)
    engine.remove(hand_back=False)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_bf16_state_checkpoint_resumes_bit_for_bit_and_keeps_its_dtype(stage, tmp_path):
    path = str(tmp_path / "ckpt")
    straight = run_distributed(_run_mixed, 2, stage, True, path)
    meta = ck.read_info(ck.resolve_checkpoint_dir(path))
    assert meta["state_dtypes"] == {"optimizer_state_dtype": "bf16", "master_dtype": "bf16"}
    for a, b in zip(straight, run_distributed(_resume, 2, path, stage, True, True)):
        assert b["loaded"] == {"torch.bfloat16"} and b["notices"] == []
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved_bf16", [False, True])
def test_checkpoints_convert_between_fp32_and_bf16_states_with_one_notice(saved_bf16, tmp_path):
    """fp32 states -> a bf16-state run and back: one notice on rank 0; the masters arrive converted exactly (an
    fp32 master split into hi = bf16(x) and lo = the rest toward zero; a bf16 checkpoint's hi + lo is an exact fp32
    value), the moments in the run's dtype, and training continues."""
    path = str(tmp_path / "ckpt")
    straight = run_distributed(_run_mixed, 2, 2, saved_bf16, path)
    resumed = run_distributed(_resume, 2, path, 2, not saved_bf16, saved_bf16)
    assert len(resumed[0]["notices"]) == 1 and resumed[1]["notices"] == []
    assert resumed[0]["loaded"] == ({"torch.float32"} if saved_bf16 else {"torch.bfloat16"})
    for a, b in zip(straight, resumed):
        for n, x in a["saved"].items():  # an fp32 master split on load: hi = bf16(x), lo = the rest toward zero
            want = x if saved_bf16 else x.to(BF16).float() + _toward_zero(x - x.to(BF16).float()).float()
            assert torch.equal(b["masters"][n], want), n
        assert b["losses"] == pytest.approx(a["losses"], rel=2e-2)


def test_the_knobs_refuse_what_they_cannot_hold():
    model = _gpt2()
    with pytest.raises(ValueError, match="master_dtype='bf16' keeps the master in the bf16 parameter.*fp32"):
        ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=1, master_dtype="bf16"))
    adafactor = torch.optim.Adafactor(model.parameters())
    with pytest.raises(ValueError, match="Adafactor is a whole_tensor optimizer.*Allowed: an elementwise"):
        ZeroEngine(copy.deepcopy(model), adafactor, ZeroConfig(stage=1, optimizer_state_dtype="bf16"))
    with pytest.raises(ValueError, match="must be 'fp32' \\(default\\) or 'bf16'; got 'fp16'"):
        ZeroConfig(optimizer_state_dtype="fp16")
    with pytest.raises(ValueError, match="quantize_weights"):
        ZeroConfig(stage=3, master_dtype="bf16", quantize_weights=True)


def _tp_train(mesh, cfg, compute_dtype=None):
    """A TP x data-parallel run of the helpers' tiny GPT (``cfg``), or DDP on the whole model (None): weights and
    the optimizer-state bytes of the run."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tests.helpers.tp_models import dp_batch, full_state, lm_loss, make_gpt, parallelize

    dp_rank, dp_size = mesh.get_local_rank("data_parallel"), mesh.size(0)
    model = make_gpt()
    if cfg is not None:
        parallelize(model, mesh["tensor_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    engine = ZeroEngine(model, opt, ZeroConfig(**cfg), compute_dtype=compute_dtype, device_mesh=mesh) \
        if cfg is not None else None
    runner = model if engine is not None else DDP(model, process_group=mesh.get_group("data_parallel"))
    for step in range(3):
        lm_loss(runner, dp_batch(step, 0, dp_rank, dp_size)).backward()
        engine.step() if engine is not None else (opt.step(), opt.zero_grad())
    state = engine.memory_report().as_dict()["optimizer_state"] if engine is not None else None
    if engine is not None:
        engine.restore_fp32_module()
    return full_state(model), state


def _tensor_parallel(rank, world):
    from tests.helpers.tp_models import tp_mesh

    mesh = tp_mesh(world)
    ref, _ = _tp_train(mesh, None)
    _, fp32 = _tp_train(mesh, dict(stage=2))
    weights, bf16 = _tp_train(mesh, dict(stage=2, optimizer_state_dtype="bf16"))
    _, both = _tp_train(mesh, dict(stage=1, optimizer_state_dtype="bf16", master_dtype="bf16", reduce_dtype="fp32"),
                        BF16)
    return max((weights[k] - ref[k]).abs().max().item() for k in ref), (fp32, bf16, both)


@pytest.mark.timeout(300)
def test_tensor_parallel_pieces_keep_bf16_states():
    """TP x data parallel (2 x 2): each rank's local piece's moments in bf16 (half the bytes), the run within
    bf16 moment rounding of DDP on the whole model; bf16 masters there too."""
    for diff, (fp32, bf16, both) in run_distributed(_tensor_parallel, 4):
        assert diff < 1e-3
        assert bf16 * 2 == fp32 and both == bf16
