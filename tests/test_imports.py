"""What an import costs: the engine and the checkpoint reader load no Lightning (nor transformers), the CLI's
``--help`` loads no torch, and the strategy names are registered whichever of lightning / lightning_zero is
imported first -- each checked in a fresh interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "lightning_fabric", "pytorch_lightning", "transformers")


def _python(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(200)
def test_engine_and_checkpoint_import_no_lightning():
    loaded = _python("import json, sys; import lightning_zero.engine, lightning_zero.checkpoint; "
                     f"print(json.dumps([m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]))")
    assert loaded == [], loaded


@pytest.mark.timeout(200)
def test_cli_help_imports_no_torch():
    loaded = _python("import json, sys, contextlib, io\n"
                     "from lightning_zero.tools.cli import main\n"
                     "with contextlib.redirect_stdout(io.StringIO()) as text:\n"
                     "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
                     "assert 'consolidate' in text.getvalue()\n"
                     "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning'})))")
    assert loaded == []


@pytest.mark.timeout(200)
@pytest.mark.parametrize("order", ["lightning first", "lightning_zero first"])
def test_names_are_registered_in_either_import_order(order):
    first, second = ("lightning", "lightning_zero") if order == "lightning first" else ("lightning_zero", "lightning")
    got = _python(f"import json, {first}, {second}\n"
                  "import lightning as L\n"
                  "from lightning.fabric import Fabric\n"
                  "t = L.Trainer(strategy='zero3_offload_fork', accelerator='cpu', devices=2, logger=False)\n"
                  "f = Fabric(strategy='zero2', accelerator='cpu', devices=1)\n"
                  "print(json.dumps([type(t.strategy).__name__, t.strategy.stage, type(f.strategy).__name__]))")
    assert got == ["ZeroStrategy", 3, "ZeroFabricStrategy"]


@pytest.mark.timeout(200)
def test_pytorch_lightning_is_left_alone():
    """lightning_zero supports the ``lightning`` distribution only: importing pytorch_lightning after it registers
    nothing there. (Lightning itself may load a few ``pytorch_lightning`` modules; that is not ours to check.)"""
    pytest.importorskip("pytorch_lightning")
    got = _python("import json, sys, lightning_zero, lightning\n"
                  "import pytorch_lightning as pl\n"
                  "names = [n for n in pl.strategies.StrategyRegistry.available_strategies() if n.startswith('zero')]\n"
                  "print(json.dumps([names, 'zero3' in lightning.pytorch.strategies.StrategyRegistry]))")
    assert got == [[], True]


@pytest.mark.timeout(200)
def test_import_wraps_only_the_three_functions_without_a_seam():
    """docs/ARCHITECTURE.md lists the three Lightning functions ``import lightning_zero`` wraps, each with no
    extension point; every other class the adapter works with (the optimizer wrappers, ModelSummary, the
    checkpoint IO) is exactly Lightning's after the import."""
    got = _python(
        "import json, lightning\n"
        "from lightning.pytorch.core.optimizer import LightningOptimizer\n"
        "from lightning.fabric import wrappers\n"
        "from lightning.pytorch.callbacks import ModelSummary\n"
        "from lightning.pytorch.plugins.io import TorchCheckpointIO\n"
        "from lightning.pytorch.core import saving\n"
        "from lightning.pytorch.tuner import tuning\n"
        "classes = {'LightningOptimizer': LightningOptimizer, '_FabricOptimizer': wrappers._FabricOptimizer,\n"
        "           '_FabricModule': wrappers._FabricModule, 'ModelSummary': ModelSummary,\n"
        "           'TorchCheckpointIO': TorchCheckpointIO}\n"
        "before = {n: dict(vars(c)) for n, c in classes.items()}\n"
        "funcs = {'pl_load': (saving, 'pl_load'), 'tuning': (tuning, '_check_scale_batch_size_configuration')}\n"
        "fbefore = {n: getattr(m, a) for n, (m, a) in funcs.items()}\n"
        "import lightning_zero\n"
        "changed = sorted(f'{n}.{k}' for n, c in classes.items() for k in set(vars(c)) | set(before[n])\n"
        "                 if vars(c).get(k) is not before[n].get(k))\n"
        "fchanged = sorted(n for n, (m, a) in funcs.items() if getattr(m, a) is not fbefore[n])\n"
        "print(json.dumps([changed, fchanged]))")
    assert got == [["_FabricModule.zero_grad"], ["pl_load", "tuning"]], got
