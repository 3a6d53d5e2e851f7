"""Pipeline checkpoints: one file per (virtual) stage with full, unsharded values, and their consolidation.

Design note
-----------
Each stage's data-parallel rank 0 writes ``stage{i}.pt``: the stage's fp32 module state (the masters
all-gathered), its optimizer state consolidated over the data-parallel group (a plain optimizer's
``state_dict``), the loss scaler, and ``source_names`` (local name -> name in the uncut model). Full values
make the data-parallel size free on resume: each engine re-slices the optimizer state for its own shards.
The pipeline shape (stages x chunks per rank) must match on resume; a different one goes through
:func:`consolidate_pipeline_checkpoint`, which needs no process group and gives the uncut model's own
state dict (what DDP over the whole model would save).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .engine_state import EngineMode

STAGE_FILE = "stage{}.pt"


def stage_file(path: str, index: int) -> str:
    f = os.path.join(path, STAGE_FILE.format(index))
    if not os.path.exists(f):
        raise FileNotFoundError(f"no pipeline stage checkpoint {f} (expected stage0.pt ... stage<P-1>.pt in {path}).")
    return f


def source_names(module: nn.Module, index: int, state: dict) -> dict:
    """Local state-dict name -> name in the whole model: by the stage's ``source_prefixes`` (local prefix ->
    original prefix, as :func:`~.pipeline_split.split_gpt2` records), else ``stage{index}.<name>``."""
    prefixes = getattr(module, "source_prefixes", None) or {}
    out = {}
    for name in state:
        hit = max((p for p in prefixes if name == p or name.startswith(p + ".")), key=len, default=None)
        out[name] = prefixes[hit] + name[len(hit):] if hit is not None else f"stage{index}.{name}"
    return out


def stage_state_dicts(pipe: Any) -> list[dict]:
    """Per chunk of ``pipe`` (a PipelineZero) on this rank: its stage's full fp32 module state and full
    optimizer state (on data-parallel rank 0; ``{}`` elsewhere). Collective over the dp group."""
    out = []
    for module, engine, index in zip(pipe.modules, pipe.engines, pipe.stage_indices):
        model = {k: v.detach().clone() for k, v in module.state_dict().items()}
        for name, full in zip(engine.param_names(), engine.full_master_params()):
            model[name] = full.detach().clone().reshape(model[name].shape)
        optim = engine.optimizer_state_dict() if engine.sharded is not None else {}
        out.append({"stage_index": index, "num_stages": pipe.stages[0].num_stages,
                    "model": model, "optimizer": optim, "source_names": source_names(module, index, model),
                    "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None})
    return out


def save_stages(pipe: Any, path: str) -> None:
    """``path/stage{i}.pt`` per stage, written by its data-parallel rank 0. Collective over the world."""
    sds = stage_state_dicts(pipe)
    if pipe.layout.dp_rank == 0:
        os.makedirs(path, exist_ok=True)
        for sd in sds:
            torch.save(sd, os.path.join(path, STAGE_FILE.format(sd["stage_index"])))
    if dist.is_initialized():
        dist.barrier()


def load_stages(pipe: Any, path: str) -> None:
    """This rank's stages from :func:`save_stages`'s files (any data-parallel size); an evaluation-only
    pipeline (no optimizer) takes the weights only."""
    total = pipe.stages[0].num_stages
    for engine, index in zip(pipe.engines, pipe.stage_indices):
        sd = torch.load(stage_file(path, index), weights_only=False)
        if sd["num_stages"] != total:
            raise ValueError(f"checkpoint {path} has {sd['num_stages']} pipeline stages; this run has {total}. "
                             f"Allowed: resume with the same pipeline_parallel_size and chunks per rank (the "
                             f"data-parallel size may change), or consolidate it first.")
        engine.load_full_state_dict(sd["model"])
        if sd["optimizer"] and engine.mode is EngineMode.TRAIN:
            engine.load_optimizer_state_dict(sd["optimizer"])
        if sd["loss_scaler"] is not None and engine.loss_scaler is not None:
            engine.loss_scaler.load_state_dict(sd["loss_scaler"])


def is_pipeline_checkpoint(path: Union[str, Path]) -> bool:
    """A directory holding per-stage files (``stage0.pt``), as :func:`save_stages` writes."""
    return os.path.isfile(os.path.join(path, STAGE_FILE.format(0)))


def consolidate_pipeline_checkpoint(path: Union[str, Path], dtype: Optional[torch.dtype] = None) -> dict:
    """One state dict of the whole model (the uncut model's names) from the per-stage files, no process
    group; floating tensors cast to ``dtype`` when given."""
    path = str(path)
    files = sorted(f for f in os.listdir(path) if f.startswith("stage") and f.endswith(".pt"))
    if not files:
        raise FileNotFoundError(f"no pipeline stage checkpoints (stage<i>.pt) in {path}.")
    first = torch.load(os.path.join(path, files[0]), weights_only=False)
    out: dict = {}
    for i in range(first["num_stages"]):
        sd = torch.load(stage_file(path, i), weights_only=False)
        for name, value in sd["model"].items():
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            out[sd["source_names"][name]] = value
    return out


def write_consolidated(path: Union[str, Path], out: Union[str, Path], dtype: torch.dtype = torch.float32) -> dict:
    """:func:`consolidate_pipeline_checkpoint` written to ``out`` (``.safetensors``: safetensors, else
    ``torch.save``). Returns {"tensors": n, "bytes": weights}."""
    sd = consolidate_pipeline_checkpoint(path, dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
    else:
        torch.save(sd, tmp)
    os.replace(tmp, out)
    return {"tensors": len(sd), "bytes": sum(t.numel() * t.element_size() for t in sd.values())}
