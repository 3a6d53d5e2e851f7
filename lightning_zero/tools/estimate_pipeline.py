"""Per-stage model-state memory of pipeline parallelism x ZeRO 0-2 (``estimate --pipeline-parallel-size P``).

Design note
-----------
With P stages over N ranks, each stage's parameters live on its N / P data-parallel replicas only, and
ZeRO stage 1 / 2 shards that stage's optimizer state (and gradients) over those replicas
(engine/pipeline/pipeline_zero.py). So a rank of stage i holds the ZeRO floor of Psi_i parameters over D = N / P ranks:
the engine's own formula (``engine.pipeline.estimate_stage_states`` -> ``engine/memory/floors.py``), the figures
``PipelineZero``'s ``memory_report`` is checked against (tests/test_pipeline.py). What a stage holds comes
from the split: given per stage (``stage_params``), cut by GPT-2 block for a module with
``transformer.h`` (``split_gpt2``'s even split: embeddings on the first stage, ``ln_f`` + head on the last),
else Psi / P each. Activations and the bubble are not memory of the states: the bubble fraction
(P - 1) / (M + P - 1) is printed next to the table for the given micro-batch count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn

from ..engine.memory.floors import optimizer_state_bytes_per_param
from ..engine.pipeline.pipeline_zero import bubble_fraction, check_pipeline_size, estimate_stage_states
from .estimate_knobs import check_knobs

GiB, MiB = 2**30, 2**20


@dataclass
class StageRow:
    stage_index: int
    numel: int
    zero: dict  # ZeRO stage (0, 1, 2) -> model_state_floor's dict (bytes per rank of this pipeline stage)


@dataclass
class PipelineEstimate:
    name: str
    world_size: int
    num_stages: int
    precision: str
    optimizer: str
    split: str  # how the stage sizes were found
    rows: list[StageRow]
    microbatches: Optional[int] = None

    @property
    def dp_size(self) -> int:
        return self.world_size // self.num_stages

    def worst(self, zero_stage: int) -> float:
        """The largest per-rank device bytes over the stages (the pipeline's memory bottleneck)."""
        return max(r.zero[zero_stage]["device"] for r in self.rows)


def stage_numels(model, num_stages: int, stage_params: Optional[Sequence[int]] = None) -> tuple[list[int], str]:
    """Parameters per pipeline stage and how they were found (given / GPT-2 blocks / an even cut)."""
    if stage_params is not None:
        if len(stage_params) != num_stages or any(n <= 0 for n in stage_params):
            raise ValueError(f"stage_params {list(stage_params)} do not give {num_stages} positive parameter counts. "
                             f"Allowed: one count per pipeline stage (e.g. --stage-params 40M,40M).")
        return [int(n) for n in stage_params], "given per stage"
    if isinstance(model, nn.Module):
        blocks = getattr(getattr(model, "transformer", None), "h", None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) >= num_stages and hasattr(model, "lm_head"):
            from ..engine.pipeline.split import even_split

            starts = even_split(len(blocks), num_stages) + [len(blocks)]
            counts = []
            for s in range(num_stages):
                n = sum(p.numel() for b in blocks[starts[s]:starts[s + 1]] for p in b.parameters())
                if s == 0:
                    n += sum(p.numel() for m in (model.transformer.wte, model.transformer.wpe) for p in m.parameters())
                if s == num_stages - 1:
                    n += sum(p.numel() for m in (model.transformer.ln_f, model.lm_head) for p in m.parameters())
                counts.append(n)
            return counts, f"GPT-2 blocks split evenly ({len(blocks)} blocks)"
        total = sum(p.numel() for p in model.parameters())
    else:
        total = int(model)
    base, extra = divmod(total, num_stages)
    return [base + (s < extra) for s in range(num_stages)], "Psi / P per stage (equal stages)"


def estimate_pipeline(model, world_size: int, num_stages: int, precision: str = "32-true", optimizer: str = "adamw",
                      stage_params: Optional[Sequence[int]] = None, microbatches: Optional[int] = None,
                      name: str = "model") -> PipelineEstimate:
    """Per pipeline stage: one of its ranks' model-state bytes at ZeRO stages 0, 1 and 2."""
    from .estimate import PRECISIONS

    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}. Allowed: 32-true, bf16-mixed, 16-mixed.")
    check_knobs(world_size=world_size, microbatches=microbatches)
    check_pipeline_size(num_stages, world_size)
    numels, split = stage_numels(model, num_stages, stage_params)
    k, mixed = optimizer_state_bytes_per_param(optimizer), PRECISIONS[precision]
    by_zero = {z: estimate_stage_states(numels, world_size, z, mixed, k) for z in (0, 1, 2)}
    rows = [StageRow(i, n, {z: by_zero[z][i] for z in (0, 1, 2)}) for i, n in enumerate(numels)]
    return PipelineEstimate(name, world_size, num_stages, precision, optimizer, split, rows, microbatches)


def _size(x: float) -> str:
    return f"{x / GiB:.2f}" if x >= 0.01 * GiB else f"{x / MiB:.2f}M"


def format_pipeline_estimate(est: PipelineEstimate) -> str:
    lines = [f"model: {est.name}; pipeline: P = {est.num_stages} stages x D = {est.dp_size} data-parallel replicas "
             f"({est.world_size} ranks); precision {est.precision}; optimizer {est.optimizer}; split: {est.split}",
             "GiB per rank of the stage (M = MiB); states = params + grads + master+optim; ZeRO 1/2 shard over the "
             "stage's D replicas (stage 3 does not compose with the pipeline)"]
    head = ("| pipeline stage | params | zero0 states | zero1 states | zero2 states "
            "| zero2 params / grads / master+optim |")
    lines += [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r in est.rows:
        z2 = r.zero[2]
        lines.append(f"| {r.stage_index} | {r.numel:,} | {_size(r.zero[0]['device'])} | {_size(r.zero[1]['device'])} "
                     f"| {_size(r.zero[2]['device'])} | {_size(z2['params'])} / {_size(z2['grads'])} / "
                     f"{_size(z2['optimizer'])} |")
    lines.append("largest stage (the pipeline's per-rank need): " + ", ".join(
        f"zero{z} {_size(est.worst(z))}" for z in (0, 1, 2)))
    if est.microbatches is not None:
        lines.append(f"bubble: (P - 1) / (M + P - 1) = {bubble_fraction(est.num_stages, est.microbatches):.2f} of a "
                     f"step at M = {est.microbatches} micro-batches (GPipe / 1F1B, equal stages)")
    return "\n".join(lines)
