"""A single-file ("full") Lightning checkpoint across world sizes and stages: zero2 on 2 forked ranks writes the
consolidated parameters and optimizer state (positions as a plain optimizer's), and zero1 and zero0 on one rank
resume from it with exactly that state and train on identically."""

from __future__ import annotations

import glob
import math
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from tests.helpers.lightning_models import ParityModule, load_rank_files, trainer_kwargs


forked = pytest.mark.timeout(300)  # the rank processes are forked from this one


@forked
def test_checkpoint_zero2_two_ranks_resumes_zero1_one_rank(tmp_path):
    out = str(tmp_path)
    ckpt_dir = os.path.join(out, "ckpt")
    saver = ParityModule(out, tag="save_")
    kw = trainer_kwargs(devices=2, max_steps=3, enable_checkpointing=True)
    callback = ModelCheckpoint(dirpath=ckpt_dir, filename="zero2-{step}", every_n_train_steps=3, save_top_k=-1)
    # the single-file format; the resumes below run with the default (sharded) format and still read it
    save_strategy = ZeroStrategy(stage=2, start_method="fork", checkpoint_format="full")
    Trainer(strategy=save_strategy, callbacks=[callback], **kw).fit(saver)
    saved = load_rank_files(out, "save_", "train", 2)
    paths = glob.glob(os.path.join(ckpt_dir, "*.ckpt"))
    assert len(paths) == 1, paths
    ckpt = torch.load(paths[0], weights_only=False)
    assert ckpt["global_step"] == 3
    opt_saved = ckpt["optimizer_states"][0]
    # the checkpoint holds the full (consolidated) parameters and optimizer state
    for name, v in saved[0]["params"].items():
        torch.testing.assert_close(ckpt["state_dict"][name].float(), v, rtol=0, atol=0)
    n_managed = sum(p.requires_grad for p in saver.net.parameters())
    # positions as in a plain optimizer over the same param_groups (frozen parameters included)
    assert sum(len(g["params"]) for g in opt_saved["param_groups"]) == len(list(saver.net.parameters()))
    assert len(opt_saved["state"]) >= n_managed - 2  # 'unused' never gets a gradient, so no state
    for st in opt_saved["state"].values():
        assert st["exp_avg"].shape == st["exp_avg_sq"].shape

    def resume(strategy, tag):
        model = ParityModule(out, tag=tag, save_opt_state_on_start=True)
        Trainer(strategy=strategy, **trainer_kwargs(devices=1, max_steps=6)).fit(model, ckpt_path=paths[0])
        return load_rank_files(out, tag, "start", 1)[0], load_rank_files(out, tag, "train", 1)[0]

    start, end = resume(ZeroStrategy(stage=1, start_method="fork"), "res1_")
    # loaded: the saved weights and the saved optimizer state, re-sliced for one rank
    assert start["global_step"] == 3
    for name, v in ckpt["state_dict"].items():
        torch.testing.assert_close(start["params"][name], v.float(), rtol=0, atol=0)
    _assert_opt_state_equal(start["opt_state"], opt_saved)
    # training went on
    assert end["global_step"] == 6 and end["world_size"] == 1
    assert len(end["losses"]) == 3 and all(math.isfinite(x) for x in end["losses"])
    assert not torch.equal(end["params"]["net.fc1.weight"], start["params"]["net.fc1.weight"])

    # the same checkpoint resumed at stage 0 (whole-parameter optimizer state) continues identically
    start0, end0 = resume(ZeroStrategy(stage=0, start_method="fork"), "res0_")
    _assert_opt_state_equal(start0["opt_state"], opt_saved)
    torch.testing.assert_close(end0["losses"], end["losses"], rtol=1e-5, atol=1e-6)
    for name, v in end0["params"].items():
        torch.testing.assert_close(end["params"][name], v, rtol=1e-5, atol=1e-6, msg=name)


def _assert_opt_state_equal(got: dict, want: dict) -> None:
    assert len(got["param_groups"]) == len(want["param_groups"])
    for g, w in zip(got["param_groups"], want["param_groups"]):
        assert g["params"] == w["params"]
        for k in ("lr", "weight_decay", "betas", "eps", "initial_lr"):
            assert g[k] == w[k], k
    assert set(got["state"]) == set(want["state"])
    for i, w in want["state"].items():
        g = got["state"][i]
        assert set(g) == set(w), i
        for k, v in w.items():
            torch.testing.assert_close(torch.as_tensor(g[k]).reshape(torch.as_tensor(v).shape), torch.as_tensor(v),
                                       rtol=0, atol=0, msg=f"state[{i}][{k}]")
