"""Canaries: every private Lightning / torch name lightning_zero relies on still exists in the installed versions.

Each failure names the private name and the installed lightning / torch versions (lightning_zero/lightning/compat.py),
so an upgrade that moves one fails here first instead of as wrong behaviour somewhere in a run.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from lightning_zero.lightning import compat

_ALL = compat.CANARIES + compat.TORCH_CANARIES + compat.TRANSFORMERS_CANARIES


@pytest.mark.parametrize("module,name", _ALL, ids=[f"{m}:{n}" for m, n in _ALL])
def test_private_name_exists(module, name):
    compat.private(module, name)  # raises PrivateAPIMoved naming it and the versions


def test_torch_process_group_names():
    """engine/layout/groups.py reads ``_world.pg_names`` (a dict of every group's name)."""
    world = compat.private("torch.distributed.distributed_c10d", "_world")
    assert isinstance(compat.private_attr(world, "pg_names", "torch.distributed.distributed_c10d._World"), dict)


def test_pipeline_schedule_loss_fn():
    """engine/pipeline/pipeline_zero.py sets ``schedule._loss_fn`` to None for a forward-only (evaluation) run."""
    init = compat.private("torch.distributed.pipelining.schedules", "_PipelineSchedule.__init__")
    if "self._loss_fn" not in inspect.getsource(init):
        raise compat.moved("torch.distributed.pipelining.schedules._PipelineSchedule._loss_fn")


def test_lightning_instance_attributes():
    """The instance attributes Lightning sets privately: BaseFinetuning's bookkeeping, the module's trainer and
    device mesh slots, the loop progress the stage-3 evaluation join reads."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import BaseFinetuning

    store, restarting, metadata = compat.finetuning_state(BaseFinetuning())
    assert callable(store) and restarting is False and metadata == {}
    module = LightningModule()
    assert compat.module_trainer(module) is None
    compat.set_module_device_mesh(module, "mesh")
    assert module.device_mesh == "mesh"
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    assert compat.is_last_batch(trainer) is False  # no loop running
    trainer.state.fn, trainer.state.stage = "validate", "validate"
    trainer.validating = True
    assert compat.is_last_batch(trainer) is False  # the evaluation loop, before its first batch
    compat.private_attr(trainer, "_checkpoint_connector", "Trainer").restore  # noqa: B018
    compat.private_attr(trainer.fit_loop, "_data_source", "_FitLoop").is_module  # noqa: B018


def test_a_moved_name_fails_loudly_with_the_versions():
    import lightning

    with pytest.raises(compat.PrivateAPIMoved) as info:
        compat.private("lightning.pytorch.strategies.ddp", "_sync_module_states_renamed")
    message = str(info.value)
    assert "lightning.pytorch.strategies.ddp._sync_module_states_renamed" in message
    assert f"lightning {lightning.__version__}" in message and f"torch {torch.__version__}" in message
    with pytest.raises(compat.PrivateAPIMoved, match="Trainer._active_loop"):
        compat.is_last_batch(object())


def test_the_evaluation_join_fails_loudly_when_the_loop_progress_moves():
    """A renamed ``batch_progress`` used to read as "not the last batch": stage 3's join was silently skipped
    and the ranks with more batches hung in a gather. Now one clear error."""

    class Loop:  # an evaluation loop without batch_progress (as if renamed)
        pass

    class Trainer:
        fit_loop = object()
        _active_loop = Loop()

    with pytest.raises(compat.PrivateAPIMoved, match="Loop.batch_progress"):
        compat.is_last_batch(Trainer())


def test_strategy_join_reads_the_loop_through_compat():
    """ZeroStrategy's evaluation join: a loop without ``batch_progress`` is an error, not a skipped join."""
    from lightning.pytorch import LightningModule

    from lightning_zero import ZeroStrategy

    class Loop:
        pass

    class Trainer:
        fit_loop = object()
        _active_loop = Loop()

    class Engine:  # records the join the strategy asks for
        joined = 0

        def join(self):
            self.joined += 1

    strategy, module = ZeroStrategy(stage=3), LightningModule()
    module._trainer = Trainer()
    strategy._lightning_module, strategy.engine = module, Engine()
    with pytest.raises(compat.PrivateAPIMoved, match="batch_progress"):
        strategy._joined("out")
    Loop.batch_progress = type("Progress", (), {"is_last_batch": True})()
    assert strategy._joined("out") == "out" and strategy.engine.joined == 1


@pytest.mark.parametrize("distribution", ["lightning.pytorch.strategies", "lightning.fabric.strategies"])
def test_ddp_strategy_protected_attributes(distribution):
    """zero_setup.py reads these of the strategy it configures (external_launcher, setup_default_group)."""
    ddp = compat.private(distribution, "DDPStrategy")(start_method="fork")
    for name in ("_launcher", "_start_method", "_timeout"):
        compat.private_attr(ddp, name, f"{distribution}.DDPStrategy")
    assert ddp._start_method == "fork"
