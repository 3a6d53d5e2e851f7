"""The T5 recipe with its default launcher (the cpu preset's start_method=fork) under torchrun: one node with
two processes, and two single-process "nodes" on 127.0.0.1. torchrun has made the processes already, so the
strategy must not fork more (it used to: gloo "Connection reset by peer")."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.tools.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "t5_finetune.py"


def _pairs(path: Path) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(64):
            f.write(json.dumps({"code": f"def add_{i}(x):\n    return x + {i}\n", "doc": f"Add {i} to x."}) + "\n")
    return path


def _recipe_args(tmp_path: Path, devices: int, nodes: int) -> list[str]:
    # no strategy.start_method override: the recipe's default (fork on the cpu preset) must just work
    return [str(APP), "model=t5_tiny", "trainer=cpu", f"trainer.devices={devices}", f"trainer.num_nodes={nodes}",
            "data=jsonl", f"data.path={_pairs(tmp_path / 'pairs.jsonl')}", "data.source_field=code",
            "data.target_field=doc", "data.batch_size=4", "data.limit_train=16", "data.limit_val=4",
            "data.max_source_len=32", "data.max_target_len=8", "trainer.max_steps=2", "trainer.val_check_interval=2",
            "trainer.validate_before_fit=false", "tokenizer=bytes", "trainer.enable_progress_bar=false",
            "optim.warmup_steps=1", "output.tensorboard=false", "output.export_hf=false",
            f"output.dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # this checkout's package
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK"):
        env.pop(k, None)
    return env


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.5", *args]


def _check_finished(out: Path, log: str) -> None:
    assert "== t5_finetune done" in log and ": 2 steps (" in log, log[-4000:]
    assert "start_method='fork' is not used" in log  # the external launcher was recognised
    info = json.loads((out / "run_info.json").read_text())
    assert info["global_step"] == 2 and len(info["ranks"]) == 2
    assert (out / "checkpoints" / "last.ckpt").is_dir()


@pytest.mark.timeout(200)
def test_recipe_default_launcher_under_torchrun_one_node(tmp_path):
    port = str(free_port())
    cmd = _torchrun("--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port,
                    *_recipe_args(tmp_path, devices=2, nodes=1))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env(), cwd=str(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    _check_finished(tmp_path / "out", log)


@pytest.mark.timeout(200)
def test_recipe_default_launcher_under_torchrun_two_nodes(tmp_path):
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = _torchrun("--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                        "--master_addr", "127.0.0.1", "--master_port", port,
                        *_recipe_args(tmp_path, devices=1, nodes=2))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                                      cwd=str(tmp_path)))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(x[-4000:] for x in logs)
    _check_finished(tmp_path / "out", logs[0])  # node 0 holds global rank 0


_SLURM = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
          "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "77", "SLURM_NODELIST": "127.0.0.1"}
_TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "x"}


@pytest.mark.parametrize("launcher,start_method", [("slurm", "fork"), ("slurm", "spawn"), ("torchrun", "fork"),
                                                   ("torchrun", "spawn"), ("none", "fork"), ("none", "popen")])
def test_an_external_launcher_is_never_launched_again(monkeypatch, launcher, start_method):
    """Under srun (SLURM) or torchrun every rank exists already: whatever start_method says, the strategy's
    launcher starts no process; without one, start_method decides as before."""
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    for k in list(os.environ):
        if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in _TORCHRUN:
            monkeypatch.delenv(k)
    for k, v in {"slurm": _SLURM, "torchrun": _TORCHRUN, "none": {}}[launcher].items():
        monkeypatch.setenv(k, v)
    from lightning_zero import ZeroStrategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2, start_method=start_method),
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
    env = trainer.strategy.cluster_environment
    want_env = {"slurm": SLURMEnvironment, "torchrun": TorchElasticEnvironment, "none": LightningEnvironment}[launcher]
    assert type(env) is want_env
    launched = trainer.strategy.launcher
    if launcher != "none" or start_method == "popen":
        assert type(launched) is _SubprocessScriptLauncher
        assert env.creates_processes_externally == (launcher != "none")
        assert trainer.global_rank == (1 if launcher != "none" else 0)
    else:
        assert type(launched) is _MultiProcessingLauncher and launched._start_method == start_method


@pytest.mark.parametrize("launcher,start_method", [("torchrun", "fork"), ("slurm", "spawn"), ("none", "fork")])
def test_fabric_under_an_external_launcher_starts_no_process(monkeypatch, launcher, start_method):
    """The same rule for ``Fabric(strategy=ZeroFabricStrategy(...))``: torchrun / srun made the ranks."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    for k in list(os.environ):
        if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in _TORCHRUN:
            monkeypatch.delenv(k)
    for k, v in {"slurm": _SLURM, "torchrun": _TORCHRUN, "none": {}}[launcher].items():
        monkeypatch.setenv(k, v)
    from lightning_zero import ZeroFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ZeroFabricStrategy(stage=2, start_method=start_method))
    launched = fabric._strategy.launcher
    if launcher != "none":
        assert type(launched) is _SubprocessScriptLauncher
        assert fabric._strategy.cluster_environment.creates_processes_externally
    else:
        assert type(launched) is _MultiProcessingLauncher and launched._start_method == start_method
