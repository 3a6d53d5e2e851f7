"""Tensor parallelism composed with ZeRO: the engine on a 2-D ("data_parallel", "tensor_parallel") mesh.

Design note
-----------
The user applies torch's ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``) over the
mesh's "tensor_parallel" dim, so some parameters become DTensors whose *local* tensor is one TP rank's
piece. ZeRO then treats every parameter by its local tensor and shards that over the "data_parallel" dim
only (under hybrid sharding over a shard group of K of its ranks, replicated across the others: [Note: one
parallel layout]): buckets, masters, reduce-scatters, the publish and the used-parameter mask never see a DTensor.
The ranks of one TP group hold different pieces and see the same data, so nothing of ZeRO crosses the TP
group except the gradient norm: a piece sharded over TP adds its squares to the other pieces', a
parameter replicated over TP (a LayerNorm, a row-parallel bias) holds the same gradient on every TP rank
and must count once -- its squares are weighted 1/T before the one sum over the TP group.

Every place of the engine that reads or writes a parameter's values or gradient goes through
:func:`local` / :func:`local_grad` here; for a plain tensor they are the identity, so an engine without a
mesh runs exactly as before. Stages 0-2 are supported; stage 3 would have to gather DTensor pieces inside
units (refused by layout.py's ``STAGES_WITH``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..comm import collectives as C

DP_DIM, TP_DIM = "data_parallel", "tensor_parallel"  # Lightning's ModelParallelStrategy names the dims so

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - older torch: no tensor parallelism, every tensor is plain
    DTensor, Replicate = None, None


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(p: torch.Tensor) -> torch.Tensor:
    """The tensor the engine shards: a DTensor's local piece (sharing its storage), else ``p`` itself."""
    return p._local_tensor if is_dtensor(p) else p


def local_data(p: torch.Tensor) -> torch.Tensor:
    """``p.data`` of the local piece: written by the publish and broadcasts without autograd noticing."""
    return p._local_tensor if is_dtensor(p) else p.data


def local_numel(p: torch.Tensor) -> int:
    return local(p).numel()


def local_shape(p: torch.Tensor) -> torch.Size:
    return local(p).shape


def local_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The local piece of ``p``'s gradient in ``p``'s own placements (a pending partial sum -- a replicated
    parameter used by a partial result -- is reduced over the TP group first)."""
    g = p.grad
    if g is None or not is_dtensor(g):
        return g
    if tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g._local_tensor


def set_grad(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.grad = value`` for a local-shaped ``value`` (stage 0 writes its all-reduced gradients back)."""
    p.grad = as_like(p, value) if is_dtensor(p) else value


