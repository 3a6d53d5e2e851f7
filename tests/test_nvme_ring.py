"""The NVMe ring follows the states it streams (engine/placement/nvme_states.py, engine/placement/nvme_params.py).

A model whose optimizer states are fewer buckets than the ring has slots -- here one large embedding, as a
small GPT-2's vocabulary is most of its parameters -- gets one slot per bucket: the ring is never more host
memory than the states it streams (it was 3 slots of the largest bucket, 3x the states), the first step warns that
NVMe saves no host memory there, and ``lightning-zero estimate`` shows the same ring and from which size
NVMe pays. Stage 3's parameter ring holds at most one slot per unit.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.tools.cli import main as cli_main
from lightning_zero.tools.estimate import estimate_model_states
from tests.helpers.nvme_ring_models import Embedded


def _train(engine, model, steps: int = 2) -> None:
    for step in range(steps):
        engine.prepare_forward()
        model(torch.randint(0, 4000, (4, 8), generator=torch.Generator().manual_seed(step))).backward()
        engine.step()


def test_the_optimizer_ring_is_never_more_than_the_states_it_streams_and_the_first_step_says_nvme_saves_nothing(
        tmp_path, caplog):
    model = Embedded()
    numel = sum(p.numel() for p in model.parameters())
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                        ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path)))  # default bucket_mb
    with caplog.at_level(logging.WARNING, logger="lightning_zero.engine"):
        _train(engine, model)
    nvme = engine.sharded.states
    assert len(nvme.chunks) == 1  # one bucket: fewer than the 3 slots
    states = nvme.state_bytes
    assert 12 * numel <= states < 12 * numel + 4096 * 4  # masters + AdamW's two moments, aligned
    assert [t.numel() for t in nvme.ring] == [states]  # one slot, the bucket's size: allocated as stated
    assert engine.memory_report().ring == nvme.ring_bytes == states  # was 3 x states
    assert "NVMe offload saves at most 0.0 MiB of host memory on this model" in caplog.text
    est = estimate_model_states(Embedded(), world_size=1, settings=["zero2_offload_nvme"])
    row = est.row("zero2_offload_nvme")
    assert row.nvme_ring == row.nvme_optimizer == 12 * numel  # the estimate's ring: the same bound
    assert "zero2_offload_nvme" in str(est) and "NVMe offload saves nothing here" in str(est)
    engine.remove()


def test_the_ring_of_many_buckets_stays_three_of_them_and_no_warning(tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                        ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path), bucket_mb=0.02))
    with caplog.at_level(logging.WARNING, logger="lightning_zero.engine"):
        for step in range(2):
            model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            engine.step()
    nvme = engine.sharded.states
    assert len(nvme.chunks) >= 10 and len(nvme.ring) == 3
    assert nvme.ring_bytes == sum(t.numel() for t in nvme.ring) <= 3 * nvme.slot_bytes
    assert 3 * nvme.ring_bytes <= nvme.state_bytes  # 3 slots of 12 buckets
    assert "NVMe offload saves at most" not in caplog.text
    engine.remove()


def test_stage3_parameter_ring_holds_at_most_one_slot_per_unit(tmp_path):
    model = Embedded()
    cfg = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path))
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    store = engine.partitioner.store
    units = len(store.units)
    assert units < cfg.prefetch_depth + cfg.nvme_buffer_count  # fewer units than the slots asked for
    assert len(store.ring) == units and store.ring_bytes == units * store.slot_bytes
    _train(engine, model)  # gathers never run out of slots
    engine.remove()


def test_estimate_cli_shows_the_ring_and_from_which_size_nvme_pays(capsys):
    assert cli_main(["estimate", "--module", "tests.helpers.nvme_ring_models:embedded", "--ranks", "2",
                     "--settings", "zero2_offload,zero2_offload_nvme"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("NVMe host ring/rank"))
    assert "zero2_offload_nvme 1.5 MiB of 1.5 MiB" in line and "saves nothing here" in line, line
    assert "from about 39.3M trainable parameters" in line, line  # 6 x the 25 MiB bucket's 6.55M elements
