"""README's snippets run as written on a model nobody wrote for them (HF GPT-2 from a config): the Fabric one,
end to end on 2 CPU ranks through Fabric's own launcher (the only edit: accelerator and precision for CPU)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _snippet(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"README has {len(found)} python blocks containing {marker!r}"
    return found[0]


@pytest.mark.timeout(300)
def test_fabric_snippet_runs_on_hf_gpt2(tmp_path):
    code = _snippet("fabric.init_module(empty_init=True)")
    code = code.replace('accelerator="cuda"', 'accelerator="cpu"').replace('precision="bf16-mixed"',
                                                                          'precision="32-true"')
    assert 'accelerator="cpu"' in code
    code += ('\nassert remainder == {"step": i}, remainder\n'
             'assert fabric.world_size == 2 and i == 3\n'
             'fabric.print("README_SNIPPET_OK")\n')
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "README_SNIPPET_OK" in out.stdout
    assert (tmp_path / "ckpt").is_dir()
