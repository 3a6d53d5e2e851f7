"""Pipeline parallelism composed with ZeRO stages 0-2: torch's schedules drive, the engine shards each stage.

Design note
-----------
The world is a 2-D layout ``("pipeline_parallel", "data_parallel")`` of shape ``(P, D)``, row-major: rank
``r`` holds stage ``r // D`` and is replica ``r % D`` of it. Two kinds of groups, made once per process
(see [Note: why a group is never re-created] in groups.py): a *data-parallel* group per stage (the D ranks
holding it; a :class:`~.engine.ZeroEngine` on it shards that stage's optimizer state and gradients) and a
*pipeline* group per replica (the P ranks forming one pipeline; activations travel there, point to point).

One :meth:`PipelineZero.step` runs torch's own schedule (``torch.distributed.pipelining``: GPipe, 1F1B, or
interleaved 1F1B with several chunks -- non-adjacent stages -- per rank, one engine per chunk) over M
micro-batches. Gradients reach the engine through its usual post-accumulate-grad hooks, since the
schedule's backward is a plain ``torch.autograd.backward``. All micro-batches but the boundary one (the
last backward of the last accumulated batch) run under the engine's ``no_sync``, so stages 0-1 reduce once
per optimizer step, as DDP under accumulation; stage 2 reduces each micro-batch into its gradient shard
regardless (the engine's rule). The schedule's own gradient division is off: the loss is divided by
``M * accumulation`` instead, so the reduced gradient is that of the mean loss over the global batch.

Gradient norm, clipping and the fp16 overflow decision span all stages: each stage's squared norm (already
summed over its data-parallel shards by the engine) is all-reduced over the pipeline group and written
back into the engine's per-step cache, so ``clip_grad_norm_`` and the engine's finite check both see the
norm of the whole model and every rank of every stage skips or steps together.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..comm import collectives as C
from ..config import ZeroConfig
from ..engine import ZeroEngine
from ..engine_state import EngineMode
from ..layout.groups import check_pipeline_size, pipeline_layout  # noqa: F401  (the layout's, re-exported)
from ..layout.dims import ParallelDims, PipelineLayout  # noqa: F401
from ..memory.floors import model_state_floor
from .state import source_names, stage_state_dicts  # noqa: F401

SCHEDULES = ("1f1b", "gpipe", "interleaved")


def check_stage_balance(counts: list[int], max_imbalance: Optional[float]) -> None:
    """Refuse a split where a stage has no trainable parameter, or the largest stage holds more than
    ``max_imbalance`` times the parameters of the smallest (the pipeline runs at its slowest stage's pace)."""
    empty = [i for i, n in enumerate(counts) if n == 0]
    if empty:
        raise ValueError(f"pipeline stage(s) {empty} have no trainable parameters (parameters per stage: {counts}). "
                         f"Allowed: every stage owns at least one trainable parameter; move the split points.")
    if max_imbalance is not None and max(counts) > max_imbalance * min(counts):
        raise ValueError(f"pipeline stages are unbalanced: parameters per stage {counts}, the largest holds "
                         f"{max(counts) / min(counts):.2f}x the smallest, beyond max_imbalance={max_imbalance}. "
                         f"Allowed: splits within that factor (move the split points), or a larger max_imbalance "
                         f"(None disables the check).")


class PipelineZero:
    """One pipeline stage on this rank, sharded over its data-parallel group by a :class:`ZeroEngine`.

    ``stage_module``: this rank's stage (``pipeline_layout(P).stage_index`` says which to build); its forward
    takes the previous stage's output (the inputs on the first stage) and the last stage returns what
    ``loss_fn(output, targets)`` takes. ``step(inputs, targets)`` is called on every rank with this replica's
    batch (every rank checks it; only the first stage reads ``inputs``, only the last ``targets``).

    ``num_stages``: P, the ranks along one pipeline (the world holds world / P replicas of it).

    ``schedule="interleaved"`` (torch's ``ScheduleInterleaved1F1B``): ``stage_module`` is a list of V chunks
    and ``optimizer`` a list of V optimizers; chunk k of pipeline rank p is stage ``p + k * P`` of ``P * V``
    (:func:`virtual_stages`). Each chunk gets its own engine (its own ``no_sync``: torch reports the last
    backward per chunk); norms and overflow are summed over all of them.

    ``optimizer=None``: evaluation only (``evaluate`` / ``predict``; evaluation engines, fp32 weights as
    given, each stage's replicas start from its data-parallel rank 0); ``loss_fn=None`` as well: predict only.
    """

    def __init__(self, stage_module: Union[nn.Module, Sequence[nn.Module]], num_stages: int,
                 loss_fn: Optional[Callable], optimizer: Any, microbatches: int, schedule: str = "1f1b",
                 config: Optional[ZeroConfig] = None,
                 accumulate_grad_batches: int = 1, gradient_clip_val: Optional[float] = None,
                 max_imbalance: Optional[float] = 4.0, loss_scaler: Any = None, check_finite: bool = False,
                 compute_dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        config = config or ZeroConfig()
        # the combinations a pipeline refuses: layout.py's tables ([Note: one parallel layout])
        ParallelDims.of(config, pipeline=num_stages).check(config.stage)
        if schedule not in SCHEDULES:
            raise ValueError(f"Unknown pipeline schedule {schedule!r}. Allowed: {', '.join(SCHEDULES)}.")
        for name, value in (("microbatches", microbatches), ("accumulate_grad_batches", accumulate_grad_batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}.")
        chunks = list(stage_module) if isinstance(stage_module, (list, tuple)) else [stage_module]
        if optimizer is None:  # evaluation only: forward pipeline (evaluate / predict), weights as given
            optimizers = [None] * len(chunks)
        else:
            optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) and len(chunks) > 1 else [optimizer]
        if len(chunks) > 1 and (schedule != "interleaved" or len(optimizers) != len(chunks)):
            raise ValueError(f"{len(chunks)} stage chunks on one rank need schedule='interleaved' and one optimizer "
                             f"per chunk; got schedule={schedule!r} and {len(optimizers)} optimizer(s). Allowed: one "
                             f"module with '1f1b'/'gpipe', or a list of chunks and a list of optimizers with "
                             f"'interleaved'.")
        if len(chunks) > 1 and loss_scaler is not None:
            raise ValueError("a loss scaler with several chunks per rank would be updated once per chunk. Allowed: "
                             "loss_scaler=None with stage chunks (use bf16 or fp32), or one chunk per rank.")
        self.layout = lay = pipeline_layout(num_stages)
        self.stage_indices = virtual_stages(lay.stage_index, num_stages, len(chunks))
        self._check_balance(chunks, max_imbalance)
        self.microbatches, self.accumulate = microbatches, accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.modules, self.loss_fn = chunks, loss_fn
        self.engines = [ZeroEngine(m, o, config, compute_dtype=compute_dtype, loss_scaler=loss_scaler,
                                   check_finite=check_finite, group=lay.dp_group) for m, o in zip(chunks, optimizers)]
        device = torch.device(device) if device is not None else next(chunks[0].parameters()).device
        total = num_stages * len(chunks)
        self.pipe_stages = [_ZeroStage(m, i, total, device, group=lay.pp_group) for m, i in zip(chunks, self.stage_indices)]
        for st, engine in zip(self.pipe_stages, self.engines):
            st.pipeline, st.engine = self, engine
        # the first chunk's, for callers with one chunk per rank
        self.module, self.engine, self.pipe_stage = chunks[0], self.engines[0], self.pipe_stages[0]
        # scale_grads=False: the schedule would divide p.grad after backward, but the engine has already
        # reduced (stage 2: freed) it by then; the loss carries 1/(M * accumulation) instead
        # loss_fn=None (prediction only): the schedule computes no loss
        scaled = self._scaled_loss if loss_fn is not None else None
        if schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(self.pipe_stages, microbatches, loss_fn=scaled, scale_grads=False)
        else:
            cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            self.schedule = cls(self.pipe_stage, microbatches, loss_fn=scaled, scale_grads=False)
        self._calls = 0  # step() calls since the last optimizer step
        self.last_grad_norm: Optional[torch.Tensor] = None
        self.last_step_skipped = False

    def _check_balance(self, chunks: list, max_imbalance: Optional[float]) -> None:
        # every rank raises the same error (before any engine collective), so a bad split never hangs a peer
        mine = torch.tensor([sum(p.numel() for p in m.parameters() if p.requires_grad) for m in chunks],
                            dtype=torch.int64)
        P = self.layout.num_stages
        rows = [mine.clone() for _ in range(P)]
        if self.layout.pp_group is not None:
            dist.all_gather(rows, mine, group=self.layout.pp_group)
        by_stage = [int(rows[i % P][i // P]) for i in range(P * len(chunks))]  # stage p + k * P: rank p, chunk k
        check_stage_balance(by_stage, max_imbalance)

    @property
    def boundary(self) -> bool:
        """Whether the step() in progress ends with an optimizer step."""
        return self._calls == self.accumulate - 1

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        # in fp32: a half-precision loss times the loss scale overflows before any gradient exists
        loss = self.loss_fn(output, target).float()
        return self.engine.scale_loss(loss / (self.microbatches * self.accumulate))

    def _check_batch(self, inputs: Any, targets: Any) -> None:
        for what, t in (("inputs", inputs), ("targets", targets)):
            n = t.shape[0] if isinstance(t, torch.Tensor) else None
            if n is not None and n % self.microbatches:
                raise ValueError(f"the batch of {n} rows ({what}) does not split into microbatches="
                                 f"{self.microbatches} equal micro-batches. Allowed: a batch size that is a multiple "
                                 f"of {self.microbatches} on every replica.")

    @property
    def trains(self) -> bool:
        """False for an evaluation-only pipeline (``optimizer=None``)."""
        return self.engine.mode is EngineMode.TRAIN

    def step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Run the schedule on this replica's batch; on every accumulate-th call clip (globally) and step.

        Returns the mean loss over the global batch (all replicas), on every rank."""
        if not self.trains:
            raise RuntimeError("this PipelineZero was built with optimizer=None (evaluation only). Allowed: "
                               "evaluate(inputs, targets) and predict(inputs); build it with an optimizer to train.")
        self._check_batch(inputs, targets)
        lay = self.layout
        for m, engine in zip(self.modules, self.engines):
            m.train()
            engine.prepare_forward()
        losses: list[torch.Tensor] = []  # what _scaled_loss returned, per micro-batch (torch's own record:
        # its first step also calls the loss function once on placeholder outputs, to infer shapes)
        args = (inputs,) if lay.is_first else ()
        kwargs = dict(target=targets, losses=losses) if lay.is_last else {}
        self.schedule.step(*args, **kwargs)
        loss = self._global_mean(losses)
        if self.boundary:
            self._optimizer_step()
            self._calls = 0
        else:
            self._calls += 1
        return loss

    def _global_mean(self, losses: list) -> torch.Tensor:
        """The last stage's micro-batch losses (as ``_scaled_loss`` returned them) -> the mean over the global
        batch (every replica), on every rank."""
        lay = self.layout
        if lay.is_last:  # undo 1/(M * accumulation) and the loss scale: the mean over the micro-batches
            loss = torch.stack([x.detach().float() for x in losses]).sum() * self.accumulate / self.engine.loss_scale
        else:
            loss = torch.zeros(())
        if lay.is_last and lay.dp_size > 1:
            C.all_reduce(loss, group=lay.dp_group)
            loss /= lay.dp_size
        if lay.num_stages > 1:
            C.broadcast(loss, src=lay.num_stages - 1, group=lay.pp_group)
        return loss

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The forward pipeline only (eval mode, no gradient, no step) on this replica's batch: the mean loss
        over the global batch, on every rank (validation / test)."""
        self._check_batch(inputs, targets)
        lay = self.layout
        for m in self.modules:
            m.eval()
        losses: list[torch.Tensor] = []
        args = (inputs,) if lay.is_first else ()
        kwargs = dict(target=targets, losses=losses) if lay.is_last else {}
        self.schedule.eval(*args, **kwargs)
        return self._global_mean(losses)

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The forward pipeline without a loss on this replica's batch: the last stage's outputs (the
        micro-batches' concatenated), broadcast to every stage of this replica (each rank of a replica
        returns the same value)."""
        self._check_batch(inputs, None)
        lay = self.layout
        for m in self.modules:
            m.eval()
        # no targets: the schedule computes a loss whenever it has a loss function, so it has none here
        loss_fn, self.schedule._loss_fn = self.schedule._loss_fn, None
        try:
            out = self.schedule.eval(*((inputs,) if lay.is_first else ()))
        finally:
            self.schedule._loss_fn = loss_fn
        if lay.num_stages > 1:  # outputs of any structure and shape: pickled from the last stage
            box = [out]
            dist.broadcast_object_list(box, group_src=lay.num_stages - 1, group=lay.pp_group)
            out = box[0]
        return out

    def _optimizer_step(self) -> None:
        if self.gradient_clip_val is not None or self.engine.check_finite:
            self._pipeline_sq_norm()
        stepped = True
        for engine in self.engines:
            if self.gradient_clip_val is not None:
                self.last_grad_norm = engine.clip_grad_norm_(self.gradient_clip_val)
            stepped = engine.step() and stepped
        self.last_step_skipped = not stepped

    def _pipeline_sq_norm(self) -> None:
        """Write the squared gradient norm of the whole model (every stage, every chunk) into each engine's
        per-step cache.

        Each engine's clip coefficient and the overflow check of ``engine.step()`` read that cache, so both
        become global (``ZeroEngine.set_grad_sq_norm``)."""
        # one all-reduce over the dp group per sharded optimizer
        squares = [sq for engine in self.engines for sq in engine.shard_sq_norms()]
        total = torch.stack([sq.float().reshape(()).cpu() for sq in squares]).sum()
        if self.layout.num_stages > 1:
            total = total.to(self.engine.params[0].device)
            C.all_reduce(total, group=self.layout.pp_group)
            total = total.cpu()
        for engine in self.engines:
            engine.set_grad_sq_norm(total)

    # -- checkpoints: one sharded DCP directory per stage, written by checkpoint/pipeline_dir.py ---------------
    def state_dicts(self) -> list[dict]:
        """Per chunk on this rank: its stage's full fp32 module and optimizer state (gathered; not what
        checkpoints write). Collective over the dp group."""
        return stage_state_dicts(self)

    def restart_accumulation(self) -> None:
        """The next call of the step begins a new accumulation window (after a checkpoint is loaded). Saving and
        loading are ``checkpoint/pipeline_dir.py``'s ``save_pipeline_checkpoint`` / ``load_pipeline_checkpoint``
        (the checkpoint layer builds on the engine, not the reverse)."""
        self._calls = 0


def virtual_stages(rank_in_pipeline: int, num_ranks: int, chunks: int) -> list[int]:
    """The stage indices of a pipeline rank's chunks: ``p, p + P, p + 2P, ...`` (torch's interleaved layout)."""
    return [rank_in_pipeline + k * num_ranks for k in range(chunks)]


class _ZeroStage(PipelineStage):
    """A PipelineStage whose non-boundary backwards run under the engine's ``no_sync``."""

    pipeline: PipelineZero
    engine: ZeroEngine  # this chunk's

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        sync = last_backward and self.pipeline.boundary
        with contextlib.nullcontext() if sync else self.engine.no_sync():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


def estimate_stage_states(stage_numels: Sequence[int], world_size: int, stage: int, mixed: bool = False,
                          state_bytes: int = 8) -> list[dict]:
    """Per pipeline stage: the model-state floor (bytes) of one of its ranks, ``stage_numels[i]`` parameters
    sharded by ZeRO ``stage`` over the world / P replicas of that stage (engine/memory/floors.py's formula)."""
    dp = world_size // check_pipeline_size(len(stage_numels), world_size)
    return [model_state_floor(stage, n, dp, mixed, state_bytes) for n in stage_numels]


def bubble_fraction(num_stages: int, microbatches: int) -> float:
    """The idle share of a GPipe/1F1B step with equal stages: (P - 1) / (M + P - 1)."""
    return (num_stages - 1) / (microbatches + num_stages - 1)
