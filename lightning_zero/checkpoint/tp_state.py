"""Checkpoint entries of a tensor-parallel engine: every parameter in full parameter coordinates.

Design note
-----------
Without tensor parallelism a master is a slice of the flattened *global* parameter, so the flat DTensor
``Shard(0)`` of :mod:`.sharded_state` is a global tensor DCP can reshard. With tensor parallelism a master
is a slice of the flattened *local piece*, and the concatenation of the pieces' slices is no global
tensor. So a TP engine writes each managed parameter (and each per-element optimizer state) in its natural
shape: the master gathered over its shard group one parameter at a time -- the local piece whole --
wrapped as a DTensor on the 2-D mesh with ``Replicate()`` on "data_parallel" (DCP writes one copy) and the
parameter's own placement on "tensor_parallel". The json marks such a checkpoint ``"layout": "natural"``.

Loading maps back by the same rule from either layout: a TP engine reads its local piece (a DTensor target
for a natural entry; the whole tensor for a flat entry, then cut) and keeps this rank's slice of it; an
engine without TP reads a natural entry whole and slices it, as it does for a checkpoint saved without an
engine. ``lightning-zero consolidate`` reads natural entries as they are.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..engine.comm import collectives as C
from ..engine.layout import tensor_parallel as TP

NATURAL = "natural"  # zero_checkpoint.json "layout": per-parameter entries in full parameter coordinates


def is_tp(engine) -> bool:
    return getattr(engine, "tensor_parallel", None) is not None


def _slice(full: torch.Tensor, spec) -> torch.Tensor:
    flat = full.reshape(-1)
    return flat if spec.world_size == 1 else flat[spec.lo : spec.hi]


@torch.no_grad()
def _local_piece_whole(t: torch.Tensor, spec, p: torch.Tensor, group: Any) -> torch.Tensor:
    """The local piece of ``p`` from a master-shaped ``t`` (this rank's slice): all-gathered over ``group``."""
    t = t.detach()
    if spec.world_size == 1:
        return t.reshape(TP.local_shape(p))
    send = torch.zeros(spec.shard_numel, dtype=t.dtype, device=t.device)
    send[: spec.shard_len].copy_(t.reshape(-1))
    out = torch.empty(spec.world_size * spec.shard_numel, dtype=t.dtype, device=t.device)
    C.all_gather(out, send, group=group)
    return out[: spec.numel].view(TP.local_shape(p))


def _on_mesh(engine, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (``p``'s local piece, whole) as a global tensor: a DTensor Replicate on data_parallel and
    ``p``'s placement on tensor_parallel; a parameter every rank holds whole stays a plain tensor."""
    if not TP.is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor, Replicate

    mesh = engine.tensor_parallel.mesh
    placements = [Replicate() if name == TP.DP_DIM else p.placements[0] for name in mesh.mesh_dim_names]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters())


def natural_entry_fn(engine, module: nn.Module) -> Callable[[torch.Tensor, str, Any], torch.Tensor]:
    """``entry(t, name, spec)``: the checkpoint entry of a master-shaped ``t`` of parameter ``name``.
    Collective over the shard group (every rank calls it for the same names, in the same order): the group the
    masters are sliced over -- the data-parallel group, or under hybrid sharding one of its shard groups, whose
    replicas gather the same values (DCP writes the ``Replicate()`` entry once)."""
    params, group = params_of(module), engine.shard_group

    def entry(t: torch.Tensor, name: str, spec) -> torch.Tensor:
        p = params[name]
        return _on_mesh(engine, p, _local_piece_whole(t, spec, p, group))

    return entry


def load_target(engine, p: torch.Tensor, m: torch.Tensor, spec, shape, saved_flat: bool
                ) -> tuple[torch.Tensor, Callable[[], None]]:
    """What DCP fills for the master-shaped ``m`` (this rank's slice of parameter ``p``, global ``shape``)
    and the copy of that slice into ``m`` afterwards. ``saved_flat``: the entry is a flat global 1-D tensor.
    Read in fp32 (what masters and moments are), cast by the copy."""
    if TP.is_dtensor(p) and not saved_flat:  # the local piece only
        local = torch.empty(TP.local_shape(p), dtype=torch.float32, device=m.device)
        return _on_mesh(engine, p, local), lambda: m.copy_(_slice(local, spec).view_as(m))
    full = torch.empty(torch.Size(shape).numel() if saved_flat else shape, dtype=torch.float32, device=m.device)
    return full, lambda: m.copy_(_slice(TP.local_piece(p, full.view(shape)), spec).view_as(m))


def needs_natural_load(engine, info: Optional[dict]) -> bool:
    """Entries are mapped per parameter (not loaded as flat shards in place): a TP engine, or a TP checkpoint."""
    return is_tp(engine) or (info or {}).get("layout") == NATURAL
