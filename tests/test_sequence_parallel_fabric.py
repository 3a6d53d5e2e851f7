"""Sequence parallelism under Fabric: ``ZeroFabricStrategy(sequence_parallel_size=S)`` cuts the batches of the
dataloaders it sets up (and ``fabric.strategy.shard_batch`` those a loop makes), and trains an HF Llama built from
its config exactly as one process on the whole sequences does (fp32, rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_zero import ZeroFabricStrategy
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import FP32, SP_FP32, close
from tests.helpers.sp_lightning import SEQ, Tokens, make_lm

STEPS = 3


def _reference(kind: str) -> tuple[list, dict]:
    """Plain torch, one process, whole sequences: the algorithm the ranks must reproduce."""
    torch.set_num_threads(1)
    model = make_lm(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _, batch in zip(range(STEPS), DataLoader(Tokens(8, padded=True), batch_size=2)):
        loss = model(**batch).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ranks(rank, world, kind, stage, own_loop):
    torch.set_num_threads(1)
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=stage, sequence_parallel_size=world), accelerator="cpu",
                    devices=world)
    fabric.launch()
    model = make_lm(kind)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = DataLoader(Tokens(8, padded=True), batch_size=2)
    if not own_loop:
        loader = fabric.setup_dataloaders(loader)
    losses = []
    for _, batch in zip(range(STEPS), loader):
        if own_loop:  # a batch the loop made itself: the strategy cuts it on request
            batch = fabric.strategy.shard_batch(batch)
        assert batch["input_ids"].shape[-1] == SEQ // world, "each rank gets its slice of the sequence"
        loss = model(**batch).loss
        fabric.backward(loss)
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    with fabric.strategy.gathered_params():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, stage, world, own_loop", [("llama", 3, 2, False), ("gpt2", 2, 2, True),
                                                          ("gpt2", 1, 4, False)])
def test_fabric_sequence_parallel_equals_one_process(kind, stage, world, own_loop):
    want_losses, want_state = _reference(kind)
    for rank, (losses, state) in enumerate(run_distributed(_ranks, world, kind, stage, own_loop)):
        close(losses, want_losses, f"rank {rank} losses", FP32)
        close(state, want_state, f"rank {rank} weights", SP_FP32)


def test_shard_batch_without_the_dim_is_refused():
    with pytest.raises(RuntimeError, match=r"shard_batch cuts batches for sequence_parallel_size=S only"):
        ZeroFabricStrategy(stage=2).shard_batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
