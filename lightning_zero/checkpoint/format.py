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
the directory are removed by the next save there. The commit, and the agreement of every rank on whether
their parts were written, is atomic.py's; the write itself, in a half that runs where training runs and one
that may run in the background, prepared.py's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed.checkpoint as dcp  # noqa: F401  (prepared.py writes through it; tests patch it here)
from torch import nn

from ..engine.comm.collectives import barrier as _barrier
from .atomic import CheckpointWriteError, agree_on_failure, atomic_checkpoint_dir  # noqa: F401  (this module's API)
from .prepared import PreparedCheckpoint, prepare_checkpoint, release_saved_state, write_prepared  # noqa: F401
from .async_save import AsyncCheckpointer, SaveRecord, SaveState  # noqa: F401
from . import trainable_only as TO
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


def write_checkpoint_files(directory: Path, model_state: Mapping[str, torch.Tensor], module: nn.Module,
                           engine=None, optimizer_state: Any = None, metadata: Optional[dict] = None,
                           process_group=None) -> None:
    """The DCP tensors, ``meta.pt`` and ``zero_checkpoint.json`` of one checkpoint into ``directory`` (not
    atomic by itself: inside :func:`atomic_checkpoint_dir`). Collective over ``process_group`` (default:
    the world), whose ranks hold the shards of ``model_state``; its first rank writes the small files.
    Both halves of [Note: a save in two halves] (prepared.py), on the live tensors."""
    try:
        write_prepared(directory, prepare_checkpoint(model_state, module, engine, optimizer_state, metadata,
                                                     process_group), process_group)
    finally:
        release_saved_state(engine)


def save_engine_checkpoint(path: _PathLike, module: nn.Module, engine=None, metadata: Optional[dict] = None,
                           optimizer: bool = True, saver=None, trainable_only_base: Optional[str] = None) -> Path:
    """Engine-level save (no Lightning): model, optimizer state, loss-scaler state and ``metadata``.
    ``saver``: an :class:`~lightning_zero.checkpoint.async_save.AsyncCheckpointer` to write it in the
    background (returns once staged; ``saver.wait()`` for the write). ``trainable_only_base``: the frozen
    parameters left out, recorded by reference to this source ([Note: trainable-only checkpoints])."""
    model, opt, meta = engine_checkpoint_state(module, engine, metadata, optimizer)
    if trainable_only_base is not None:
        model, meta = TO.trainable_only_state(module, engine, model, TO.check_base_source(trainable_only_base,
                                                                                           "trainable_only_base"), meta)
    if saver is None:
        return save_checkpoint_dir(path, model, module, engine, opt, meta)
    save_in_background(saver, path, model, module, engine, opt, meta)
    return Path(path)


def save_in_background(saver, path: _PathLike, model_state, module: nn.Module, engine, optimizer_state,
                       metadata: dict) -> None:
    """One model's directory: prepared here (collective, on the training thread), written by ``saver``
    ([Note: asynchronous checkpoint saves])."""
    try:
        prepared = prepare_checkpoint(model_state, module, engine, optimizer_state, metadata)
    except BaseException:
        release_saved_state(engine)
        raise
    saver.save(path, [("", prepared)], engines=[engine])


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
