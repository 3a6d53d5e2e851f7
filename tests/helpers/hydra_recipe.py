"""The Hydra T5 recipe's configs composed as ``examples/t5_finetune.py`` composes them.

Importing this module puts ``examples/`` on ``sys.path`` (it is not a package), so ``t5_config`` imports after it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def compose_recipe(*overrides, hydra_cfg=False):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("t5_finetune", overrides=list(overrides), return_hydra_config=hydra_cfg)


@pytest.fixture
def pairs_file(tmp_path):
    """300 code/doc pairs as the recipe's jsonl data source reads them."""
    path = tmp_path / "pairs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(300):
            f.write(json.dumps({"code": f"def add_{i}(x):\n    return x + {i}\n",
                                "doc": f"Add {i} to x."}) + "\n")
    return path
