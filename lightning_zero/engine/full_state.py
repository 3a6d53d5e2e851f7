"""Whole-model views of a sharded engine: for checkpoints, consolidation and handing the model back.

Design note
-----------
Training never needs a full copy of anything, but users do: a checkpoint must name every parameter, a
consolidated state dict must hold full fp32 values, and after ``fit`` the user expects a normal module.
These functions build those views from the shards -- one all-gather per bucket, in fp32 from the masters
(the module may hold fp16/bf16 copies) -- and describe each shard (name, slice, full shape) so sharded
checkpoints can be written without ever materializing the model on one rank.

They are plain functions of what they read (``rows``: (masters, bucket) pairs in master order, the
module, the stage-3 partitioner); :class:`~.engine.ZeroEngine` exposes them as thin methods of the same
names. Optimizer state is not here: consolidating and re-slicing it belongs to the
:class:`~.optimizer.ShardedOptimizer` that owns the masters and the group layout.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .layout import tensor_parallel as TP
from .optim.param_groups import param_names as _names_by_id
from .layout.sharding import ShardSpec

Rows = list[tuple[list[torch.Tensor], Any]]  # (masters of one bucket, the bucket), in master order
Item = tuple[str, torch.Tensor, ShardSpec, torch.Size]  # (name, this rank's slice, spec, full shape)


@torch.no_grad()
def full_master_params(rows: Rows, sliced: bool, group: Optional[Any] = None) -> list[torch.Tensor]:
    """fp32 full value of every parameter of ``rows``, on every rank (one all-gather per bucket; unless not
    ``sliced``: stage 0's masters are whole already). ``sliced``: a collective, every rank calls it."""
    if not sliced:
        return [m.detach().float().view_as(p) for row, b in rows for m, p in zip(row, b.params)]
    fulls: list[torch.Tensor] = []
    for row, b in rows:
        fulls.extend(b.full_tensors(b.all_gather(row, torch.float32, group)[1]))
    return fulls


@torch.no_grad()
def to_fp32_module(module: nn.Module, params: list[nn.Parameter], fulls: list[torch.Tensor]) -> None:
    """``params`` take the fp32 values ``fulls`` (the masters); every other floating tensor goes to fp32."""
    for p, f in zip(params, fulls):
        TP.set_data(p, f)  # a DTensor keeps its placements: ``f`` is its local piece
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()


@torch.no_grad()
def unpartition(module: nn.Module, partitioner, masters: dict[int, torch.Tensor]) -> None:
    """Stage 3: every parameter whole again on every rank, in fp32 -- from ``masters`` ({id(param): full
    fp32 value}) where given, else from the gathered unit shards -- and the partitioner's hooks removed.
    Collective (one gather of everything)."""
    with partitioner.gathered():
        full = {id(p): p.detach().clone() for p in module.parameters()}
    partitioner.remove_hooks()
    for p in module.parameters():
        p.data = masters.get(id(p), full[id(p)].float() if full[id(p)].is_floating_point() else full[id(p)])
    for b in module.buffers():
        if b.is_floating_point():
            b.data = b.data.float()


@torch.no_grad()
def load_masters_from_module(params: list[nn.Parameter], items: list[Item]) -> None:
    """Cut each master of ``items`` from its (whole) parameter in ``params``. No collective."""
    for p, (_, m, spec, _) in zip(params, items):
        if m is not p:
            flat = TP.local(p).detach().reshape(-1).to(device=m.device, dtype=m.dtype)
            m.copy_((flat if spec.world_size == 1 else flat[spec.lo : spec.hi]).view_as(m))


def param_names(module: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """Fully-qualified name of each of ``params`` (first name of a tied one)."""
    names = _names_by_id(module)
    return [names[id(p)] for p in params]


def master_items(rows: Rows, names: list[str]) -> list[Item]:
    """(name, master, spec, full shape) per parameter of ``rows``; ``names`` in the same order."""
    names_it = iter(names)
    return [(next(names_it), m, spec, p.shape) for row, b in rows for m, p, spec in zip(row, b.params, b.specs)]


def unmanaged_shard_items(module: nn.Module, units, managed: set[int]) -> list[Item]:
    """Stage 3: (name, this rank's slice in the unit shard, spec, shape) of every parameter of ``units``
    whose id is not in ``managed`` (no master: frozen, or all of them in an evaluation-only engine)."""
    names = _names_by_id(module)
    out = []
    for u in units:
        if not u.params:
            continue
        for p, view, spec in zip(u.params, u.local_views(), u.layout.specs):
            if id(p) not in managed:
                out.append((names[id(p)], view, spec, p.shape))
    return out


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state_dict, strict: bool, partitioned: bool, items: list[Item]) -> None:
    """A full (unsharded) state dict into the module and into the slices of ``items`` (masters, stage-3
    unit shards). ``partitioned`` (stage 3): the parameters have no storage of their own, so only buffers
    go through ``load_state_dict``, with its key checks done here. The caller publishes the result."""
    params = dict(module.named_parameters())
    if any(TP.is_dtensor(p) for p in params.values()):  # tensor parallel: each rank loads its pieces
        state_dict = {k: TP.as_like(params[k], TP.local_piece(params[k], v)) if k in params else v
                      for k, v in state_dict.items()}
    if not partitioned:
        module.load_state_dict(state_dict, strict=strict)
    else:
        expected = set(module.state_dict().keys())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error loading a state dict into {type(module).__name__}: missing keys "
                               f"{missing}, unexpected keys {unexpected}.")
        buffers = {n for n, _ in module.named_buffers()}
        module.load_state_dict({k: v for k, v in state_dict.items() if k in buffers}, strict=False)
    for name, m, spec, _ in items:
        if name in state_dict:
            flat = TP.local(state_dict[name]).to(device=m.device, dtype=torch.float32).reshape(-1)
            m.copy_((flat if spec.world_size == 1 else flat[spec.lo : spec.hi]).view_as(m))
