"""Whole-stage views of a pipeline's state: names in the uncut model, and each stage's full fp32 values.

Design note
-----------
Checkpoints do not use these (they are sharded DCP directories per stage, written without gathering:
checkpoint/pipeline_dir.py). ``source_names`` is what the checkpoint manifest records so consolidation
gives the uncut model's own names; :func:`stage_state_dicts` gathers a stage's masters and optimizer state
over its data-parallel group for inspection (comparisons with DDP, callbacks that need whole weights).
"""

from __future__ import annotations

from typing import Any

from torch import nn


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
        out.append({"stage_index": index, "num_stages": pipe.pipe_stages[0].num_stages,
                    "model": model, "optimizer": optim, "source_names": source_names(module, index, model),
                    "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None})
    return out
