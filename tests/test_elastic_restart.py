"""torchrun elastic restarts through torchrun's own rendezvous ([Note: torchrun restarts], engine/layout/elastic.py).

``python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1`` runs tests/scripts/elastic_resume.py,
a plain user script (Lightning makes the default group from torchrun's environment). In attempt 0 rank 1
kills itself after step 5; torchrun restarts both workers on the job's one agent store, which still holds
attempt 0's rendezvous keys; they resume from the epoch-end checkpoint of step 4 (``ckpt_path="last"``) and
must end with the weights of the same script run uninterrupted under torchrun (fp32, rtol 1e-5).
Each mode makes process groups of its own (stage 3's reduce-scatter group, hybrid's shard/replicate
groups, the TP mesh, the pipeline's groups), each under both rendezvous backends (static: the agent's
one TCPStore; c10d: the store server shared across rounds).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from lightning_zero.tools.launch import free_port
from tests.helpers.torchrun import torchrun

SCRIPT = Path(__file__).parent / "scripts" / "elastic_resume.py"
ROOT = Path(__file__).resolve().parents[1]
_REFERENCES: dict = {}


def _torchrun(out: Path, mode: str, kill_step: int, rdzv: str) -> subprocess.CompletedProcess:
    port = str(free_port())
    where = (["--master-addr", "127.0.0.1", "--master-port", port, "--rdzv-backend", "static"] if rdzv == "static"
             else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}"])
    out.mkdir(parents=True, exist_ok=True)
    return torchrun(SCRIPT, [out, mode, kill_step], out,
                    ["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5", *where], 170,
                    f"{mode} ({rdzv})")


def _finals(out: Path) -> list[dict]:
    return [torch.load(out / f"final_rank{r}.pt", weights_only=False) for r in range(2)]


def _reference(tmp_path_factory, mode: str) -> list[dict]:
    if mode not in _REFERENCES:
        out = tmp_path_factory.mktemp(f"uninterrupted_{mode}")
        proc = _torchrun(out, mode, 0, "static")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        _REFERENCES[mode] = _finals(out)
    return _REFERENCES[mode]


# Every mode under c10d (torchrun's default rendezvous), and static (the agent's own TCPStore) with zero3 and
# hybrid. The backend decides only the store the default group gets per attempt, which every mode's groups
# derive theirs from (engine/layout/groups.py), so tp and pipeline under static would repeat the static store's path
# at 2 more torchrun jobs of ~35 s each on two cores.
RUNS = [("zero3", "static"), ("hybrid", "static"), ("zero3", "c10d"), ("hybrid", "c10d"), ("tp", "c10d"),
        ("pipeline", "c10d")]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode,rdzv", RUNS, ids=[f"{r}-{m}" for m, r in RUNS])
def test_a_killed_worker_restarts_and_ends_as_an_uninterrupted_run(tmp_path, tmp_path_factory, mode, rdzv):
    out = tmp_path / "restarted"
    proc = _torchrun(out, mode, 5, rdzv)
    log = proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    assert "exitcode: 17" in proc.stderr, "the first attempt's worker did not die as planned"
    restarted, reference = _finals(out), _reference(tmp_path_factory, mode)
    for r in range(2):
        assert restarted[r]["attempt"] == 1 and restarted[r]["global_step"] == 8, (r, restarted[r]["global_step"])
        assert reference[r]["attempt"] == 0 and reference[r]["global_step"] == 8
        assert restarted[r]["weights"].keys() == reference[r]["weights"].keys()
        for k, v in reference[r]["weights"].items():
            torch.testing.assert_close(restarted[r]["weights"][k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {r} {k}: restarted vs uninterrupted: {m}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [0, 1, 3])
def test_the_attempt_token_ignores_a_dead_attempts_keys(late):
    """Four ranks on one store that already holds a finished attempt's keys (its asks, answers and acks):
    whichever rank arrives late, all agree on one token that is not the old attempt's."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from lightning_zero.engine.layout.elastic import agree_attempt_token

    timeout = datetime.timedelta(seconds=30)
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout)

    def attempt(world, delayed):
        tokens = {}

        def rank(r):
            if r == delayed:
                time.sleep(0.3)  # rank 0 has long read this rank's stale ask by now
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
            tokens[r] = agree_attempt_token(client, r, world, timeout)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        return tokens

    old = attempt(4, None)  # attempt 0: leaves its keys in the store
    assert len(set(old.values())) == 1 and len(old) == 4
    new = attempt(4, late)
    assert len(new) == 4 and len(set(new.values())) == 1, new
    assert set(new.values()) != set(old.values())
    del server
