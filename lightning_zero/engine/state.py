"""Optimizer state <-> shards: consolidate for a portable checkpoint, re-slice on load.

Design note
-----------
Because every rank owns the same slice of every parameter, the full optimizer state of a parameter is
just the concatenation of its slices in rank order. Consolidation gathers each bucket's state with one
all-gather per state key and returns, on rank 0, exactly what an unsharded optimizer over the same
parameters would save (``state`` keyed by position in ``param_groups``, tensors shaped like the
parameter). Loading re-slices that full state for the current world size and stage. The checkpoint is
therefore independent of how it was sharded: N ranks -> M ranks and stage a -> stage b both just work.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from . import collectives as C

if TYPE_CHECKING:  # pragma: no cover
    from .engine import ZeroEngine


def _master_index(engine: "ZeroEngine") -> list[tuple[int, int]]:
    """(bucket, position) of each master in the order the optimizer's param_groups list them."""
    where = {}
    for bi, row in enumerate(engine.sharded.masters):
        for pi, m in enumerate(row):
            where[id(m)] = (bi, pi)
    return [where[id(m)] for g in engine.optimizer.param_groups for m in g["params"]]


def _is_sharded_value(v, engine, bi, pi) -> bool:
    m = engine.sharded.masters[bi][pi]
    return torch.is_tensor(v) and v.dim() > 0 and v.shape == m.shape


def consolidate_optimizer_state(engine: "ZeroEngine") -> dict:
    local = engine.optimizer.state_dict()
    if engine.config.stage == 0:
        return local if engine.rank == 0 else {}
    order = _master_index(engine)
    pos_of = {bp: i for i, bp in enumerate(order)}
    keys = sorted({k for st in local["state"].values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})
    full_state: dict[int, dict] = {i: {} for i in range(len(order))}
    for i, (bi, pi) in enumerate(order):
        for k, v in local["state"].get(i, {}).items():
            if not _is_sharded_value(v, engine, bi, pi):
                full_state[i][k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
    for b in engine.buckets:
        for key in keys:
            # every rank must join the same collectives: present = any rank has this key for this bucket
            vals = [local["state"].get(pos_of[(b.index, pi)], {}).get(key) for pi in range(len(b.params))]
            have = torch.tensor([v is not None for v in vals], dtype=torch.uint8, device=b.params[0].device)
            C.all_reduce(have, op=torch.distributed.ReduceOp.MAX if engine.world_size > 1 else None,
                         group=engine.group)
            if not have.any():
                continue
            send = torch.zeros(b.shard_numel, dtype=torch.float32, device=b.params[0].device)
            for view, v in zip(b.local_views(send), vals):
                if v is not None:
                    view.copy_(v.reshape(-1))
            out = torch.empty(b.world_size * b.shard_numel, dtype=torch.float32, device=send.device)
            C.all_gather(out, send, group=engine.group)
            if engine.rank != 0:
                continue
            fulls = [torch.empty(p.shape, dtype=torch.float32, device=send.device) for p in b.params]
            b.unpack_rank_major(out, fulls)
            for pi, (f, present) in enumerate(zip(fulls, have.tolist())):
                if present:
                    full_state[pos_of[(b.index, pi)]][key] = f.cpu()
    if engine.rank != 0:
        return {}
    state = {i: st for i, st in full_state.items() if st}
    return {"state": state, "param_groups": local["param_groups"]}


def load_sharded_optimizer_state(engine: "ZeroEngine", full: dict) -> None:
    if "state" not in full or "param_groups" not in full:
        raise ValueError("Not an optimizer state dict: expected the keys 'state' and 'param_groups'.")
    order = _master_index(engine)
    n_saved = sum(len(g["params"]) for g in full["param_groups"])
    if n_saved != len(order) or len(full["param_groups"]) != len(engine.optimizer.param_groups):
        raise ValueError(
            f"Optimizer state does not match: the checkpoint has {len(full['param_groups'])} param group(s) "
            f"with {n_saved} parameter(s); this optimizer has {len(engine.optimizer.param_groups)} group(s) "
            f"with {len(order)} trainable parameter(s)."
        )
    local_state = {}
    for i, (bi, pi) in enumerate(order):
        st = full["state"].get(i, full["state"].get(str(i)))
        if st is None:
            continue
        b, m = engine.buckets[bi], engine.sharded.masters[bi][pi]
        spec, p = b.specs[pi], b.params[pi]
        out = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                if v.numel() != p.numel():
                    raise ValueError(
                        f"Optimizer state '{k}' of parameter #{i} has {v.numel()} elements; the parameter has "
                        f"{p.numel()}. The checkpoint belongs to another model."
                    )
                v = v.reshape(-1)[spec.lo : spec.hi] if engine.config.stage >= 1 else v.reshape(p.shape)
                out[k] = v.to(device=m.device, dtype=m.dtype).clone()
            else:
                out[k] = v
        local_state[i] = out
    engine.optimizer.load_state_dict({"state": local_state, "param_groups": copy.deepcopy(full["param_groups"])})
