"""The layering contract (pyproject.toml ``[tool.importlinter]``): tools > lightning > checkpoint > engine, and
the engine and the checkpoint format import no Lightning and no transformers -- checked on every import
statement, function-level ones included, so an upward import fails CI the day it is written."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is part of the dev extra: pip install -e '.[dev]'"
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "6 kept, 0 broken" in out.stdout
