"""A parameter-shard store defined here, outside the package, registered through the public function.

``MmapShards`` keeps stage 3's fp32 unit shards in a memory-mapped file (numpy's ``memmap``) instead of
device or host memory. Registered with ``lightning_zero.register_param_store("mmap", ...)``, ``ZeroConfig(
offload_params="mmap")`` trains HF GPT-2 (built from its config) at stage 3 on 2 gloo ranks equal to torch
DDP with the same seed and data; no package file names it ([Note: parameter-shard stores]).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import lightning_zero
from lightning_zero import ParamShardStore, ParamStoreSetup, ZeroConfig, ZeroEngine, ZeroStrategy
from lightning_zero.engine.placement import param_store_registry
from tests.helpers.dist_utils import run_distributed
from tests.helpers.parity import close
from tests.helpers.zoo_models import ZOO, zoo_adamw, zoo_ddp_reference

STEPS = 3


class MmapShards(ParamShardStore):
    """Every unit's fp32 shard a slice of one memory-mapped file per rank; gathers copy from the mapping."""

    def __init__(self, setup: ParamStoreSetup, path: str) -> None:
        super().__init__(setup.device, torch.device("cpu"))
        sizes = [(u.index, u.layout.shard_numel) for u in setup.units if u.params]
        self.offsets, end = {}, 0
        for index, n in sizes:
            self.offsets[index] = end
            end += n
        self.path = path
        self.mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="w+", shape=(max(end, 1),)))

    def install(self, u, chunk: torch.Tensor) -> None:
        self.units[u.index] = u
        lo = self.offsets[u.index]
        u.shard = self.mapped[lo : lo + chunk.numel()]
        u.shard.copy_(chunk)


def _train(rank, world_size, directory):
    lightning_zero.register_param_store(
        "mmap", lambda setup: MmapShards(setup, f"{directory}/shards-rank{setup.rank}.f32"))
    builder, make_batch, loss_fn = ZOO["gpt2"]
    torch.manual_seed(0)
    model = builder()
    engine = ZeroEngine(model, zoo_adamw(model), ZeroConfig(stage=3, offload_params="mmap"))
    store = engine.partitioner.store
    losses = []
    for step in range(STEPS):
        engine.prepare_forward()
        loss = loss_fn(model, make_batch(step, rank))
        loss.backward()
        losses.append(loss.item())
        engine.step()
    shards = torch.cat([u.shard for u in sorted(store.units.values(), key=lambda u: store.offsets[u.index])])
    on_file = torch.from_numpy(np.fromfile(store.path, dtype=np.float32))[: shards.numel()]
    report = engine.memory_report()
    engine.restore_fp32_module()
    return {"store": type(store).__name__, "placement": engine.plan.placement.param_shards.value,
            "file_equals_shards": bool(torch.equal(on_file, shards)), "shard_numel": shards.numel(),
            "host": report.host, "shard_bytes": shards.numel() * 4, "losses": losses,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _all(rank, world_size, directory):
    return {"ddp": zoo_ddp_reference(rank, "gpt2", STEPS), "mmap": _train(rank, world_size, directory)}


@functools.lru_cache(maxsize=None)
def _results(directory):
    return run_distributed(_all, 2, directory)


@pytest.fixture
def registry(monkeypatch):
    """The registry as it was after the test (a registered name would change other tests' error messages)."""
    monkeypatch.setattr(param_store_registry, "_PARAM_STORES", dict(param_store_registry._PARAM_STORES))


@pytest.mark.timeout(300)
def test_a_store_defined_outside_the_package_trains_stage3_equal_to_ddp(tmp_path, registry):
    for rank, res in enumerate(_results(str(tmp_path))):
        got, ref = res["mmap"], res["ddp"]
        assert got["store"] == "MmapShards" and got["placement"] == "host"
        # the shards really live in the mapped file: it holds this rank's final shards, counted as host bytes
        assert got["shard_numel"] > 0 and got["file_equals_shards"], got
        assert got["host"] == got["shard_bytes"], got
        close(got["losses"], ref["losses"], f"rank {rank} losses")
        close(got["state"], ref["state"], f"rank {rank} weights")


@pytest.mark.timeout(300)
def test_the_trainer_takes_a_registered_store_and_fits_as_ddp(tmp_path, registry):
    """Lightning's Trainer with ``ZeroStrategy(stage=3, offload_params="mmap")`` (fork launcher: the ranks
    inherit the registration) against Lightning's DDP, same module, seed and data."""
    from lightning.pytorch.strategies import DDPStrategy

    from tests.helpers.lightning_parity import compare_rank_files, fit_parity_module

    lightning_zero.register_param_store("mmap", lambda setup: MmapShards(setup, str(tmp_path / f"r{setup.rank}.f32")))
    ref = fit_parity_module(tmp_path, DDPStrategy(start_method="fork", find_unused_parameters=True))
    got = fit_parity_module(tmp_path, ZeroStrategy(stage=3, offload_params="mmap", start_method="fork"))
    compare_rank_files(got, ref)
    assert sorted(p.name for p in tmp_path.glob("r*.f32")) == ["r0.f32", "r1.f32"]


def test_an_unknown_store_name_is_one_clear_error(registry):
    lightning_zero.register_param_store("mmap", lambda setup: None)
    msg = r"offload_params must be True or False, or one of 'none', 'cpu', 'nvme', 'mmap' \(True = 'cpu'\); got 'mmapp'"
    with pytest.raises(ValueError, match=msg):
        ZeroConfig(stage=3, offload_params="mmapp")
    with pytest.raises(ValueError, match=msg):  # the strategy's knob is the config's
        ZeroStrategy(stage=3, offload_params="mmapp")
    assert ZeroConfig(stage=3, offload_params="MMAP").offload_params == "mmap"
    assert ZeroStrategy(stage=3, offload_params="mmap").zero_config.offload_params == "mmap"
    with pytest.raises(ValueError, match=r"needs partitioned parameters \(stage 3\)"):
        ZeroConfig(stage=2, offload_params="mmap")


def test_a_factory_must_return_a_store(registry):
    lightning_zero.register_param_store("broken", lambda setup: object())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"offload_params='broken': the registered factory returned object, "
                                        r"not a ParamShardStore"):
        ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3, offload_params="broken"))


@pytest.mark.parametrize("name, location, match", [
    ("nvme", "host", r"'nvme' is a built-in store"),
    ("Mmap", "host", r"non-empty lower-case string"),
    ("mmap", "disk", r"location must be one of 'device', 'host', 'nvme'"),
])
def test_registration_refuses_bad_names_and_locations(registry, name, location, match):
    with pytest.raises(ValueError, match=match):
        lightning_zero.register_param_store(name, lambda setup: None, location)
