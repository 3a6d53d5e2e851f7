"""README's snippets run as written on a model nobody wrote for them (HF GPT-2 from a config): the Fabric one,
verbatim, end to end on 2 CPU ranks through Fabric's own launcher; and what "Coming from DeepSpeed" says of
NVMe offload is what the translation does."""
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
    code = _snippet("fabric.init_module(empty_init=True)")  # run as a reader copies it: no edit
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


@pytest.mark.parametrize("stage,preset", [(2, "zero2_offload_nvme"), (3, "zero3_offload_nvme")])
def test_deepspeed_section_nvme_offload_translates_to_the_nvme_presets(tmp_path, stage, preset):
    from lightning_zero import from_deepspeed_config
    from lightning_zero.engine.config import PRESETS

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Coming from DeepSpeed"):text.index("## Configuration (Hydra)")]
    assert preset in section and "refused" not in section.split("NVMe offload")[1].split(".")[0]
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4}}
    if stage == 3:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    t = from_deepspeed_config({"zero_optimization": zero, "aio": {"block_size": 1048576}})
    assert t.strategy == {"offload_params": False, **PRESETS[preset], "nvme_path": str(tmp_path),
                          "nvme_buffer_count": 4}
    assert "aio" in t.ignored  # listed as having no effect
    strategy = t.make_strategy()
    assert (strategy.zero_config.offload_optimizer, strategy.zero_config.nvme_path) == ("nvme", str(tmp_path))
