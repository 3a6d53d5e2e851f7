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
    assert compat.toggled_requires_grad(module) == {}  # toggle_optimizer's saved flags (optimizers.py)
    from lightning.pytorch.callbacks import ModelSummary

    assert compat.summary_max_depth(ModelSummary(max_depth=3)) == 3  # the stage-3 summary's depth


def _rename(attrs: dict, name: str) -> None:
    """As if Lightning renamed the instance attribute ``name`` (``attrs``: where the object keeps it)."""
    attrs[name + "_renamed"] = attrs.pop(name)


def _restore(attrs: dict, name: str) -> None:
    attrs[name] = attrs.pop(name + "_renamed")


def test_fabric_wrapper_attributes():
    """The private attributes of Fabric's wrappers that fabric_strategy.py / fabric_precision.py read, resolved on
    the real wrappers ``fabric.setup`` returns; a rename is one PrivateAPIMoved naming it (renamed here by hand).
    The optimizer's is read through its public ``optimizer``."""
    from lightning.fabric import Fabric

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped, wrapped_opt = fabric.setup(model, opt)
    assert isinstance(wrapped, compat.fabric_module_wrapper())
    assert isinstance(wrapped_opt, compat.fabric_optimizer_wrapper())
    assert compat.fabric_forward_module(wrapped) is model and compat.fabric_forward_module(model) is model
    assert compat.fabric_module_strategy(wrapped) is fabric.strategy
    assert compat.fabric_optimizer(wrapped_opt) is opt and compat.fabric_optimizer(opt) is opt
    _rename(wrapped._modules, "_forward_module")  # a child module: nn.Module keeps it in _modules
    with pytest.raises(compat.PrivateAPIMoved, match=r"_FabricModule\._forward_module"):
        compat.fabric_forward_module(wrapped)
    _rename(vars(wrapped), "_strategy")
    with pytest.raises(compat.PrivateAPIMoved, match=r"_FabricModule\._strategy"):
        compat.fabric_module_strategy(wrapped)


@pytest.mark.timeout(120)
def test_zero_fabric_strategy_fails_loudly_when_the_wrapper_attributes_move():
    """Through the entry points: a renamed ``_strategy`` used to read as "not set up under ZeRO", so
    ``model.zero_grad()`` ran torch's and left the engine's gradient shards; a renamed ``_forward_module`` made
    ``engine_of(model)`` claim the model was never set up. Now each is one PrivateAPIMoved naming the name."""
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2), accelerator="cpu", devices=1)
    fabric.launch()
    module = torch.nn.Linear(4, 2)
    model, _ = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    try:
        assert fabric.strategy.engine_of(model) is not None
        model.zero_grad()
        _rename(vars(model), "_strategy")
        with pytest.raises(compat.PrivateAPIMoved, match=r"_FabricModule\._strategy"):
            model.zero_grad()
        _restore(vars(model), "_strategy")
        _rename(model._modules, "_forward_module")
        with pytest.raises(compat.PrivateAPIMoved, match=r"_FabricModule\._forward_module"):
            fabric.strategy.engine_of(model)
        _restore(model._modules, "_forward_module")
    finally:
        fabric.strategy.teardown()


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
