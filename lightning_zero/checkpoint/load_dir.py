"""The load path of a checkpoint directory (``format.py`` writes it; its design note says what is in it):
the tensors read with DCP through the restricted reader (``trust.py``), checked against the module, then
loaded into the engine's masters and optimizer state of the *current* world size (DCP reshards the flat
1-D layout), the module's other tensors, and the metadata back into the loss scaler and step counters."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..engine.config import STATE_DTYPE_KNOBS
from ..engine.optim.kinds import per_rank_state
from . import tp_state as TS, trainable_only as TO, trust as TR
from .files import check_state_entries, read_info, read_meta, resolve_checkpoint_dir
from .local_copies import local_checkpoint_copy
from .names import META_FILE
from .names import optim_key as _optim_key
from .rank_local import error_buffer_keys, restore_rank_local
from .sharded_state import _canonical, _flat, _managed, per_rank
from .trust import ConfinedReader, UntrustedCheckpointError, read_dcp_metadata

_log = logging.getLogger(__name__)
_IMPL_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")  # not restored from a checkpoint
_PathLike = Union[str, os.PathLike]


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
    left = TO.left_out(info)  # a trainable-only checkpoint's frozen base: checked by its hash, not read
    missing = [n for n in canonical if n not in saved and n not in left]
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
    TO.verify_live_base(info, module, engine, process_group)
    lowp = engine is not None and hasattr(engine, "master_form")  # bf16 masters filled as fp32, then split
    if lowp:
        engine.master_form(wide=True)
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
    if lowp:
        engine.master_form(wide=False)


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
    if index == 0:
        _notice_state_conversion(path, info, engine)
    engine.sharded_for(opt).init_state([managed[n][0] for n in kinds if n in managed])
    targets: dict[str, dict[str, torch.Tensor]] = {}
    rank_keys = error_buffer_keys(opt, info, process_group)
    natural = TS.needs_natural_load(engine, info)
    params = TS.params_of(engine.module)
    after: list[Callable[[], None]] = []
    sharded = engine.sharded_for(opt)
    owned = sharded.owner is not None  # each parameter's state whole on its owner ([Note: owner-rank step])
    holders = {n: sharded.state_holder(m) for n, (m, _, _) in managed.items()}
    for n, keys in kinds.items():
        m, spec, shape = managed[n]
        if holders[n] is None:  # another rank owns it and reads its state
            continue
        st = opt.state[holders[n]]
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
            elif owned and st[k].dim() > 0 and st[k].shape == holders[n].shape:
                targets[n][k] = st[k].view(-1)  # written flat and whole (by its owner, or at stage 0)
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
    name_of_holder = {id(h): n for n, h in holders.items() if h is not None}
    for h in list(opt.state):  # a parameter that had no state when saved has none now
        if name_of_holder.get(id(h)) not in kinds:
            del opt.state[h]
    for n, extra in opt_meta.get("nontensor_state", {}).items():
        if holders.get(n) is not None:
            opt.state[holders[n]].update(extra)
    for g, s in zip(opt.param_groups, saved_groups):
        g.update({k: v for k, v in s.items() if k not in _IMPL_KEYS})
    # 0/1 Adam saved between synchronizations: this rank's own model over the mean just read (rank_local.py)
    restore_rank_local(path, engine, index, _optim_key(index), info,
                       lambda state: _dcp_load(state, path, process_group=process_group,
                                               trust_checkpoint=trust_checkpoint), process_group)
    if hasattr(opt, "state_restored"):  # 1-bit Adam: what it derived from the state before is stale
        opt.state_restored()


def _notice_state_conversion(path: Path, info: dict, engine) -> None:
    """One notice where the checkpoint kept its optimizer states in other dtypes than this run does: the load
    converts them (fp32 -> bf16 rounds to nearest; bf16 masters arrive as their exact fp32 ``hi + lo``)."""
    saved = info.get("state_dtypes") or {}  # older checkpoints: fp32 states
    cfg = getattr(engine, "config", None)
    differ = [f"{k}: checkpoint {saved.get(k, 'fp32')!r} -> this run {getattr(cfg, k)!r}"
              for k in STATE_DTYPE_KNOBS if cfg is not None and saved.get(k, "fp32") != getattr(cfg, k)]
    if differ and (not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0):
        _log.warning("Checkpoint %s keeps its optimizer states in other dtypes (%s); they are converted on load "
                     "(to bf16: rounded to nearest).", str(path), "; ".join(differ))


def check_optimizer_count(path: _PathLike, saved: int, current: int) -> None:
    if saved != current:
        raise ValueError(f"Checkpoint {str(path)!r} holds the state of {saved} optimizer(s); this run has "
                         f"{current}. configure_optimizers must return as many optimizers as when it was saved.")


def load_checkpoint_dir(path: _PathLike, module: nn.Module, engine=None, load_optimizer: bool = True,
                        strict: bool = True, weights_only: Optional[bool] = None, process_group=None,
                        trust_checkpoint: bool = False) -> dict:
    """Engine-level load: model (and optimizer state when ``load_optimizer`` and an engine is given).
    ``process_group``: the group the engine shards over, when not the world (a pipeline stage's).
    ``trust_checkpoint``: read its pickles unrestricted (a trusted checkpoint of an older build; trust.py).

    Returns the metadata dict (Lightning's loops/epoch/... plus whatever the saver passed)."""
    with local_checkpoint_copy(path, collective=True, group=process_group) as local:  # a URL: downloaded once per host
        return _load_checkpoint_dir(local, module, engine, load_optimizer, strict, weights_only, process_group,
                                    trust_checkpoint)


def _load_checkpoint_dir(path: _PathLike, module: nn.Module, engine, load_optimizer: bool, strict: bool,
                         weights_only: Optional[bool], process_group, trust_checkpoint: bool) -> dict:
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

