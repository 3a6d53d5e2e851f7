"""The estimator under tensor parallelism: model states per rank when part of the parameters is cut T ways.

Design note
-----------
With ``tensor_parallel_size=T`` a rank holds the *local pieces* of the parameters its TP plan cuts (a
column-parallel Linear: rows of its weight and bias; a row-parallel one: columns of its weight, the bias
whole) and every other parameter whole; ZeRO then shards each local piece over the N / T data-parallel
ranks (``engine/layout/tensor_parallel.py``). So the estimate is the engine's own model (``estimate.py``
``model_state_bytes``) applied to a :class:`~.estimate.ModelInfo` of local sizes, over N / T shards:

* an ``nn.Module`` with a ``tensor_parallel_plan`` (``{module name: ColwiseParallel() | RowwiseParallel()}``,
  the plan given to torch's ``parallelize_module``), or already parallelized (DTensor parameters): the
  local size of every parameter, exactly as the engine shards them (a dim of n cut T ways: rank 0 holds
  ceil(n / T), the largest piece, as ``torch.chunk`` cuts);
* a T5 (preset, :class:`~.t5_dims.T5Dims` or a Hugging Face T5 module without a plan): the attention
  q/k/v/o and the FFN wi/wo matrices cut (whole heads per TP rank), embeddings, norms and the relative
  attention bias replicated -- :func:`t5_plan`, a plan ``parallelize_module`` accepts as well.

Stage 3 is not available with tensor parallelism (its rows are left out), nor is hybrid sharding.
Activations are counted as without TP (a TP rank saves less: conservative).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from torch import nn

from ..engine.layout import tensor_parallel as TP

COLWISE, ROWWISE = "ColwiseParallel", "RowwiseParallel"
T5_COLWISE, T5_ROWWISE = ("q", "k", "v", "wi", "wi_0", "wi_1"), ("o", "wo")


@dataclass
class TensorParallelSplit:
    """How the parameters divide: ``split`` elements cut T ways, the rest replicated; ``local`` per rank."""

    size: int
    full: int
    split: int
    local: int


def t5_plan(module: nn.Module) -> dict[str, Any]:
    """The T5 cut: q/k/v and wi column-parallel, o and wo row-parallel (every such ``nn.Linear``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for name, m in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, nn.Linear) and leaf in T5_COLWISE + T5_ROWWISE:
            plan[name] = ColwiseParallel() if leaf in T5_COLWISE else RowwiseParallel()
    return plan


def _cut(n: int, size: int) -> int:
    return math.ceil(n / size)  # torch.chunk: rank 0's piece is the largest


def _local_sizes(module: nn.Module, size: int, plan: Optional[dict]) -> dict[int, int]:
    """{id(param): local numel} under ``plan`` (None: the module's own DTensors)."""
    local = {id(p): TP.local_numel(p) for p in module.parameters()}
    if plan is None:
        return local
    modules = dict(module.named_modules())
    for name, style in plan.items():
        m, kind = modules.get(name), type(style).__name__
        if m is None:
            raise ValueError(f"tensor_parallel_plan names {name!r}, which is no submodule of the model.")
        if kind not in (COLWISE, ROWWISE) or not isinstance(m, (nn.Linear, nn.Embedding)):
            continue  # other styles (SequenceParallel, PrepareModule*) leave the parameters whole
        # nn.Linear weight (out, in): colwise cuts dim 0 (and the bias), rowwise dim 1; nn.Embedding the reverse
        dim = (0 if kind == COLWISE else 1) if isinstance(m, nn.Linear) else (1 if kind == COLWISE else 0)
        w = m.weight
        local[id(w)] = w.numel() // w.shape[dim] * _cut(w.shape[dim], size)
        if isinstance(m, nn.Linear) and m.bias is not None and kind == COLWISE:
            local[id(m.bias)] = _cut(m.bias.numel(), size)
    return local


