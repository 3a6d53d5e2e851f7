"""The engine's named states: the stage-3 order check (OrderCheck; the config keeps the user's string, a bad one
is one error naming the allowed values) and the engine's mode and partitioning (EngineMode.TRAIN with an
optimizer, EVAL_ONLY without one; parameters partitioned only at stage 3 and handed back whole on remove)."""

import pytest
import torch

from tests.helpers.models import Block, TiedBlocks


def test_order_check_is_named_and_the_config_keeps_the_users_string():
    from lightning_zero.engine import ZeroConfig
    from lightning_zero.engine.stage3.lifecycle import OrderCheck

    assert ZeroConfig(stage=3).order_check == "strict"
    assert ZeroConfig(stage=3, order_check=OrderCheck.ALWAYS).order_check == "always"
    assert OrderCheck.parse("off") is OrderCheck.OFF
    with pytest.raises(ValueError, match="order_check must be one of 'strict', 'always', 'off'; got 'sometimes'"):
        ZeroConfig(stage=3, order_check="sometimes")


def test_engine_mode_and_partitioning_are_named():
    from lightning_zero.engine import EngineMode, ZeroConfig, ZeroEngine

    model = TiedBlocks()
    train = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2))
    assert train.mode is EngineMode.TRAIN and not train.partitions_params
    train.remove()
    evaluation = ZeroEngine(TiedBlocks(), None, ZeroConfig(stage=3, unit_classes=[Block]))
    assert evaluation.mode is EngineMode.EVAL_ONLY and evaluation.partitions_params
    assert evaluation.master_items() == [] and len(evaluation.unmanaged_shard_items()) == 5  # tied: once
    evaluation.remove()  # the module is handed back whole
    assert not evaluation.partitions_params
