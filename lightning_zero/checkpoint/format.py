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
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..engine.comm.collectives import barrier as _barrier, rank as _rank
from ..engine.optim.kinds import per_rank_state
from . import integrity, tp_state as TS, trust as TR
from .rank_local import RANKS_KEY, error_buffer_keys, rank_local_entries, restore_rank_local
from .trust import ConfinedReader, UntrustedCheckpointError, read_dcp_metadata
from .sharded_state import _canonical, _flat, _managed, per_rank, sharded_model_state, sharded_optimizer_state  # noqa: F401
from .files import (  # noqa: F401  (the on-disk names are part of this module's API)
    _OLD, _TMP, DCP_METADATA, FORMAT, INFO_FILE, META_FILE, VERSION, _remove, aside_path, check_state_entries,
    final_of_aside, swap_dirs,
    is_checkpoint_dir, read_info, read_meta, resolve_checkpoint_dir, tidy_checkpoint_dir)

_IMPL_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")  # not restored from a checkpoint
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
        if rank_listed:
            info["rank_local"] = rank_listed
        if more_kinds:
            info["more_optimizer_states"] = more_kinds  # optimizers 1, 2, ... (0 is "optimizer_state")
        (directory / INFO_FILE).write_text(json.dumps(integrity.seal(info), indent=1))


def _optim_key(index: int) -> str:
    return "optim" if index == 0 else f"optim_{index}"


def _check_optimizer_keys(optimizer_state, group=None) -> Optional[dict]:
    """Which state each parameter has; it must agree on all ranks (of ``group``, which writes one checkpoint)
    or DCP would write a broken checkpoint."""
    if optimizer_state is None:
        return None
    kinds = {n: sorted(st) for n, st in optimizer_state["state"].items()}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, kinds, group=group)
        for r, other in enumerate(every):
            if other != kinds:
                diff = sorted(n for n in set(other) | set(kinds) if other.get(n) != kinds.get(n))
                raise RuntimeError(
                    f"Optimizer state differs between rank {_rank()} and rank {r} for {diff[:10]}; "
                    "cannot write a consistent sharded checkpoint."
                )
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
    }