def as_like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A local-shaped ``value`` as a tensor like ``p`` (a DTensor with ``p``'s mesh and placements)."""
    if not is_dtensor(p):
        return value
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def set_data(p: nn.Parameter, value: torch.Tensor) -> None:
    """``p.data = value`` for a local-shaped ``value`` (the fp32 module handed back). A DTensor keeps its
    local piece and dtype in Python attributes ``.data =`` does not reach: the parameter object is swapped
    in place instead, as ``nn.Module._apply`` does for DTensors (references to ``p`` stay valid).

    The swap leaves ``p``'s post-accumulate-grad hooks (the reducer's) in ``p``'s Python dict but not on
    the new tensor autograd reads them from: they would never fire again, and a later backward would
    reduce nothing. Assigning the dict back installs it on the new tensor; the hooks' handles stay valid."""
    if not is_dtensor(p):
        p.data = value
        return
    torch.utils.swap_tensors(p, nn.Parameter(as_like(p, value), requires_grad=p.requires_grad))
    if p._post_accumulate_grad_hooks is not None:
        p._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks


def full_value(t: Any) -> Any:
    """A DTensor's global value (a collective over its mesh); anything else unchanged."""
    return t.full_tensor() if is_dtensor(t) else t


def norm_weight(p: torch.Tensor, tp_size: int) -> float:
    """What ``p``'s squared gradient counts for in the sum over the TP group: 1 for a piece of a sharded
    parameter, 1/T for a parameter every TP rank holds whole (plain, or Replicate on the TP mesh)."""
    if is_dtensor(p) and not all(isinstance(pl, Replicate) for pl in p.placements):
        return 1.0
    return 1.0 / tp_size


def local_piece(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` (the global value of ``p``): ``full`` itself for a plain parameter."""
    if not is_dtensor(p):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


class TensorParallelMesh:
    """The engine's view of a ("data_parallel", "tensor_parallel") mesh: ZeRO's group, the norm's group."""

    def __init__(self, mesh: Any) -> None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh.ndim != 2 or set(names) != {DP_DIM, TP_DIM}:
            raise ValueError(f"device_mesh must be a 2-D DeviceMesh with mesh_dim_names ({DP_DIM!r}, {TP_DIM!r}) (e.g. "
                             f"init_device_mesh(device, (N // T, T), mesh_dim_names=({DP_DIM!r}, {TP_DIM!r}))); got "
                             f"{mesh.ndim} dim(s) named {names}.")
        self.mesh = mesh
        self.dp_group = mesh.get_group(DP_DIM)
        self.tp_group = mesh.get_group(TP_DIM)
        self.tp_size = mesh.size(names.index(TP_DIM))
        self.dp_size = mesh.size(names.index(DP_DIM))
        # every data-parallel group of the mesh (one per tensor position), as world ranks: hybrid sharding cuts
        # its groups inside each, and every rank must create all of them (engine/layout/groups.py)
        grid = mesh.mesh if names.index(DP_DIM) == 0 else mesh.mesh.T
        self.dp_rank_sets = tuple(tuple(grid[:, t].tolist()) for t in range(self.tp_size))

    def check_params(self, module: nn.Module) -> None:
        """Every DTensor parameter lives on this mesh's tensor-parallel dim (one clear error otherwise)."""
        tp_ranks = self.mesh[TP_DIM].mesh.flatten().tolist()
        for name, p in module.named_parameters():
            if not is_dtensor(p):
                continue
            sub = p.device_mesh
            if tuple(sub.mesh_dim_names or ()) != (TP_DIM,) or sub.mesh.flatten().tolist() != tp_ranks:
                raise ValueError(
                    f"Parameter '{name}' is a DTensor on mesh {tuple(sub.mesh_dim_names or ())} "
                    f"{sub.mesh.tolist()}; ZeRO's tensor parallelism needs every DTensor parameter on "
                    f"device_mesh[{TP_DIM!r}] (parallelize_module(model, device_mesh[{TP_DIM!r}], plan)).")


def check_no_full_optimizer_state(tp: Optional[TensorParallelMesh]) -> None:
    """A consolidated optimizer state would hold each TP rank's pieces under the same positions."""
    if tp is not None:
        raise NotImplementedError("A full (consolidated) optimizer state_dict is not available with tensor "
                                  "parallelism. Allowed: sharded checkpoints (checkpoint/format.py "
                                  "save_engine_checkpoint / load_checkpoint_dir), which reshard across T and N.")


def mesh_tp_size(mesh: Any) -> int:
    """T of a ("data_parallel", "tensor_parallel") mesh (checked to be one)."""
    return TensorParallelMesh(mesh).tp_size


def tensor_parallel_view(mesh: Any, group: Any, module: nn.Module) -> Optional[TensorParallelMesh]:
    """The engine's TP view of ``mesh`` (None without one); the dims' combinations and stages are refused by
    layout.py's tables (engine/layout/groups.py ``engine_groups``), what is the mesh's own business here."""
    if mesh is None:
        for name, p in module.named_parameters():
            if is_dtensor(p):
                raise ValueError(f"Parameter '{name}' is a DTensor (tensor parallel); ZeRO needs the mesh it came "
                                 f"from: pass device_mesh=<the 2-D ({DP_DIM!r}, {TP_DIM!r}) DeviceMesh> to the engine.")
        return None
    if group is not None:
        raise ValueError("device_mesh and group are exclusive: with a mesh ZeRO shards over its "
                         f"{DP_DIM!r} dim. Allowed: device_mesh=... or group=..., not both.")
    tp = TensorParallelMesh(mesh)
    tp.check_params(module)
    return tp


@torch.no_grad()
def broadcast_module_states(module: nn.Module, group: Any) -> None:
    """The parameters (their local pieces) and buffers of the first rank of ``group`` on all its ranks."""
    if C.world_size(group) > 1:
        C.broadcast_flat([local_data(p) for p in module.parameters()] + list(module.buffers()), group)
