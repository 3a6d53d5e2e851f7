"""The engine's optimizer state dict is a plain torch optimizer's: a plain AdamW's state loads into a stage-1
engine and comes back unchanged, and the engine's loads into a plain AdamW, frozen parameters keeping their
positions in the param_groups both ways."""

from __future__ import annotations

import torch

from lightning_zero import ZeroConfig, ZeroEngine
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer


def test_plain_optimizer_state_loads_into_engine_with_frozen_params():
    ref = make_model()
    plain = make_optimizer(ref, "adamw")  # ParityNet.frozen's weight/bias are in the param_groups, as usual
    loss_fn(ref, batch(0, 0), True).backward()
    plain.step()
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=1))
    engine.load_optimizer_state_dict(plain.state_dict())
    back = engine.optimizer_state_dict()  # positions (frozen ones included) survive the round trip
    want = plain.state_dict()
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert set(back["state"]) == set(want["state"])
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(back["state"][i][k], v)


def test_engine_optimizer_state_loads_into_plain_optimizer_with_frozen_params():
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model, "adamw"), ZeroConfig(stage=1))
    loss_fn(model, batch(0, 0), True).backward()
    engine.step()
    state = engine.optimizer_state_dict()
    engine.remove()
    plain = make_optimizer(make_model(), "adamw")
    plain.load_state_dict(state)
    assert len(plain.state) == len(state["state"]) > 0
