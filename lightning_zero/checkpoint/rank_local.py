"""State that differs by rank in a checkpoint: what each rank writes and reads back as its own row.

Two kinds, both of the compressed Adams (engine/optim/onebit/): their error-feedback buffers (``per_rank_state``,
always per rank; written in place of the one value under "optim", sharded_state.per_rank), and 0/1 Adam's
rank-local models between synchronizations ([Note: the ranks' own models], engine/optim/onebit/local_models.py):
each rank's own masters and the optimizer entries its local steps move. Those keep their one-value entries
(the ranks' mean, what every other reader sees) and add each rank's own values under a DCP key of their own::

    ranks.<optim key>.params.<name>            this rank's master of <name>, one row per rank
    ranks.<optim key>.state.<name>.<entry>     this rank's exp_avg / momentum_accumulator of <name>

listed in ``zero_checkpoint.json`` under "rank_local" (``{optim key: {"world_size", "params", "state"}}``).
A load at the saved world size reads its own rows over the mean after the optimizer state is in (exact
resume at any local step); at another world size a rank has no row, and the run resumes from the mean (all
ranks at one model, as after a synchronization), with a warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..engine.optim.onebit import local_models as LM
from .sharded_state import _managed, per_rank
from ..engine.optim.kinds import per_rank_state

RANKS_KEY = "ranks"  # the DCP top-level key (the model is "model", optimizers "optim", "optim_1", ...)


def _world(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def error_buffer_keys(opt, info: Mapping[str, Any], process_group=None) -> tuple:
    """The per-rank state entries (1-bit Adam's error buffers, one row per rank) that this load restores: all
    of them at the world size they were saved at; none at another (each rank's row has no counterpart
    there): they restart at zero, as DeepSpeed's did on every load, with a warning."""
    keys = per_rank_state(opt)
    saved = info.get("world_size")
    world = _world(process_group)
    if not keys or saved is None or int(saved) == world:
        return keys
    warnings.warn(f"{type(opt).__name__}: the checkpoint was saved on {saved} ranks and is loaded on {world}; "
                  f"its per-rank error-feedback buffers ({', '.join(keys)}) have no counterpart at this world size "
                  "and restart at zero (moments, frozen variance and phase are resharded and kept). Resume on "
                  f"{saved} ranks for an exact continuation.", stacklevel=4)
    return ()


def rank_local_entries(engine, optim_key: Callable[[int], str], group=None) -> tuple[dict, dict]:
    """(the DCP tensors under :data:`RANKS_KEY`, the json's "rank_local") of every optimizer of ``engine``
    whose ranks hold different models now; both empty when none does."""
    tensors: dict[str, dict] = {}
    listed: dict[str, dict] = {}
    if engine is None:
        return tensors, listed
    name_of = {id(m): n for n, (m, _, _) in _managed(engine).items()}
    for index, opt in enumerate(engine.optimizers):
        keys = LM.rank_local_keys(opt)
        if not keys:
            continue
        params: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for m in (m for row in engine.sharded_for(opt).masters for m in row):
            name = name_of[id(m)]
            params[name] = per_rank(engine.mean_swap.own(m), group)
            own = {k: per_rank(opt.state[m][k], group) for k in keys if k in opt.state.get(m, {})}
            if own:
                state[name] = own
        tensors[optim_key(index)] = {"params": params, "state": state}
        listed[optim_key(index)] = {"world_size": _world(group), "params": sorted(params),
                                    "state": {n: sorted(v) for n, v in state.items()}}
    return tensors, listed


@torch.no_grad()
def restore_rank_local(path: Path, engine, index: int, key: str, info: Mapping[str, Any],
                       dcp_load: Callable[[dict], None], process_group=None) -> bool:
    """This rank's own masters and rank-local optimizer entries of optimizer ``index`` from its rows, over the
    mean the ordinary load wrote, then published. False (nothing read) when the checkpoint has none for it,
    or was saved at another world size (then warned: the run resumes from the mean). Collective."""
    mine = (info.get("rank_local") or {}).get(key)
    if not mine:
        return False
    opt = engine.optimizers[index]
    world = _world(process_group)
    if int(mine["world_size"]) != world:
        warnings.warn(f"{type(opt).__name__}: the checkpoint was saved between synchronizations on "
                      f"{mine['world_size']} ranks and is loaded on {world}; each rank's own parameters and "
                      f"moments have no counterpart here, so every rank resumes from their mean (the model the "
                      f"checkpoint stands for). Resume on {mine['world_size']} ranks for an exact continuation.",
                      stacklevel=4)
        return False
    managed = _managed(engine)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, the flat buffer DCP fills)

    def row(dest: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(dest.numel(), dtype=dest.dtype, device=dest.device)
        copies.append((dest, buf))
        return per_rank(buf, process_group)

    params = {n: row(managed[n][0]) for n in mine["params"]}
    state = {n: {k: row(opt.state[managed[n][0]][k]) for k in ks} for n, ks in mine["state"].items()}
    dcp_load({RANKS_KEY: {key: {"params": params, "state": state}}})
    for dest, buf in copies:
        dest.copy_(buf.view_as(dest))
    engine.publish_params()
    return True
