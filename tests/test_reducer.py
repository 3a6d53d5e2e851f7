"""The gradient reducer on its own, in one process: buckets launch in bucket order whatever order their gradients
complete in, and no_sync accumulates (stage 1: no collective; stage 2: every bucket) until finalize reduces the
sum. Both against plain autograd's gradients. (End to end they are covered by every parity test.)"""

import torch
from torch import nn

from lightning_zero.engine.grads.buckets import build_buckets
from lightning_zero.engine.plan import ShardingPlan
from lightning_zero.engine.grads.reducer import BackwardPhase, GradReducer


class _Reversed(nn.Module):
    """``first`` is registered first but runs last: its gradients are ready before ``second``'s."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 2), nn.Linear(4, 3)

    def forward(self, x):
        return self.first(self.second(x))


def test_reducer_launches_in_bucket_order_whatever_order_gradients_complete():
    torch.manual_seed(0)
    model, ref = _Reversed(), _Reversed()
    ref.load_state_dict(model.state_dict())
    buckets = build_buckets(list(model.parameters()), world_size=1, rank=0, bucket_bytes=1)  # one param each
    # reverse registration: bucket 0 = second.bias, 1 = second.weight, 2 = first.bias, 3 = first.weight
    events = []

    class Recording(GradReducer):
        def _launch(self, b):
            events.append(("launch", b.index))
            super()._launch(b)

    reducer = Recording(buckets, ShardingPlan.for_stage(1), reduce_dtype=None,
                        on_bucket_complete=lambda i: events.append(("done", i)))
    x = torch.randn(5, 4)
    assert reducer.phase is BackwardPhase.IDLE
    model(x).sum().backward()
    assert reducer.phase is BackwardPhase.IDLE and not reducer.in_backward
    launches = [i for kind, i in events if kind == "launch"]
    done = [i for kind, i in events if kind == "done"]
    assert launches == [0, 1, 2, 3]
    assert set(done[:2]) == {2, 3}  # first's gradients completed first ...
    assert events.index(("launch", 0)) > events.index(("done", 0))  # ... but waited for bucket 0
    ref(x).sum().backward()
    ref_grads = [p.grad.reshape(-1) for p in reversed(list(ref.parameters()))]
    for shard, g in zip(reducer.grad_shards, ref_grads):
        torch.testing.assert_close(shard, g, rtol=1e-5, atol=0)
    reducer.remove_hooks()


def test_reducer_no_sync_accumulates_then_finalize_reduces_the_sum():
    from lightning_zero.engine.grads.reducer import GradSync

    torch.manual_seed(0)
    x = torch.randn(5, 4)
    for stage, collectives_under_no_sync in ((1, 0), (2, 4)):
        model, ref = _Reversed(), _Reversed()
        ref.load_state_dict(model.state_dict())
        buckets = build_buckets(list(model.parameters()), world_size=1, rank=0, bucket_bytes=1)
        launched = []

        class Recording(GradReducer):
            def _launch(self, b):
                launched.append(b.index)
                super()._launch(b)

        reducer = Recording(buckets, ShardingPlan.for_stage(stage), reduce_dtype=None)
        assert reducer.sync is GradSync.BOUNDARY
        with reducer.no_sync():
            assert reducer.sync is GradSync.ACCUMULATE and not reducer.sync_enabled
            model(x).sum().backward()
            model(x).sum().backward()
        assert reducer.sync is GradSync.BOUNDARY and reducer.phase is BackwardPhase.IDLE
        assert len(launched) == 2 * collectives_under_no_sync  # stage 1: nothing; stage 2: every bucket
        reducer.finalize()  # stage 1: the accumulated sum is reduced now, once per bucket
        assert len(launched) == (4 if stage == 1 else 8)
        (ref(x).sum() * 2).backward()
        for shard, p in zip(reducer.grad_shards, reversed(list(ref.parameters()))):
            torch.testing.assert_close(shard, p.grad.reshape(-1), rtol=1e-5, atol=0)
        reducer.remove_hooks()
