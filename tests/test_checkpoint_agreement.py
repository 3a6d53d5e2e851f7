"""[Note: every rank agrees on a save's failure]: a synchronous save that fails on one rank only -- rank 0's
``meta.pt`` or json on a full disk, one rank's shard -- is one ``CheckpointWriteError`` on every rank, the previous
checkpoint untouched, nothing left behind; before, the failing rank raised alone and its peers waited in the
save's next collective until the process group's timeout."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero import checkpoint as ck
from lightning_zero.checkpoint import prepared as P
from tests.helpers.ckpt_models import make_tied, run_forked, train
from tests.helpers.models import make_optimizer

pytestmark = pytest.mark.timeout(90)


def _one_rank_fails(rank, world_size, base, where):
    model = make_tied()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=2, bucket_mb=0.0005))
    train(model, engine, rank, world_size, range(2))
    path = os.path.join(base, "ckpt")
    ck.save_engine_checkpoint(path, model, engine, {"global_step": 2})
    train(model, engine, rank, world_size, range(2, 3))
    failing = 0 if where in ("meta", "json") else 1
    real_save, real_write = torch.save, P.Path.write_text
    if rank == failing and where == "meta":
        def save(obj, f, *a, **kw):  # meta.pt only (DCP writes through torch.save too)
            if str(f).endswith(ck.META_FILE):
                raise OSError(28, "No space left on device")
            return real_save(obj, f, *a, **kw)

        P.torch.save = save
    if rank == failing and where == "json":
        P.Path.write_text = lambda *a, **kw: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    if rank == failing and where == "shard":  # this rank's shard listing cannot be read back
        real_describe = ck.integrity.describe_files
        ck.integrity.describe_files = lambda d, names: (_ for _ in ()).throw(OSError(5, "Input/output error")) \
            if any(n.startswith(f"__{rank}_") for n in names) else real_describe(d, names)
    try:
        ck.save_engine_checkpoint(path, model, engine, {"global_step": 3})
        raised = None
    except ck.CheckpointWriteError as err:
        raised = str(err)
    finally:
        P.torch.save, P.Path.write_text = real_save, real_write
        if where == "shard" and rank == failing:
            ck.integrity.describe_files = real_describe
    torch.distributed.barrier()
    return {"raised": raised, "listing": sorted(os.listdir(base)), "step": ck.read_meta(path)["global_step"]}


@pytest.mark.parametrize("where", ["meta", "json", "shard"])
def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path, where):
    failing = 0 if where in ("meta", "json") else 1
    for r in run_forked(_one_rank_fails, 2, str(tmp_path), where):
        assert r["raised"] is not None and f"failed on rank {failing} " in r["raised"], r["raised"]
        assert r["listing"] == ["ckpt"] and r["step"] == 2
