"""The default process group of a torchrun (torchelastic) worker, under a store prefix of its own attempt.

[Note: torchrun restarts]
torchrun's agent hosts one TCPStore for the whole job and hands it to every restart attempt: the static
rendezvous makes it once (``StaticTCPRendezvous.next_rendezvous``), the c10d rendezvous shares one server
across its rounds (``DynamicRendezvousHandler._shared_tcp_store_server``), and the workers connect to it
without any prefix (``rendezvous._create_c10d_store`` under ``TORCHELASTIC_USE_AGENT_STORE``, whose comment
assumes a new store per retry). A restarted worker names its groups as the killed attempt did (the default
group "0", the next counter-named groups "1", "2", ..., hashed subgroups from the same ranks and count), so
``PrefixStore(f"{name}/", store)`` holds the dead attempt's rendezvous keys: a rank that reads a peer's
old gloo address before the peer rewrites it fails in ``connectFullMesh`` ("Connection refused"), or waits
in a group its peers already left. Measured with plain ``init_process_group`` + ``new_group``: 3 of 4
restarts failed or hung. The remedy is at the root: the default group is made on
``PrefixStore(f"lightning_zero/attempt/{token}/", agent store)`` with a token fresh to this attempt, and
every later group derives its store from the default group's, so no key of an earlier attempt is ever read.

The token cannot be ``TORCHELASTIC_RESTART_COUNT``: agents restarted by a membership change do not count
it (``_invoke_run``), so nodes can disagree. It is agreed through the store instead, immune to stale keys:
each rank r != 0 asks under a random id of its own (``ask/r`` = id) and waits for ``answer/<id>``, a key no
earlier attempt can have written; rank 0 draws the token and answers whatever id it reads under ``ask/r``
(a stale one gets an answer nobody waits for) until rank r acknowledges under ``ack/<token>/r``.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import time
import uuid
from typing import Any, Optional

import torch.distributed as dist

_ROOT = "lightning_zero/attempt_token/"


def under_agent_store() -> bool:
    """torchrun started this process and its workers share the agent's store (every attempt the same one)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ


def agree_attempt_token(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> str:
    """A token every rank of this attempt gets and no earlier attempt had (see the Note)."""
    if world_size == 1:
        return uuid.uuid4().hex
    if rank != 0:
        mine = uuid.uuid4().hex
        store.set(f"{_ROOT}ask/{rank}", mine)
        store.wait([f"{_ROOT}answer/{mine}"], timeout)
        token = store.get(f"{_ROOT}answer/{mine}").decode()
        store.set(f"{_ROOT}ack/{token}/{rank}", "1")
        return token
    token = uuid.uuid4().hex
    pending, answered = set(range(1, world_size)), {}
    deadline = time.monotonic() + timeout.total_seconds()
    while pending:
        for r in sorted(pending):
            if store.check([f"{_ROOT}ack/{token}/{r}"]):
                pending.discard(r)
            elif store.check([f"{_ROOT}ask/{r}"]):
                asked = store.get(f"{_ROOT}ask/{r}").decode()
                if answered.get(r) != asked:
                    store.set(f"{_ROOT}answer/{asked}", token)
                    answered[r] = asked
        if pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank(s) {sorted(pending)} did not join this torchrun attempt's process group "
                                   f"within {timeout}.")
            time.sleep(0.005)
    return token


def init_attempt_default_group(backend: str, timeout: Optional[datetime.timedelta] = None,
                               device_id: Optional[Any] = None) -> bool:
    """Under torchrun's agent store, make the default group on this attempt's own store prefix; True if made.

    Without torchrun (or once a default group exists) nothing happens and the caller makes it as before."""
    if not dist.is_available() or dist.is_initialized() or not under_agent_store():
        return False
    env = os.environ
    timeout = timeout or datetime.timedelta(minutes=30)
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    token = agree_attempt_token(agent, rank, world_size, timeout)
    store = dist.PrefixStore(f"lightning_zero/attempt/{token}/", agent)
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    destroy_groups_at_exit()
    return True


_AT_EXIT = []


def destroy_groups_at_exit() -> None:
    """Destroy every process group while the interpreter is still whole, for any backend (once a process).

    Lightning registers this for NCCL only. A gloo group left to the interpreter's own teardown aborts
    the process now and then ("terminate called without an active exception", SIGABRT, after fit
    returned: pytorch/pytorch#190489): its C++ worker threads still hold work whose tensors need the
    GIL. A torchrun job then reports a failed worker after a complete run. An earlier atexit handler
    (the user's) runs after this one, so it already finds the groups gone."""
    if not _AT_EXIT:
        _AT_EXIT.append(atexit.register(_destroy_at_exit))


def _destroy_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # the groups this package cached (groups.py) would otherwise live until the interpreter's own teardown,
    # whose destruction of a gloo group is the abort this avoids: let them go while Python is whole
    from .groups import forget_groups

    forget_groups()
    gc.collect()
