"""The NVMe knobs through the recipe's Hydra overrides (the knob table, tests/test_knob_validation.py, has
their rows for ZeroConfig, the Trainer and Fabric): an empty ``nvme_path`` and NVMe knobs without NVMe offload
are one ConfigError each, raised when the strategy is built, before any rank starts."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("overrides,match", [
    (("strategy=zero2_offload_nvme", "strategy.nvme_path=''"), r"nvme_path='' is empty\. Allowed: an existing, "
                                                               r"writable directory"),
    (("strategy=zero2_offload", "strategy.nvme_buffer_count=4"), r"nvme_buffer_count=4 given without NVMe offload "
                                                                 r"\(offload_optimizer=True, offload_params=False\)"),
    (("strategy=zero3_offload", "strategy.nvme_path=/tmp"), r"nvme_path='/tmp' given without NVMe offload"),
    (("strategy=zero2", "strategy.nvme_direct=true"), r"nvme_direct=True given without NVMe offload.*Allowed: NVMe "
                                                      r"knobs with offload_optimizer='nvme' or offload_params='nvme'"),
])
def test_hydra_nvme_overrides_are_refused_when_the_strategy_is_built(overrides, match):
    from tests.helpers.hydra_recipe import compose_recipe  # examples/ on sys.path
    from t5_config import ConfigError, build_strategy

    with pytest.raises(ConfigError, match=match):
        build_strategy(compose_recipe(*overrides))


def test_hydra_nvme_overrides_with_nvme_offload_pass(tmp_path):
    from tests.helpers.hydra_recipe import compose_recipe
    from t5_config import build_strategy

    s = build_strategy(compose_recipe("strategy=zero2_offload_nvme", f"strategy.nvme_path={tmp_path}",
                                      "strategy.nvme_buffer_count=4"))
    assert (s.zero_config.nvme_path, s.zero_config.nvme_buffer_count) == (str(tmp_path), 4)
