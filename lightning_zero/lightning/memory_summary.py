"""The memory table a person reads at a glance: what one rank holds under ZeRO, beside what DDP would hold.

Design note
-----------
Gradients and optimizer state are created by the first step (torch's optimizers allocate their state
lazily), and a stage-3 unit's gathered bytes are known once it has been gathered, so the table is measured
after the first optimizer step (or at the end of training, when there was none), on every rank, with
``engine.memory_report()``: exact tensor bytes, no allocator guesses. Gradients are freed by the step, so
their row is what the next backward allocates again: the buckets' reduced slices (stages 1-3; at stage 1
without accumulation the full gradients only live bucket by bucket), at stage 0 the full gradients. DDP's column is what the same model and
optimizer hold without sharding (the floor of ``engine/memory/floors.py`` at stage 0, with the optimizer-state
bytes the ranks really allocated added up -- at fp32, as DDP keeps them, where the run keeps them in bf16), so the
ratio is the saving this run gets. Global rank 0 prints
it and hands the numbers to the loggers as ``zero/*`` metrics.

Under tensor parallelism the baseline is DDP of the same TP-split model: each rank holds its local pieces
(TP is not what ZeRO saves), and its optimizer state is what the data-parallel ranks of one TP rank
allocated together (the pieces of another TP rank are other parameters), the largest such TP rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..engine.layout import tensor_parallel as TP
from ..engine.placement.placement import Location
from ..engine.plan import ShardingPlan

# where states live -> the header's word; the off-device rows, by location: on disk between steps (states,
# parameter shards), streamed through a host ring during use
_WHERE = {Location.HOST: "", Location.NVME: " (NVMe)"}
_OFF_DEVICE_ROWS = ((Location.HOST, "host (offloaded)", "host"), (Location.NVME, "NVMe (offloaded)", "nvme"),
                    (Location.NVME, "host NVMe ring", "ring"))
_ROWS = (("params", "params"), ("grads", "grads"), ("master", "master"), ("optimizer_state", "optimizer state"))


def rank_numbers(engine) -> dict[str, int]:
    """This rank's bytes by kind (gradients and their reduced shards together), plus what DDP's column needs."""
    r = engine.memory_report()
    grads = r.grads + r.grad_shards
    if not grads:  # freed by the step; the next backward allocates them again, as the reducer does:
        if not engine.plan.shards_optimizer_state:  # whole, until zero_grad
            grads = sum(p.numel() * p.element_size() for p in engine.params)
        else:  # each bucket's reduced slice, in the reduction dtype
            grads = sum(b.shard_numel * (engine.config.reduce_dtype or b.params[0].dtype).itemsize
                        for b in engine.buckets)
    mine = {"params": r.params, "grads": grads, "master": r.master,
            "optimizer_state": r.optimizer_state, "host": r.host, "nvme": r.nvme, "ring": r.ring}
    mine["device"] = sum(mine[k] for k, _ in _ROWS) - r.host - r.nvme
    if engine.tensor_parallel is not None:  # DDP's column: this rank's local pieces
        mine["tp_rank"] = engine.tensor_parallel.mesh.get_local_rank(TP.TP_DIM)
        mine["ddp_numel"] = sum({id(p): TP.local_numel(p) for p in engine.module.parameters()}.values())
        mine["ddp_trainable"] = sum(TP.local_numel(p) for p in engine.params)
    part = engine.partitioner
    if part is not None:
        mine["units"] = len(part.units)
        mine["largest_unit"] = max((u.full_bytes for u in part.units), default=0)
        mine["peak_gathered"] = part.peak_gathered_bytes
    return mine


def ddp_numbers(engine, ranks: list[dict]) -> dict[str, float]:
    """What one DDP rank holds for the same model and optimizer: everything whole, nothing offloaded (under
    tensor parallelism: the same TP-split model, its local pieces whole)."""
    compute = engine.compute_dtype or torch.float32
    mixed = compute != torch.float32
    size = torch.empty((), dtype=compute).element_size()
    sharded = engine.plan.shards_optimizer_state and len(ranks) > 1
    if "tp_rank" in ranks[0]:
        numel, trainable = max(r["ddp_numel"] for r in ranks), max(r["ddp_trainable"] for r in ranks)
        by_tp: dict[int, int] = {}
        for r in ranks:
            by_tp[r["tp_rank"]] = by_tp.get(r["tp_rank"], 0) + r["optimizer_state"]
        state = max(by_tp.values()) if sharded else max(r["optimizer_state"] for r in ranks)
    else:
        trainable = sum(p.numel() for p in engine.params)
        numel = sum({id(p): p.numel() for p in engine.module.parameters()}.values())  # frozen too, tied once
        state = sum(r["optimizer_state"] for r in ranks) if sharded else ranks[0]["optimizer_state"]
    if engine.plan.optimizer_state_dtype == "bf16":  # DDP's optimizer keeps the per-element state in fp32
        state *= 2
    ddp = {"params": size * numel, "grads": size * trainable, "master": 4 * trainable if mixed else 0,
           "optimizer_state": state, "host": 0, "nvme": 0, "ring": 0}
    ddp["device"] = sum(ddp[k] for k, _ in _ROWS)
    return ddp


def _mb(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _ratio(ddp: float, zero: float) -> str:
    if ddp == 0 and zero == 0:
        return "-"
    return f"{ddp / zero:.1f}x" if zero else "all"


def format_table(zero_config, world_size: int, ranks: list[dict], ddp: dict) -> str:
    """One compact table: the largest rank's bytes (and rank 0's when they differ), DDP's, the saving."""
    worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
    plan = ShardingPlan.of(zero_config)
    placement = plan.placement  # [Note: placement]
    kinds = (("optimizer", placement.optimizer_states), ("params", placement.param_shards))
    off = [what + _WHERE[where] for what, where in kinds if where.off_device]
    tp = len({r["tp_rank"] for r in ranks}) if "tp_rank" in ranks[0] else None
    head = (f"ZeRO stage {zero_config.stage} on {world_size} rank(s)" + (f", offload {'+'.join(off)}" if off else "")
            + (f", tensor parallel {tp} x data parallel {world_size // tp}" if tp else "")
            + ": model-state bytes per rank after the first step (max over ranks) vs DDP"
            + (" of the same TP-split model" if tp else ""))
    rows = [("", "ZeRO", "DDP", "saving")]
    dtypes = {"master": "bf16 + compensation" if plan.master_dtype == "bf16" else "fp32",
              "optimizer_state": "bf16" if plan.optimizer_state_dtype == "bf16" else ""}  # ZeRO's column's
    for key, label in _ROWS:
        label = f"{label} ({dtypes[key]})" if dtypes.get(key) else label
        rows.append((label, _mb(worst[key]), _mb(ddp[key]), _ratio(ddp[key], worst[key])))
    rows.append(("device total", _mb(worst["device"]), _mb(ddp["device"]), _ratio(ddp["device"], worst["device"])))
    # the host row always; a scratch file's rows where the placement puts states on disk
    used = {Location.HOST} | {where for _, where in kinds}
    rows += [(label, _mb(worst[key]), _mb(0), "") for loc, label, key in _OFF_DEVICE_ROWS if loc in used]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [head] + ["  " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
                      for r in rows]
    if "units" in worst:
        lines.append(f"  stage 3: {worst['units']} units, largest gathered {_mb(worst['largest_unit'])}, "
                     f"peak gathered {_mb(worst['peak_gathered'])} (on top of the above, transient)")
    return "\n".join(lines)


