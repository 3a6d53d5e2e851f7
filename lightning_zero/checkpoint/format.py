"""Sharded checkpoints: torch.distributed.checkpoint (DCP) directories that reshard and consolidate.

Design note
-----------
A checkpoint is a directory::

    ckpt/                      (written as .ckpt.zero-tmp, renamed when complete)
      .metadata, *.distcp      DCP: "model" and "optim" tensors, each rank writing only its own slices
      meta.pt                  everything else Lightning put in the checkpoint (loops, lr_schedulers,
                               callbacks, epoch, global_step, version, hparams, precision/loss-scaler
                               state) plus the optimizer's param_groups keyed by parameter *name*
      zero_checkpoint.json     format version, world size, stage, every tensor's name/shape/dtype/layout,
                               tied-weight aliases, which optimizer state each parameter has, every other
                               file's size and CRC-32 (integrity.py), sealed with its own CRC-32

Every managed parameter (and every per-element optimizer state tensor) is stored *flattened*: on stages
1-3 as a DTensor ``Shard(0)`` of the 1-D parameter over a 1-D mesh of the default group -- exactly the
engine's ``torch.chunk`` slice ``[spec.lo, spec.hi)`` -- and on stage 0 as a plain 1-D tensor (replicated,
DCP writes it once). Because every layout is the same global 1-D tensor, DCP's own metadata reshards:
loading wraps the *current* engine's masters (and optimizer state) in DTensors of the current world size
and DCP fills each rank's slice in place, N ranks -> M ranks and stage a -> stage b alike. Buffers and
frozen parameters are stored in their natural shape. Scalars (Adam's ``step``) are plain tensors.

Saving is atomic: all ranks write into a temporary sibling directory, barrier, then rank 0 moves the
previous checkpoint aside (``X.zero-old``), renames the new one into place and only then deletes the old
one. A directory named ``X`` is therefore always complete. A crash between the two renames leaves no
``X`` but a complete ``X.zero-old``: every load of ``X`` (and Lightning's ``ckpt_path="last"``, see
``lightning/lightning_io.py``) falls back to it, and the next save in that directory first renames it back, so no
save ever deletes the only complete copy. Stale temporaries (``*.zero-tmp``) and redundant old copies in
the directory are removed by the next save there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..engine.comm.collectives import barrier as _barrier, rank as _rank
from ..engine.config import STATE_DTYPE_KNOBS
from . import integrity, tp_state as TS, trainable_only as TO
from .rank_local import RANKS_KEY, rank_local_entries
from .trust import UntrustedCheckpointError  # noqa: F401  (raised by every load; part of this module's API)
from .sharded_state import _canonical, _flat, _managed, per_rank, sharded_model_state, sharded_optimizer_state  # noqa: F401
from .load_dir import (  # noqa: F401  (the load path, part of this module's API)
    _IMPL_KEYS, _dcp_load, check_compatible, check_optimizer_count, load_checkpoint_dir, load_model_state,
    load_optimizer_state)
from .names import optim_key as _optim_key
from .files import (  # noqa: F401  (the on-disk names are part of this module's API)
    _OLD, _TMP, DCP_METADATA, FORMAT, INFO_FILE, META_FILE, VERSION, _remove, aside_path, check_state_entries,
    final_of_aside, swap_dirs,
    is_checkpoint_dir, read_info, read_meta, resolve_checkpoint_dir, tidy_checkpoint_dir)

_PathLike = Union[str, os.PathLike]


# -- save -------------------------------------------------------------------------------------------------
def save_checkpoint_dir(
    path: _PathLike,
    model_state: Mapping[str, torch.Tensor],
    module: nn.Module,
    engine=None,
    optimizer_state: Optional[Mapping[str, Any]] = None,
    metadata: Optional[dict] = None,
    barrier: Callable[[], None] = _barrier,
) -> Path:
    """Write a checkpoint directory atomically. Collective: every rank calls it with the same ``path``.

    ``optimizer_state``: one optimizer's :func:`sharded_optimizer_state`, or a list of them (several
    optimizers: the first under "optim", optimizer ``k`` under "optim_k")."""
    with atomic_checkpoint_dir(path, barrier) as tmp:
        write_checkpoint_files(tmp, model_state, module, engine, optimizer_state, metadata)
    return Path(path)


@contextlib.contextmanager
def atomic_checkpoint_dir(path: _PathLike, barrier: Callable[[], None] = _barrier) -> Iterator[Path]:
    """The temporary ``path.zero-tmp`` every rank writes into, renamed to ``path`` once all are done (see
    the design note). Collective over the world."""
    path = Path(path)
    tmp, old = path.with_name(path.name + _TMP), aside_path(path)
    if _rank() == 0:
        tidy_checkpoint_dir(path.parent)  # what crashed saves left behind
        tmp.mkdir(parents=True)
    barrier()
    try:
        yield tmp
    except BaseException:
        # a failed write (a full disk, a rank's error) must not leave its partial copy behind; the directory
        # is shared, so whichever rank fails removes it (the next save's tidy-up would, but may never come)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    if _rank() == 0:
        if os.path.lexists(path) and swap_dirs(tmp, path):  # one atomic exchange: ``path`` never missing
            _remove(tmp)  # now the previous copy
        else:
            if os.path.lexists(path):  # a name that exists is complete, so the old copy (if any) is redundant
                _remove(old)
                os.rename(path, old)
            os.rename(tmp, path)  # until this rename, ``old`` is the complete copy loads (and "last") fall back to
            _remove(old)
    barrier()


def write_checkpoint_files(directory: Path, model_state: Mapping[str, torch.Tensor], module: nn.Module,
                           engine=None, optimizer_state: Any = None, metadata: Optional[dict] = None,
                           process_group=None) -> None:
    """The DCP tensors, ``meta.pt`` and ``zero_checkpoint.json`` of one checkpoint into ``directory`` (not
    atomic by itself: inside :func:`atomic_checkpoint_dir`). Collective over ``process_group`` (default:
    the world), whose ranks hold the shards of ``model_state``; its first rank writes the small files."""
    metadata, reference = TO.split_reference(metadata)  # [Note: trainable-only checkpoints]
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
    os.makedirs(directory, exist_ok=True)
    dcp.save(tensors, checkpoint_id=directory, process_group=process_group)
    if _rank(process_group) == 0:
        meta = dict(metadata or {})
        if opt_states:
            meta["optimizer_states"] = [{k: v for k, v in st.items() if k != "state"} for st in opt_states]
        torch.save(meta, directory / META_FILE)
    files = integrity.describe_written(directory, INFO_FILE, process_group)  # collective: each rank its own files
    if _rank(process_group) == 0:
        info = _info(model_state, module, engine, state_kinds, process_group)
        info[integrity.FILES_KEY] = files
        TO.record(info, reference)  # a trainable-only checkpoint's base reference
        if rank_listed:
            info["rank_local"] = rank_listed
        if more_kinds:
            info["more_optimizer_states"] = more_kinds  # optimizers 1, 2, ... (0 is "optimizer_state")
        (directory / INFO_FILE).write_text(json.dumps(integrity.seal(info), indent=1))
    if engine is not None and hasattr(engine, "master_form"):  # bf16 masters widened for the save: bf16 again
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


def save_engine_checkpoint(path: _PathLike, module: nn.Module, engine=None, metadata: Optional[dict] = None,
                           optimizer: bool = True, trainable_only_base: Optional[str] = None) -> Path:
    """Engine-level save (no Lightning): model, optimizer state, loss-scaler state and ``metadata``.
    ``trainable_only_base``: the frozen parameters left out, recorded by reference to this source
    ([Note: trainable-only checkpoints])."""
    model, opt, meta = engine_checkpoint_state(module, engine, metadata, optimizer)
    if trainable_only_base is not None:
        model, meta = TO.trainable_only_state(module, engine, model, TO.check_base_source(trainable_only_base,
                                                                                           "trainable_only_base"), meta)
    return save_checkpoint_dir(path, model, module, engine, opt, meta)


def engine_checkpoint_state(module: nn.Module, engine=None, metadata: Optional[dict] = None, optimizer: bool = True,
                            group=None) -> tuple[dict, Optional[list], dict]:
    """What :func:`save_engine_checkpoint` writes: the model tensors, the optimizer states and the metadata
    (plus loss scaler and skipped steps). ``group``: the sub-group the engine shards over, if not the world."""
    meta = dict(metadata or {})
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is not None:
        meta["loss_scaler"] = scaler.state_dict()
    if engine is not None:
        meta["skipped_steps"] = engine.counters.skipped_steps
    opt = [sharded_optimizer_state(engine, o, group) for o in engine.optimizers] \
        if optimizer and engine is not None else None
    return sharded_model_state(module, engine, group), opt, meta
