"""The engine's shape after issue 43: bucket rows own their state (no parallel per-bucket lists in the reducer),
the optimizer's kind is asked once (elementwise / whole-tensor / communicating), the constructor is the builder's
one call and a step calls what the builder chose."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero.engine.optim.onebit import OneBitAdam, ZeroOneAdam

from tests.helpers.dist_utils import run_distributed
from tests.helpers.models import batch, loss_fn, make_model, steps_beside_reference

ENGINE = Path(__file__).resolve().parents[1] / "lightning_zero" / "engine"


def _per_bucket_lists(reducer) -> list[str]:
    n = len(reducer.rows)
    return [k for k, v in vars(reducer).items() if isinstance(v, (list, tuple)) and len(v) == n and k != "rows"]


@pytest.mark.parametrize("offload", [False, True])
def test_reducer_rows_are_objects_and_there_is_no_parallel_list(offload):
    from lightning_zero.engine.grads.bucket_rows import BucketRow
    from lightning_zero.engine.grads.host_copy import OnDevice, SameMemory

    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=2, bucket_mb=0.0005, offload_optimizer=offload))
    red = engine.reducer
    assert len(red.rows) > 2 and all(isinstance(r, BucketRow) for r in red.rows)
    assert [r.bucket for r in red.rows] == engine.table.buckets  # the table's rows are the reducer's
    assert all(r is t for r, t in zip(red.rows, engine.table.rows))
    loss_fn(model, batch(0, 0), True).backward()
    assert not _per_bucket_lists(red), _per_bucket_lists(red)
    for row in red.rows:  # everything kept about a bucket is on its row
        assert row.shard is not None and row.shard.numel() == row.bucket.shard_numel
        assert row.used is not None and row.used.numel() == len(row.bucket.params)
        assert (row.host is row.shard) if offload else row.host is None  # CPU run: the shard is the host copy
    assert isinstance(red.host_copy, SameMemory if offload else OnDevice)  # chosen once, from the placement
    engine.finalize_grads()
    # the optimizer read the rows: its masters' gradients are views of their row's shard
    s = engine.sharded
    m, row = s.masters[0][0], red.rows[s.buckets[0].index]
    assert m.grad is not None and m.grad.data_ptr() == row.step_grads().data_ptr()
    engine.step()
    assert all(r.shard is None and r.used is None and r.host is None for r in red.rows)
    engine.remove()


def test_a_param_group_added_after_setup_is_one_row_more():
    model = make_model()
    opt = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=1))
    before = len(engine.reducer.rows)
    opt.add_param_group({"params": list(model.fc2.parameters())})
    assert len(engine.reducer.rows) > before and engine.reducer.rows[-1] is engine.table.rows[-1]
    assert not _per_bucket_lists(engine.reducer)
    loss_fn(model, batch(0, 0), False).backward()
    assert engine.step()
    engine.remove()


def test_engine_init_is_the_builders_one_call_and_step_reads_no_flag():
    init = inspect.getsource(ZeroEngine.__init__).splitlines()
    assert len(init) <= 30, len(init)
    step = ast.parse(textwrap.dedent(inspect.getsource(ZeroEngine.step))).body[0]
    read = {n.attr for n in ast.walk(step) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}
    assert read.isdisjoint({"check_finite", "loss_scaler", "loss_scale", "config", "plan", "optimizers"}), read
    assert "_step_parts" in read  # what the builder chose
    for path in ("engine.py", "grads/reducer.py", "optim/optimizer.py"):
        assert len((ENGINE / path).read_text().splitlines()) < 400, path
    source = (ENGINE / "engine.py").read_text() + (ENGINE / "builder.py").read_text()
    assert "binding" not in source and "OneBit" not in source and "uses_local_grads" not in source


def test_kinds_are_asked_once_from_one_registry():
    from lightning_zero import register_whole_tensor_optimizer
    from lightning_zero.engine.optim.kinds import Kind, kind_of, per_rank_state, register_shardable_optimizer

    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]

    class Lamb(torch.optim.Adam):  # a subclass may override step(): whole-tensor until declared otherwise
        pass

    assert kind_of(torch.optim.AdamW(params)).kind is Kind.ELEMENTWISE
    assert kind_of(Lamb(params)).kind is Kind.WHOLE_TENSOR
    assert kind_of(torch.optim.LBFGS(params)).kind is Kind.WHOLE_TENSOR
    for cls in (OneBitAdam, ZeroOneAdam):
        opt = cls(params)
        assert kind_of(opt).kind is Kind.COMMUNICATING
        assert per_rank_state(opt) == ("worker_error", "server_error")  # checkpoints ask the kind
    assert per_rank_state(torch.optim.AdamW(params)) == ()
    register_shardable_optimizer(Lamb)
    assert kind_of(Lamb(params)).kind is Kind.ELEMENTWISE
    register_whole_tensor_optimizer(Lamb)  # declared again: the last word counts
    assert kind_of(Lamb(params)).kind is Kind.WHOLE_TENSOR


class TrustSGD(torch.optim.Optimizer):
    """SGD scaled per tensor by ||p|| / ||g|| (LARS's trust ratio): whole tensors, wrong on a shard."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    trust = p.norm() / p.grad.norm().clamp_min(1e-12)
                    p.add_(p.grad * trust, alpha=-g["lr"])


def test_a_declared_whole_tensor_optimizer_steps_whole_at_every_stage():
    """Stage 0 steps whole parameters; stages 1-3 step each whole on its owner rank (here the only one)."""
    from lightning_zero import register_whole_tensor_optimizer

    register_whole_tensor_optimizer(TrustSGD)
    for stage in (0, 1, 2, 3):
        model, ref = make_model(), make_model()
        engine = ZeroEngine(model, TrustSGD([p for p in model.parameters() if p.requires_grad]),
                            ZeroConfig(stage=stage))
        ref_opt = TrustSGD([p for p in ref.parameters() if p.requires_grad])
        steps_beside_reference(engine, model, ref, ref_opt, 3, use=lambda step: step % 2 == 0)
        engine.restore_fp32_module()
        engine.remove(hand_back=False)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=0, msg=f"stage {stage} {n}")


