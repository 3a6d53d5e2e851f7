"""fit, then validate, test and predict on the same Trainer (zero2, 2 forked ranks): each rank trains on its
DistributedSampler shard, the parent gets rank 0's trained weights back, and evaluation runs on those weights
over its own sampler shard without building a ZeRO engine."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DistributedSampler

import lightning_zero  # noqa: F401  (registers the zero* strategy names)
from tests.helpers.lightning_models import ParityModule, TokenDataset, load_rank_files, trainer_kwargs


forked = pytest.mark.timeout(300)  # the rank processes are forked from this one


@forked
def test_fit_then_validate_test_predict_use_distributed_sampler(tmp_path):
    out = str(tmp_path)
    model = ParityModule(out, tag="eval_")
    kw = trainer_kwargs(devices=2, max_steps=3, limit_val_batches=1.0)
    trainer = Trainer(strategy="zero2_fork", **kw)
    trainer.fit(model)
    fit = load_rank_files(out, "eval_", "train", 2)
    for rank, res in enumerate(fit):
        assert res["global_step"] == 3 and res["has_engine"]
        assert res["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}
        # Lightning always shuffles the training sampler (DistributedSampler, seed 0), whatever shuffle= says
        expected = list(DistributedSampler(TokenDataset(), num_replicas=2, rank=rank, shuffle=True, seed=0))
        assert res["seen"]["train"] == expected[: 3 * 4]
    assert not set(fit[0]["seen"]["train"]) & set(fit[1]["seen"]["train"])
    # the parent got rank 0's trained weights back
    for name, v in model.state_dict().items():
        torch.testing.assert_close(v.float(), fit[0]["params"][name], rtol=0, atol=0)

    trainer.validate(model)
    trainer.test(model)
    trainer.predict(model)  # predictions are not returned through a process launcher; the files say it all
    for what, n in (("val", 20), ("test", 22), ("predict", 18)):
        per_rank = load_rank_files(out, "eval_", what, 2)
        for rank, res in enumerate(per_rank):
            assert not res["has_engine"], f"{what} must not build a ZeRO engine (there is no optimizer)"
            assert res["world_size"] == 2
            assert sorted(res["seen"][what]) == list(range(rank, n, 2)), (what, rank, res["seen"][what])
            for name, v in fit[0]["params"].items():  # evaluation runs on the trained weights
                torch.testing.assert_close(res["params"][name], v, rtol=0, atol=0)
        assert sorted(per_rank[0]["seen"][what] + per_rank[1]["seen"][what]) == list(range(n))