def _local_name(info, size: int) -> str:
    return f"{info.name} (one rank's local pieces at tensor_parallel_size={size})"


def _module_info(info, module: nn.Module, size: int, plan: Optional[dict]):
    if plan is None and not any(TP.is_dtensor(p) for p in module.parameters()):
        cfg = getattr(module, "config", None)
        if cfg is None or getattr(cfg, "model_type", "") != "t5":
            raise ValueError("tensor_parallel_size on an nn.Module needs to know which parameters are cut. "
                             "Allowed: tensor_parallel_plan={module name: ColwiseParallel() | RowwiseParallel()} "
                             "(the parallelize_module plan), a module already parallelized, or a T5 model.")
        plan = t5_plan(module)
    local = _local_sizes(module, size, plan)
    params = {id(p): p for p in module.parameters()}  # tied parameters once, as the engine counts them
    sizes = [local[i] for i in params]
    train = [local[i] for i, p in params.items() if p.requires_grad]
    full = sum(p.numel() for p in params.values())  # a DTensor's numel is its global one
    split = sum(p.numel() for i, p in params.items() if local[i] != p.numel())
    return replace(info, numel=sum(sizes), trainable=sum(train), sizes=sizes, trainable_sizes=train,
                   largest_param=max(sizes, default=0), name=_local_name(info, size)), full, split


def _t5_info(info, dims, size: int):
    if dims.num_heads % size or dims.d_ff % size:
        allowed = [t for t in range(1, dims.num_heads + 1) if dims.num_heads % t == 0 and dims.d_ff % t == 0]
        raise ValueError(f"tensor_parallel_size={size} must divide the T5 heads ({dims.num_heads}) and d_ff "
                         f"({dims.d_ff}): whole heads per rank. Allowed: {', '.join(map(str, allowed))}.")
    ff = dims.d_ff * (3 if dims.gated else 2)
    per_block = lambda decoder: ((8 if decoder else 4) * dims.inner + ff) * dims.d_model  # noqa: E731
    split = dims.num_layers * per_block(False) + dims.dec_layers * per_block(True)
    local = info.numel - split + split // size
    largest = max(dims.vocab_size * dims.d_model, dims.d_model * dims.d_ff // size)
    return replace(info, numel=local, trainable=local, sizes=[], trainable_sizes=[], largest_param=largest,
                   name=_local_name(info, size)), info.numel, split


def tensor_parallel_info(model: Any, info, size: int, world_size: int, shard_group_size: Optional[int],
                         plan: Optional[dict] = None):
    """(:class:`TensorParallelSplit`, the ModelInfo of one rank's local pieces) for ``model`` at TP ``size``."""
    # the size's type, its divisibility and its combinations: estimate() checked them (engine/layout/dims.py)
    if isinstance(model, nn.Module):
        local, full, split = _module_info(info, model, size, plan)
    elif info.t5 is not None:
        if plan is not None:
            raise ValueError("tensor_parallel_plan applies to an nn.Module; a T5 preset is cut by the T5 rule.")
        local, full, split = _t5_info(info, info.t5, size)
    else:
        raise ValueError("tensor_parallel_size needs the model's structure (which parameters are cut). Allowed: "
                         "a T5 preset or T5Dims, or an nn.Module (with tensor_parallel_plan unless T5).")
    return TensorParallelSplit(size, full, split, local.numel), local


def tensor_parallel_line(est) -> str:
    tp = est.tensor_parallel
    dp = est.world_size // tp.size
    over = f"{est.shard_group_size} of the {dp}" if est.shard_group_size is not None else f"the {dp}"
    return (f"tensor parallelism: T={tp.size} x data parallel {dp}; {tp.split:,} of "
            f"{tp.full:,} params ({tp.split / max(tp.full, 1):.0%}) cut {tp.size} ways, the rest replicated: "
            f"{tp.local:,} local params per rank, whose states ZeRO shards over {over} "
            "data-parallel rank(s); stage 3 is not available with TP; activations counted as without TP.")