class AveragingSGD(torch.optim.SGD):
    """A communicating optimizer of a family of its own: it averages the gradients itself (one all-reduce per
    parameter in its step), so the engine must reduce nothing in backward."""

    per_rank_state = ()

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr)
        self.process_group = None  # the engine binds its shard group

    def uses_local_grads(self) -> bool:
        return True

    def phase(self) -> str:
        return "averaging"

    def rank_local_state(self) -> tuple:
        return ()

    @torch.no_grad()
    def step(self, closure=None):
        world = torch.distributed.get_world_size(self.process_group)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=self.process_group)
                    p.grad.div_(world)
        return super().step(closure)


def _averaging_family(rank, world):
    from lightning_zero.engine.optim.kinds import KindSetup, register_optimizer_kind
    from lightning_zero.engine.optim.kinds.communicating import Communicating

    class AveragingKind(Communicating):
        def check(self, optimizer, setup: KindSetup) -> None:
            if setup.plan.stage != 0:
                raise ValueError("AveragingSGD steps whole parameters. Allowed: stage=0.")

    register_optimizer_kind(AveragingSGD, AveragingKind())  # the one line a new family adds
    model, ref = make_model(), make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    engine = ZeroEngine(model, AveragingSGD(params), ZeroConfig(stage=0))
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    reports = []
    for step in range(3):
        loss_fn(model, batch(step, rank), step % 2 == 0).backward()
        engine.step()
        reports.append(engine.comm_report())
        # the reference: the mean loss of both ranks' batches in one process (DDP's average)
        sum(loss_fn(ref, batch(step, r), step % 2 == 0) for r in range(world)).div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with pytest.raises(ValueError, match="AveragingSGD steps whole parameters. Allowed: stage=0"):
        ZeroEngine(make_model(), AveragingSGD(make_model().parameters()), ZeroConfig(stage=1))
    return ([p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in ref.parameters()],
            [r.phase for r in reports], [set(r.by_op()) for r in reports])


@pytest.mark.timeout(120)
def test_a_new_communicating_family_is_one_registration():
    for got, ref, phases, ops in run_distributed(_averaging_family, 2):
        for p, q in zip(got, ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        assert phases == ["averaging"] * 3  # comm_report asks the kind
        # backward reduced nothing: the engine's collectives in a step are the buffer broadcast only (the
        # optimizer's own all-reduces go straight to torch.distributed)
        assert all("all_reduce" not in op for op in ops), ops
