"""ParityModule fitted by a real Lightning Trainer (fork launcher, gloo), and the comparison of its per-rank files
with a reference fit's (Lightning's ``DDPStrategy(start_method="fork", find_unused_parameters=True)``)."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer

from tests.helpers.lightning_models import ParityModule, load_rank_files, trainer_kwargs
from tests.helpers.parity import FP32, Tolerance, close

MAX_STEPS = 5

_COUNTER = [0]


def fit_parity_module(workdir, strategy, opt_kind="adamw", accum=1, clip=None, devices=2) -> list[dict]:
    """Fit ParityModule for MAX_STEPS steps under ``strategy`` (fork launcher): the per-rank result files."""
    _COUNTER[0] += 1
    tag = f"run{_COUNTER[0]}_"
    model = ParityModule(str(workdir), opt_kind=opt_kind, tag=tag)
    trainer = Trainer(strategy=strategy, **trainer_kwargs(devices=devices, max_steps=MAX_STEPS, accum=accum, clip=clip))
    trainer.fit(model)
    res = load_rank_files(str(workdir), tag, "train", devices)
    for r in res:
        assert r["global_step"] == MAX_STEPS
        assert len(r["losses"]) == MAX_STEPS * accum
    return res


def compare_rank_files(zero: list[dict], ref: list[dict], tol: Tolerance = FP32) -> None:
    """Each rank's losses and final parameters against the reference's at ``tol``; every ZeRO rank holds the
    same full parameters; the run trained."""
    assert len(zero) == len(ref)
    for rank, (z, d) in enumerate(zip(zero, ref)):
        close(z["losses"], d["losses"], f"rank {rank} losses", tol)
        assert set(z["params"]) == set(d["params"])
        for name in d["params"]:
            close(z["params"][name], d["params"][name], f"rank {rank} {name}", tol)
    for z in zero[1:]:  # every rank holds the same full parameters after the last all-gather
        for name, v in zero[0]["params"].items():
            torch.testing.assert_close(z["params"][name], v, rtol=0, atol=0)
    # the run actually trained (guards against comparing two untouched models)
    first = ref[0]["params"]["net.fc1.weight"]
    assert not torch.equal(first, ParityModule("unused").net.fc1.weight.detach())
