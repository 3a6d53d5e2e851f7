"""Different training lengths per rank ([Note: uneven training inputs], lightning/even_inputs.py).

The user's own per-rank loaders (``use_distributed_sampler=False``): rank 0 has 8 batches, rank 1 has 3.
With ``max_steps=6`` rank 1 would run out first and the others would wait in their next collective for
the process-group timeout (what the tester saw at stage 3, and what Lightning's ``ddp`` does too): at
every stage each rank raises one UnevenInputsError naming both ranks' counts, within seconds. With
``max_steps=3`` every rank runs 3 batches, so the run is even: it trains and equals Lightning's ``ddp``
on the same loaders (also with IterableDatasets, whose lengths are unknown, on every rank).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from tests.helpers.dist_utils import run_distributed
from tests.helpers.lifecycle_harness import LifecycleModule, make_strategy, trainer, whole_params
from tests.helpers.lightning_models import TokenDataset

BATCH = 4
LENGTHS = (8, 3)  # batches of rank 0, rank 1


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.rows = TokenDataset(n)

    def __iter__(self):
        return (self.rows[i] for i in range(len(self.rows)))


class _PerRank(LifecycleModule):
    """Each rank its own loader: ``LENGTHS[rank]`` batches (a stream of them on the ranks in ``streams``)."""

    def __init__(self, out: str, streams: tuple = ()) -> None:
        super().__init__(out)
        self.streams = streams

    def train_dataloader(self):
        n = LENGTHS[self.global_rank] * BATCH
        data = _Stream(n) if self.global_rank in self.streams else TokenDataset(n)
        return DataLoader(data, batch_size=BATCH, shuffle=False)


def _fit(rank, world_size, name, max_steps, out, streams=()):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    model = _PerRank(out, streams)
    t = trainer(make_strategy(name), world_size, max_steps, max_epochs=1, use_distributed_sampler=False,
                limit_val_batches=0)
    start = time.monotonic()
    try:
        t.fit(model)
    except Exception as err:  # every rank must see the same error
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    return {"weights": whole_params(model, t.strategy), "losses": list(model.losses), "step": t.global_step}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3"])
def test_uneven_lengths_are_one_clear_error_on_every_rank(tmp_path, name):
    for rank, res in enumerate(run_distributed(_fit, 2, name, 6, str(tmp_path))):
        assert res.get("error") == "UnevenInputsError", (rank, res)
        assert "rank 0: 6 (of 8), rank 1: 3" in res["message"] and "max_steps=6" in res["message"], res["message"]
        assert "Allowed:" in res["message"]
        assert res["seconds"] < 30, res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,streams", [("zero1", ()), ("zero3", ()), ("zero2", (0, 1))])
def test_uneven_lengths_that_max_steps_evens_out_train_as_ddp(tmp_path, name, streams):
    """Sized loaders, or IterableDatasets (no length) on every rank: max_steps=3 runs 3 batches everywhere."""
    zero = run_distributed(_fit, 2, name, 3, str(tmp_path / "zero"), streams)
    ddp = run_distributed(_fit, 2, "ddp", 3, str(tmp_path / "ddp"), streams)
    for rank in range(2):
        assert "error" not in zero[rank], zero[rank]
        assert zero[rank]["step"] == ddp[rank]["step"] == 3
        torch.testing.assert_close(torch.tensor(zero[rank]["losses"]), torch.tensor(ddp[rank]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for k, v in ddp[rank]["weights"].items():
            torch.testing.assert_close(zero[rank]["weights"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
