"""Process groups the engine needs besides the user's: made once per process, shared by every engine.

[Note: why a group is never re-created]
Lightning builds a new engine for each entry point (fit, validate, test, ...) in the same process, and
a torchrun/SLURM job runs them all in one process. Stage 3 issues its reduce-scatters on a group of its
own. Creating it with ``new_group(ranks, use_local_synchronization=True)`` (needed when only the
members of a subgroup call it) names it by a hash, ``_hash_ranks_to_str``: ``sha1("0_1_..._" +
str(len(_world.pg_names)))``. Destroying that group removes it from ``_world.pg_names``, so the next
engine's group gets the *same* name, hence the same ``PrefixStore(f"{name}/", default_store)``. The
store still holds the destroyed group's rendezvous keys (gloo's full-mesh addresses, NCCL's unique id):
a rank that arrives first reads its peers' *old* entries and connects to listeners that are gone, so
it hangs or fails in ``connectFullMesh`` while its peers, which found the fresh keys, wait for it
elsewhere (2/10 runs at 2 ranks, every run at 4). Hence: one group per (default group, set of ranks),
made on first use and handed to every later engine; nothing here destroys it per engine. It goes away
with the default group: ``destroy_process_group()`` destroys every group, and a cached group that is no
longer registered (or belongs to an earlier default group) is made afresh under the new one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from . import collectives as C

_GROUPS: dict[tuple, tuple[Any, Any]] = {}  # (id(default pg), ranks) -> (default pg, group)


def _registered(group: Any) -> bool:
    return group in dist.distributed_c10d._world.pg_names


def reduce_scatter_group(group: Optional[Any] = None) -> Any:
    """The stage-3 reduce-scatter group over the ranks of ``group`` (default: WORLD), made once.

    Only the members of ``group`` call this (a subgroup's peers may never get here).
    """
    default = dist.distributed_c10d._get_default_group()
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (id(default), ranks)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is default and _registered(hit[1]):
        return hit[1]
    for k in [k for k, (pg, g) in _GROUPS.items() if pg is not default or not _registered(g)]:
        del _GROUPS[k]  # left over from a destroyed default group: drop the reference, nothing to destroy
    whole = len(ranks) == dist.get_world_size()
    # every rank calls for the whole world: a counter-named group (names never repeat); a subgroup needs
    # local synchronization (only members call), named by the hash above -- safe because it is made once
    made = dist.new_group(list(ranks), use_local_synchronization=not whole)
    C.label_group(made, "stage3_reduce")  # how comm_report() names it
    _GROUPS[key] = (default, made)
    return made


def cached_groups() -> int:
    """How many groups this process holds (for tests: later engines must not add any)."""
    return len(_GROUPS)
