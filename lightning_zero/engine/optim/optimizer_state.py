"""Optimizer state <-> shards of one ShardedOptimizer: consolidate for a portable checkpoint, re-slice on load.

Design note
-----------
Because every rank owns the same slice of every parameter, the full optimizer state of a parameter is
just the concatenation of its slices in rank order. Consolidation gathers each bucket's state with one
all-gather per state key and returns, on rank 0, exactly what a plain optimizer over the user's original
``param_groups`` would save: ``state`` keyed by position (frozen parameters keep their position and have
no state), tensors shaped like the parameter. Loading re-slices that full state for the current world
size and stage. The result is independent of how it was sharded: N ranks -> M ranks, stage a -> stage b,
and to or from a plain (DDP) run all just work.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from ..comm import collectives as C
from .onebit.local_models import mean_state, rank_local_keys
from .kinds import per_rank_state


def _positions(s) -> list[Optional[tuple[int, int]]]:
    """Per original optimizer position: (bucket of ``s``, index) of its master, or None for a frozen one."""
    where = {id(m): (bi, pi) for bi, row in enumerate(s.masters) for pi, m in enumerate(row)}
    return [where[id(m)] if m is not None else None for g in s.group_layout for m in g]


def _groups_with_positions(s, groups: list[dict]) -> list[dict]:
    out, pos = [], 0
    for g, layout in zip(groups, s.group_layout):
        g = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
        g["params"] = list(range(pos, pos + len(layout)))
        pos += len(layout)
        out.append(g)
    return out


def consolidate_optimizer_state(s, group: Optional[Any] = None) -> dict:
    """The full state of the ShardedOptimizer ``s`` on rank 0 of ``group`` (``{}`` elsewhere). Collective."""
    if s.owner is not None:
        return _consolidate_owned(s, group)
    sliced, rank, world_size = s.plan.shards_optimizer_state, C.rank(group), C.world_size(group)
    local = s.optimizer.state_dict()
    positions = _positions(s)
    # torch numbers the masters in param_groups order: map them to (bucket, index)
    local_bp = [bp for bp in positions if bp is not None]
    by_bp = {bp: local["state"].get(i, {}) for i, bp in enumerate(local_bp)}
    per_rank = per_rank_state(s.optimizer)  # 1-bit Adam's error buffers: no single full value
    # 0/1 Adam between synchronizations: the one value is the ranks' mean ([Note: the ranks' own models])
    means = mean_state(s) if rank_local_keys(s.optimizer) else {}
    keys = sorted({k for st in by_bp.values() for k, v in st.items()
                   if torch.is_tensor(v) and v.dim() > 0 and k not in per_rank})
    full_by_bp: dict[tuple[int, int], dict] = {bp: {} for bp in local_bp}
    for (bi, pi), st in by_bp.items():
        m = s.masters[bi][pi]
        for k, v in st.items():
            if k in per_rank:
                continue
            if not (torch.is_tensor(v) and v.dim() > 0 and v.shape == m.shape):
                full_by_bp[(bi, pi)][k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
            elif not sliced:  # whole masters: their state is whole already
                full_by_bp[(bi, pi)][k] = means.get((id(m), k), v).detach().cpu().clone()
    if sliced:
        for bi, b in enumerate(s.buckets):
            dev = b.params[0].device
            for key in keys:
                vals = [by_bp.get((bi, pi), {}).get(key) for pi in range(len(b.params))]
                # every rank joins the same collectives: present = any rank has this key for this param
                have = torch.tensor([v is not None for v in vals], dtype=torch.uint8, device=dev)
                C.all_reduce(have, op=torch.distributed.ReduceOp.MAX if world_size > 1 else None,
                             group=group)
                if not have.any():
                    continue
                _, out = b.all_gather(vals, torch.float32, group)
                if rank != 0:
                    continue
                fulls = b.full_tensors(out)
                for pi, (f, present) in enumerate(zip(fulls, have.tolist())):
                    if present:
                        full_by_bp[(bi, pi)][key] = f.cpu()
    if rank != 0:
        return {}
    state = {i: full_by_bp[bp] for i, bp in enumerate(positions) if bp is not None and full_by_bp[bp]}
    return {"state": state, "param_groups": _groups_with_positions(s, local["param_groups"])}


def load_sharded_optimizer_state(s, full: dict) -> None:
    """Re-slice a full optimizer state (any world size or stage) into the shards of ShardedOptimizer ``s``."""
    if "state" not in full or "param_groups" not in full:
        raise ValueError("Not an optimizer state dict: expected the keys 'state' and 'param_groups'.")
    layout = s.group_layout
    saved = [len(g["params"]) for g in full["param_groups"]]
    if saved != [len(g) for g in layout]:
        raise ValueError(
            f"Optimizer state does not match: the checkpoint's param groups hold {saved} parameter(s); "
            f"this optimizer's hold {[len(g) for g in layout]}. The checkpoint belongs to another model "
            "or another configure_optimizers()."
        )
    positions = _positions(s)
    saved_ids = [i for g in full["param_groups"] for i in g["params"]]
    if s.owner is not None:
        return _load_owned(s, full, positions, saved_ids)
    local_state, local_index = {}, 0
    for pos, bp in enumerate(positions):
        if bp is None:
            continue
        st = full["state"].get(saved_ids[pos], full["state"].get(str(saved_ids[pos])))
        if st is not None:
            local_state[local_index] = _slice_state(s, bp, st, pos)
        local_index += 1
    groups, n = [], 0
    for g, lay in zip(full["param_groups"], layout):
        g = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
        k = sum(m is not None for m in lay)
        g["params"] = list(range(n, n + k))
        n += k
        groups.append(g)
    s.optimizer.load_state_dict({"state": local_state, "param_groups": groups})


def _consolidate_owned(s, group) -> dict:
    """Owner-rank step ([Note: owner-rank step]): each parameter's state is whole on its owner; the first
    rank gathers every owner's entries, keyed by position (one object per rank, a checkpoint's rare path)."""
    mine = {}
    for pos, bp in enumerate(_positions(s)):
        holder = None if bp is None else s.state_holder(s.masters[bp[0]][bp[1]])
        st = s.optimizer.state.get(holder) if holder is not None else None
        if st:
            mine[pos] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in st.items()}
    pieces = C.gather_object(mine, group)
    if pieces is None:
        return {}
    state = {pos: st for piece in pieces for pos, st in piece.items()}
    return {"state": dict(sorted(state.items())), "param_groups": _groups_with_positions(s, s.optimizer.param_groups)}


def _load_owned(s, full: dict, positions: list, saved_ids: list) -> None:
    """A full state into the owner-rank step: each rank keeps the whole state of the parameters it owns."""
    for pos, bp in enumerate(positions):
        holder = None if bp is None else s.state_holder(s.masters[bp[0]][bp[1]])
        if holder is None:
            continue
        s.optimizer.state.pop(holder, None)
        st = full["state"].get(saved_ids[pos], full["state"].get(str(saved_ids[pos])))
        if st is not None:
            s.optimizer.state[holder] = {k: whole_state_value(k, v, holder) for k, v in st.items()}
    for g, saved in zip(s.optimizer.param_groups, full["param_groups"]):
        g.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})


def whole_state_value(key: str, v, holder: torch.Tensor):
    """A saved state entry for the whole master ``holder``: parameter-sized tensors in its shape (a checkpoint
    may hold them flat), floating ones in its dtype, all on its device; ``step`` as saved (torch's rule)."""
    if not torch.is_tensor(v):
        return copy.deepcopy(v)
    if key == "step":
        return v.clone()
    if v.dim() > 0 and v.numel() == holder.numel():
        v = v.reshape(holder.shape)
    return v.to(device=holder.device, dtype=holder.dtype if v.is_floating_point() else v.dtype).clone()


def _slice_state(s, bp: tuple[int, int], st: dict, pos: int) -> dict:
    bi, pi = bp
    b, m = s.buckets[bi], s.masters[bi][pi]
    spec, p = b.specs[pi], b.params[pi]
    out = {}
    for k, v in st.items():
        if k in per_rank_state(s.optimizer):  # restarts at zero (engine/optim/onebit/base.py)
            continue
        if torch.is_tensor(v) and v.dim() > 0:
            if v.numel() != p.numel():
                raise ValueError(
                    f"Optimizer state '{k}' at position {pos} has {v.numel()} elements; the parameter has "
                    f"{p.numel()}. The checkpoint belongs to another model."
                )
            v = v.reshape(-1)[spec.lo : spec.hi] if s.plan.shards_optimizer_state else v.reshape(p.shape)
            out[k] = v.to(device=m.device, dtype=m.dtype).clone()
        else:
            out[k] = v
    return out


@torch.no_grad()
def zero_lr_step(opt: torch.optim.Optimizer, masters: list[torch.Tensor]) -> None:
    """Create the optimizer's state tensors (one step on zero gradients at lr 0; the masters are restored)."""
    need = [m for m in masters if not opt.state.get(m)]
    if not need:
        return
    keep = [m.detach().clone() for m in need]
    grads = {id(m): getattr(m, "grad", None) for row in opt.param_groups for m in row["params"]}
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        for m in g["params"]:
            m.grad = None
    for m in need:
        m.grad = torch.zeros_like(m)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
        for m in g["params"]:
            m.grad = grads[id(m)]
    for m, k in zip(need, keep):
        m.copy_(k)