# -- read / validate ----------------------------------------------------------------------------------------
def _dcp_load(state: dict, path: Path, no_dist: Optional[bool] = None, process_group=None,
              trust_checkpoint: bool = False) -> None:
    """``dcp.load`` through DCP's own reader, handed the metadata the restricted unpickler read (trust.py)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if no_dist is None:
        no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=ConfinedReader(path, read_dcp_metadata(path, trust_checkpoint)),
                     no_dist=no_dist, process_group=process_group)
    except UntrustedCheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP wraps per-rank failures; name the broken checkpoint
        raise ValueError(f"Reading the tensors of checkpoint {str(path)!r} failed; the directory is incomplete "
                         f"or corrupt, or does not match the model: {err}") from err


def check_compatible(info: dict, module: nn.Module, strict: bool = True, engine=None) -> list[str]:
    """Compare the checkpoint's tensors with the module's; raise ValueError listing every difference."""
    canonical, _ = _canonical(module)
    canonical.update({n: torch.empty(shape, device="meta") for n, (_, _, shape) in _managed(engine).items()})
    saved = info["tensors"]
    missing = [n for n in canonical if n not in saved]
    unexpected = [n for n in saved if n not in canonical]
    mismatched = [f"{n}: checkpoint {tuple(saved[n]['shape'])}, model {tuple(canonical[n].shape)}"
                  for n in canonical if n in saved and list(canonical[n].shape) != list(saved[n]["shape"])]
    if mismatched or (strict and (missing or unexpected)):
        parts = [f"{len(v)} {what}: " + ", ".join(v[:20]) + (" ..." if len(v) > 20 else "")
                 for what, v in (("missing key(s)", missing), ("unexpected key(s)", unexpected),
                                 ("shape mismatch(es)", mismatched)) if v]
        raise ValueError("The checkpoint does not match this model (is it from another model?) -- "
                         + "; ".join(parts))
    return [n for n in canonical if n in saved]


# -- load into a module / engine ------------------------------------------------------------------------------
@torch.no_grad()
def load_model_state(path: _PathLike, module: nn.Module, engine=None, strict: bool = True,
                     info: Optional[dict] = None, process_group=None, trust_checkpoint: bool = False) -> None:
    """Load the model tensors into the engine's masters (in place, resharded) and the module's other tensors.

    Without an engine (evaluation, or a plain model in one process) every tensor lands in the module.
    Collective over ``process_group`` (the group the engine shards over; default: the world) when a process
    group is initialized; works without one.
    """
    path = Path(path) if info is not None else resolve_checkpoint_dir(path)
    info = info or read_info(path, trust_checkpoint)
    names = check_compatible(info, module, strict, engine)
    managed = _managed(engine)
    canonical, _ = _canonical(module)
    targets: dict[str, torch.Tensor] = {}
    after: list[Callable[[], None]] = []
    natural = TS.needs_natural_load(engine, info)
    params = TS.params_of(module)
    for n in names:
        flat = info["tensors"][n]["flat"]
        if n in managed and (natural or not flat):  # per parameter: tensor parallel, or saved without an engine
            m, spec, shape = managed[n]
            targets[n], copy = TS.load_target(engine, params[n], m, spec, shape, flat)
            after.append(copy)
            continue
        if n in managed and flat:
            m, spec, _ = managed[n]
            targets[n] = _flat(m, spec, process_group)
            if not m.is_contiguous() and spec.world_size == 1:
                after.append(lambda m=m, t=targets[n]: m.copy_(t.view_as(m)))
            continue
        dest = canonical[n]
        if flat and not dest.is_contiguous():
            t = torch.empty(dest.numel(), dtype=dest.dtype, device=dest.device)
            after.append(lambda dest=dest, t=t: dest.copy_(t.view_as(dest)))
        targets[n] = t if flat and not dest.is_contiguous() else (dest.view(-1) if flat else dest)
    _dcp_load({"model": targets}, path, process_group=process_group, trust_checkpoint=trust_checkpoint)
    for fn in after:
        fn()
    if engine is not None:
        engine.publish_params()


@torch.no_grad()
def load_optimizer_state(path: _PathLike, engine, opt_meta: Mapping[str, Any], info: Optional[dict] = None,
                         index: int = 0, process_group=None, trust_checkpoint: bool = False) -> None:
    """Load the state of the engine's optimizer ``index`` (moments resharded in place) and its
    hyper-parameters by parameter name."""
    path = Path(path) if info is not None else resolve_checkpoint_dir(path)
    info = info or read_info(path, trust_checkpoint)
    more = info.get("more_optimizer_states") or []
    kinds = info.get("optimizer_state") if index == 0 else more[index - 1] if index - 1 < len(more) else None
    if kinds is None:
        raise KeyError(f"Checkpoint {str(path)!r} holds no optimizer state (saved with weights_only=True?)."
                       if index == 0 else f"Checkpoint {str(path)!r} holds no state for optimizer {index}.")
    opt = engine.optimizers[index]
    managed = _managed(engine)
    name_of = {id(m): n for n, (m, _, _) in managed.items()}
    if "param_groups" not in opt_meta:
        raise ValueError(f"Corrupt checkpoint {str(path)!r}: {META_FILE} holds no optimizer param_groups "
                         "although the checkpoint has optimizer state.")
    saved_groups = opt_meta["param_groups"]
    current = [[name_of[id(m)] for m in g["params"]] for g in opt.param_groups]
    if len(saved_groups) != len(current) or any(set(s["params"]) != set(c) for s, c in zip(saved_groups, current)):
        in_ckpt = {n for s in saved_groups for n in s["params"]}
        in_opt = {n for c in current for n in c}
        raise ValueError(
            f"The optimizer does not match the checkpoint: param groups of {[len(c) for c in current]} parameter(s), "
            f"the checkpoint's {[len(s['params']) for s in saved_groups]}; only in the checkpoint: "
            f"{sorted(in_ckpt - in_opt)[:20]}, only in the optimizer: {sorted(in_opt - in_ckpt)[:20]}."
        )
    check_state_entries(path, kinds, managed, _optim_key(index), trust_checkpoint)
    _init_state(opt, [managed[n][0] for n in kinds if n in managed])
    targets: dict[str, dict[str, torch.Tensor]] = {}
    rank_keys = error_buffer_keys(opt, info, process_group)
    natural = TS.needs_natural_load(engine, info)
    params = TS.params_of(engine.module)
    after: list[Callable[[], None]] = []
    for n, keys in kinds.items():
        m, spec, shape = managed[n]
        st = opt.state[m]
        have = sorted(k for k, v in st.items() if torch.is_tensor(v))
        if have != sorted(keys):
            raise ValueError(f"Optimizer state of {n!r}: the checkpoint has {sorted(keys)}, this optimizer "
                             f"{have} (another optimizer class or options?).")
        targets[n] = {}
        for k in keys:
            if k in per_rank_state(opt):  # this rank's own row (sharded_state.per_rank)
                if rank_keys:
                    targets[n][k] = per_rank(st[k], process_group)
                else:  # saved at another world size: no row of this rank's; the error memory restarts
                    st[k].zero_()
            elif not (st[k].dim() > 0 and st[k].shape == m.shape):
                targets[n][k] = st[k]
            elif natural:  # per parameter (tp_state.py): flat unless the checkpoint is a TP one
                targets[n][k], copy = TS.load_target(engine, params[n], st[k], spec, shape,
                                                     info.get("layout") != TS.NATURAL)
                after.append(copy)
            else:
                targets[n][k] = _flat(st[k], spec, process_group)
    _dcp_load({_optim_key(index): {"state": targets}}, path, process_group=process_group,
              trust_checkpoint=trust_checkpoint)
    for copy in after:
        copy()
    for m in list(opt.state):  # a parameter that had no state when saved has none now
        if name_of.get(id(m)) not in kinds:
            del opt.state[m]
    for n, extra in opt_meta.get("nontensor_state", {}).items():
        opt.state[managed[n][0]].update(extra)
    for g, s in zip(opt.param_groups, saved_groups):
        g.update({k: v for k, v in s.items() if k not in _IMPL_KEYS})
    # 0/1 Adam saved between synchronizations: this rank's own model over the mean just read (rank_local.py)
    restore_rank_local(path, engine, index, _optim_key(index), info,
                       lambda state: _dcp_load(state, path, process_group=process_group,
                                               trust_checkpoint=trust_checkpoint), process_group)
    if hasattr(opt, "state_restored"):  # 1-bit Adam: what it derived from the state before is stale
        opt.state_restored()


def check_optimizer_count(path: _PathLike, saved: int, current: int) -> None:
    if saved != current:
        raise ValueError(f"Checkpoint {str(path)!r} holds the state of {saved} optimizer(s); this run has "
                         f"{current}. configure_optimizers must return as many optimizers as when it was saved.")


def _init_state(opt: torch.optim.Optimizer, masters: list[torch.Tensor]) -> None:
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


def load_checkpoint_dir(path: _PathLike, module: nn.Module, engine=None, load_optimizer: bool = True,
                        strict: bool = True, weights_only: Optional[bool] = None, process_group=None,
                        trust_checkpoint: bool = False) -> dict:
    """Engine-level load: model (and optimizer state when ``load_optimizer`` and an engine is given).
    ``process_group``: the group the engine shards over, when not the world (a pipeline stage's).
    ``trust_checkpoint``: read its pickles unrestricted (a trusted checkpoint of an older build; trust.py).

    Returns the metadata dict (Lightning's loops/epoch/... plus whatever the saver passed)."""
    path = resolve_checkpoint_dir(path)
    trust = TR.trusted(trust_checkpoint, weights_only)
    info = read_info(path, trust)
    meta = read_meta(path, trust_checkpoint=trust)
    load_model_state(path, module, engine, strict, info, process_group, trust)
    if load_optimizer and engine is not None:
        saved = meta.get("optimizer_states") or [{}]
        check_optimizer_count(path, len(saved), len(engine.optimizers))
        for k in range(len(engine.optimizers)):
            load_optimizer_state(path, engine, saved[k], info, index=k, process_group=process_group,
                                 trust_checkpoint=trust)
        scaler = getattr(engine, "loss_scaler", None)
        if scaler is not None and "loss_scaler" in meta:
            scaler.load_state_dict(meta["loss_scaler"])
        if "skipped_steps" in meta:
            engine.counters.skipped_steps = int(meta["skipped_steps"])
    return meta


def save_engine_checkpoint(path: _PathLike, module: nn.Module, engine=None, metadata: Optional[dict] = None,
                           optimizer: bool = True) -> Path:
    """Engine-level save (no Lightning): model, optimizer state, loss-scaler state and ``metadata``."""
    model, opt, meta = engine_checkpoint_state(module, engine, metadata, optimizer)
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