def metrics(ranks: list[dict], ddp: dict) -> dict[str, float]:
    worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
    out = {f"zero/{k}_mb": worst[k] / 2**20 for k in ("params", "grads", "master", "optimizer_state", "host", "nvme")
           if k in worst}
    out["zero/model_states_mb"] = worst["device"] / 2**20
    out["zero/ddp_model_states_mb"] = ddp["device"] / 2**20
    out["zero/saving_vs_ddp"] = ddp["device"] / worst["device"] if worst["device"] else float("inf")
    if "units" in worst:
        out["zero/units"] = float(worst["units"])
        out["zero/peak_gathered_mb"] = worst["peak_gathered"] / 2**20
    return out


def report(strategy, trainer) -> Optional[str]:
    """Collective (every rank calls it): measure, gather to all, and on global rank 0 print the table and
    log the metrics. Returns the table on rank 0 (None elsewhere)."""
    engine = strategy.engine
    mine = rank_numbers(engine)
    ranks = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if not trainer.is_global_zero:
        return None
    ddp = ddp_numbers(engine, ranks)
    table = format_table(engine.config, len(ranks), ranks, ddp)
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    rank_zero_info(table)
    values: dict[str, Any] = metrics(ranks, ddp)
    for logger in trainer.loggers:
        logger.log_metrics(values, step=trainer.global_step)
    return table
