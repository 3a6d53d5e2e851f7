"""Clearing gradients: what a ``zero_grad`` the user calls does to an engine's reduced gradients
([Note: clearing reduced gradients])."""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import tensor_parallel as TP

# [Note: clearing reduced gradients]
# At stages 1-3 a backward leaves its gradients in the reducer's gradient shards (and, once a norm or a
# clip asked for them, in the masters' ``.grad``), not in ``param.grad``: torch's ``zero_grad``, which sets
# ``param.grad`` only, clears none of it, and the next step would add what an earlier backward left (a GAN's
# discriminator stepping on the generator's backward too). Every ``zero_grad`` a user can call -- an
# optimizer's through any wrapper (optimizer_routes.py), the module's or any submodule's (module_routes.py),
# Fabric's module wrapper -- ends here with the parameters it names and torch's ``set_to_none``:
# - ``set_to_none=True``: the contributions and the "got a gradient" counts go, so a parameter no rank uses
#   again before the step keeps ``grad=None`` and is not stepped, as under DDP;
# - ``set_to_none=False``: the contributions become zeros and the counts stay, so a parameter that had a
#   gradient steps on a zero one, as on torch's zeroed ``.grad``.
# A bucket whose parameters are all named is dropped whole (its shards freed, or zeroed); part of a bucket
# (a submodule's parameters beside others of the same optimizer) is zeroed in place: each named parameter's
# slice of this rank's shard, of its host copy and of hybrid sharding's unreplicated sum, and its count.


def clear_optimizers(shardeds, reducer, everything: bool, set_to_none: bool) -> None:
    """An optimizer's ``zero_grad`` (``everything``: the engine's, every optimizer): their rows' reduced
    gradients and their masters' ``.grad``, and the step's bookkeeping (master_grads.py)."""
    reducer.clear(None if everything else [b for s in shardeds for b in s.buckets], set_to_none)
    for s in shardeds:
        s.clear_grads()
        s.reset_step_state()


def clear_params(shardeds, reducer, params, set_to_none: bool) -> None:
    """``module.zero_grad()`` of the engine's module or a submodule (module_routes.py): the gradients of
    ``params`` only -- whole optimizers as their own ``zero_grad``, part of one in place."""
    whole, part = split_by_optimizer(shardeds, params)
    for s in whole:
        clear_optimizers([s], reducer, False, set_to_none)
    for s, k, positions in part:
        reducer.clear_params(reducer.rows[s.buckets[k].index], positions, set_to_none)
        clear_masters(s, k, positions, set_to_none)


def zero_params(row, positions, set_to_none: bool, sharded: bool) -> None:
    """The gradients of parameters ``positions`` of the bucket ``row`` (bucket_rows.py) in place: their
    ``param.grad``, their slices of this rank's reduced shard and of its host copy (stages 1-3), of hybrid's
    unreplicated sum (its counts behind it) and, with ``set_to_none``, their counts of users."""
    positions = list(positions)
    bucket = row.bucket
    n = len(bucket.params)
    for j in positions:
        p = bucket.params[j]
        if set_to_none:
            p.grad = None
        elif p.grad is not None:  # stage 0's reduced gradient, or one not reduced yet (no_sync)
            TP.local_grad(p).zero_()
    if sharded:
        if row.host is not None and row.shard is not None and row.shard.is_cuda:
            # offload: the boundary's device->host copy may still be landing in the pinned buffer
            torch.cuda.current_stream(row.shard.device).synchronize()
        seen: set[int] = set()
        for flat in (row.shard, row.host):
            if flat is not None and id(flat) not in seen:  # a CPU run's host copy is the shard itself
                seen.add(id(flat))
                _zero_views(bucket.local_views(flat), positions)
        if row.unreplicated is not None:
            _zero_views(bucket.local_views(row.unreplicated[:-n]), positions)
            _zero_counts(row.unreplicated[-n:], positions, set_to_none)
    _zero_counts(row.used, positions, set_to_none)


def clear_masters(sharded, k: int, positions, set_to_none: bool) -> None:
    """Masters ``positions`` of the optimizer's bucket ``k`` once its gradients were taken (a norm or a clip
    ran before this ``zero_grad``): their ``.grad`` (and 1-bit Adam's local copies) cleared; the cached norm
    is no longer this step's."""
    if not sharded.grads_final:
        return
    for j in positions:
        m = sharded.masters[k][j]
        if set_to_none:
            sharded.whole_grads.pop(id(m), None)
            m.grad = None
            continue
        for g in (sharded.whole_grads.get(id(m)), m.grad):
            if g is not None:
                g.zero_()
    sharded.sq_norm = None


def split_by_optimizer(shardeds, params) -> tuple[list, list[tuple]]:
    """The sharded optimizers all of whose parameters are in ``params`` (cleared whole, as their own
    ``zero_grad``), and for the others ``(sharded, k, positions)``: the named parameters of their bucket ``k``."""
    named = {id(p) for p in params}
    whole, part = [], []
    for s in shardeds:
        hits = [(k, [j for j, p in enumerate(b.params) if id(p) in named]) for k, b in enumerate(s.buckets)]
        if all(len(pos) == len(b.params) for (_, pos), b in zip(hits, s.buckets)):
            whole.append(s)
        else:
            part += [(s, k, pos) for k, pos in hits if pos]
    return whole, part


def _zero_views(views: list[torch.Tensor], positions) -> None:
    for j in positions:
        views[j].zero_()


def _zero_counts(counts: Optional[torch.Tensor], positions, set_to_none: bool) -> None:
    if counts is not None and set_to_none:
        counts[list(positions)] = 0
