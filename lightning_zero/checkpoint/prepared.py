"""One checkpoint directory's content, prepared on the training thread and written by whichever thread saves it.

[Note: a save in two halves]
A save has a half that must run where training runs and a half that need not. ``prepare_checkpoint`` is the
first: the collectives that check every rank agrees on what is saved (``_check_optimizer_keys``, the
rank-local entries), the json's description of every tensor (it reads the module and the engine), and the
DCP state dict itself, whose tensors are the engine's live masters and optimizer state. ``write_prepared`` is
the second: DCP's write, ``meta.pt``, the integrity listing and the json -- collectives only over the group it
is given. A synchronous save runs both back to back on the live tensors; an asynchronous one
(async_save.py) first copies every tensor to the host (:meth:`PreparedCheckpoint.staged`) so training may
change the live ones while a background thread writes the copy over a group of its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..engine.comm.collectives import rank as _rank
from ..engine.config import STATE_DTYPE_KNOBS
from . import integrity, tp_state as TS, trainable_only as TO
from .atomic import agree_on_failure
from .names import FORMAT, INFO_FILE, META_FILE, VERSION, optim_key as _optim_key
from .rank_local import RANKS_KEY, rank_local_entries
from .sharded_state import _canonical, _managed


@dataclass
class PreparedCheckpoint:
    """What one directory holds: the DCP ``tensors``, and on the group's first rank ``meta`` (``meta.pt``) and
    ``info`` (the json without its file listing, which only the write knows)."""

    tensors: dict
    meta: Optional[dict]
    info: Optional[dict]

    def staged(self, pinned: bool = False) -> tuple["PreparedCheckpoint", Optional[Any]]:
        """A copy whose every tensor lives in host memory of its own (page-locked when ``pinned``), and the
        CUDA event after which the copy is complete (None: complete already). Tensors shared between entries
        stay shared; DTensors keep their mesh and placements (DCP plans the write from them)."""
        memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the source, kept alive: ids recycle)
        cuda = []

        def copy(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in memo:
                from torch.distributed.tensor import DTensor

                if isinstance(t, DTensor):
                    local = t.to_local()
                    out = DTensor.from_local(copy(local), t.device_mesh, t.placements, run_check=False,
                                             shape=t.shape, stride=t.stride())
                else:
                    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned and t.is_cuda)
                    out.copy_(t.detach(), non_blocking=t.is_cuda)
                    cuda.append(t.is_cuda)
                memo[id(t)] = (t, out)
            return memo[id(t)][1]

        staged = replace(self, tensors=_map_tensors(self.tensors, copy),
                         meta=None if self.meta is None else _map_tensors(self.meta, copy))
        done = None
        if any(cuda):  # the copies are queued on the current stream, behind the step that made the values
            done = torch.cuda.Event()
            done.record()
        return staged, done


def _map_tensors(obj: Any, fn) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples replaced by ``fn(tensor)``; other values kept."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: _map_tensors(v, fn) for k, v in obj.items()}
        if all(out[k] is v for k, v in obj.items()):
            return obj  # nothing to copy: keep the caller's object (and its type) as it is
        try:
            return out if type(obj) is dict else type(obj)(out)  # OrderedDict, Lightning's AttributeDict
        except Exception:
            return out
    if type(obj) in (list, tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def prepare_checkpoint(model_state: Mapping[str, torch.Tensor], module: nn.Module, engine=None,
                       optimizer_state: Any = None, metadata: Optional[dict] = None,
                       process_group=None) -> PreparedCheckpoint:
    """The first half of a save (see the note): collective over ``process_group`` (default: the world)."""
    opt_states = list(optimizer_state) if isinstance(optimizer_state, (list, tuple)) else (
        [optimizer_state] if optimizer_state is not None else [])
    state_kinds = _check_optimizer_keys(opt_states[0] if opt_states else None, process_group)
    more_kinds = [_check_optimizer_keys(st, process_group) for st in opt_states[1:]]
    tensors = {"model": dict(model_state)}
    for k, st in enumerate(opt_states):
        tensors[_optim_key(k)] = {"state": st["state"]}
    # 0/1 Adam between synchronizations: each rank's own model beside the mean (rank_local.py)
    rank_tensors, rank_listed = rank_local_entries(engine, _optim_key, process_group) if opt_states else ({}, {})
    if rank_tensors:
        tensors[RANKS_KEY] = rank_tensors
    if _rank(process_group) != 0:
        return PreparedCheckpoint(tensors, None, None)
    meta, reference = TO.split_reference(dict(metadata or {}))  # [Note: trainable-only checkpoints]
    if opt_states:
        meta["optimizer_states"] = [{k: v for k, v in st.items() if k != "state"} for st in opt_states]
    info = _info(model_state, module, engine, state_kinds, process_group)
    TO.record(info, reference)  # a trainable-only checkpoint's base reference
    if rank_listed:
        info["rank_local"] = rank_listed
    if more_kinds:
        info["more_optimizer_states"] = more_kinds  # optimizers 1, 2, ... (0 is "optimizer_state")
    return PreparedCheckpoint(tensors, meta, info)


def write_prepared(directory: Path, prepared: PreparedCheckpoint, group=None) -> None:
    """The second half: DCP's files, ``meta.pt`` and the json into ``directory``. Collective over ``group``.
    Every rank reaches every collective even when its own part failed, and a failure anywhere is raised on
    every rank ([Note: every rank agrees on a save's failure], atomic.py)."""
    os.makedirs(directory, exist_ok=True)
    dcp.save(prepared.tensors, checkpoint_id=directory, process_group=group)  # DCP raises on every rank
    failure = None
    if prepared.meta is not None:
        try:
            torch.save(prepared.meta, directory / META_FILE)
        except Exception as err:  # a full disk: still join the listing below, then raise
            failure = err
    files = integrity.describe_written(directory, INFO_FILE, group)  # collective: each rank its own files
    if prepared.info is not None and failure is None:
        try:
            info = dict(prepared.info)
            info[integrity.FILES_KEY] = files
            (directory / INFO_FILE).write_text(json.dumps(integrity.seal(info), indent=1))
        except Exception as err:
            failure = err
    agree_on_failure(failure, directory, group)  # the next directory's collectives find every rank there


def release_saved_state(engine) -> None:
    """After the tensors of a save are written (or copied): bf16 masters widened for it are bf16 again."""
    if engine is not None and hasattr(engine, "master_form"):
        engine.master_form(wide=False)


def _check_optimizer_keys(optimizer_state, group=None) -> Optional[dict]:
    """Which state each parameter has; it must agree on all ranks (of ``group``, which writes one checkpoint)
    or DCP would write a broken checkpoint."""
    if optimizer_state is None:
        return None
    kinds = {n: sorted(st) for n, st in optimizer_state["state"].items()}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, kinds, group=group)
        if optimizer_state.get("owned_state"):  # each parameter's state on its owner only: the union
            return _union_of_owned(every)
        for r, other in enumerate(every):
            if other != kinds:
                diff = sorted(n for n in set(other) | set(kinds) if other.get(n) != kinds.get(n))
                raise RuntimeError(
                    f"Optimizer state differs between rank {_rank()} and rank {r} for {diff[:10]}; "
                    "cannot write a consistent sharded checkpoint."
                )
    return kinds


def _union_of_owned(every: list[dict]) -> dict:
    """The owner-rank step's state lists ([Note: owner-rank step]): each parameter listed by its owner(s) alone."""
    kinds: dict = {}
    for r, listed in enumerate(every):
        for n, keys in listed.items():  # hybrid sharding: one owner per shard group, the replicas' lists agree
            if kinds.setdefault(n, keys) != keys:
                raise RuntimeError(f"Optimizer state of {n!r} differs between its owners (rank {r}: {keys}, another: "
                                   f"{kinds[n]}); cannot write a consistent checkpoint.")
    return kinds


def _info(model_state, module, engine, state_kinds, group=None) -> dict:
    managed = _managed(engine)
    canonical, aliases = _canonical(module)
    tensors = {}
    for name, t in model_state.items():
        # a managed parameter's full shape comes from the engine (under stage 3 the module holds no full tensor)
        natural = managed[name][2] if name in managed else canonical[name].shape if name in canonical else t.shape
        tensors[name] = {"shape": list(natural), "dtype": str(t.dtype).replace("torch.", ""),
                         "flat": name in managed and not TS.is_tp(engine)}
    cfg = getattr(engine, "config", None)
    layout = {"layout": TS.NATURAL, "tensor_parallel_size": engine.tensor_parallel.tp_size} if TS.is_tp(engine) else {}
    return {**layout,
        "format": FORMAT, "version": VERSION,
        "world_size": dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1,
        "stage": None if cfg is None else cfg.stage,
        "torch_version": torch.__version__,
        "tensors": tensors,
        "aliases": {a: c for a, c in aliases.items() if c in tensors},
        "order": [k for k, v in module.state_dict(keep_vars=True).items() if torch.is_tensor(v)],
        "optimizer_state": state_kinds,
        # how the states were kept ([Note: low-precision optimizer states]): a load into other dtypes converts
        "state_dtypes": {} if cfg is None else {k: getattr(cfg, k) for k in STATE_DTYPE_KNOBS},
    }
