"""ZeroEngine: one object that turns a module + optimizer into a ZeRO stage 0/1/2 training step.

Design note
-----------
The engine imports nothing from Lightning; it is usable from plain torch.distributed::

    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2))
    for batch in loader:
        loss = model(batch).sum()
        loss.backward()            # gradients are reduced (and sharded) during backward
        engine.step()              # master shards step, full params are rebuilt, grads cleared

Path of one step: ``backward`` -> :class:`~.reducer.GradReducer` hooks reduce buckets as they fill ->
:meth:`step` finalizes (which parameters were used anywhere), points the masters' ``.grad`` at the
reduced shards, computes the global norm when clipping or loss scaling needs it (one all-reduce),
applies unscale and clip in one multiply, steps the user's optimizer on the masters, and publishes the
updated shards back into the module's parameters (one all-gather per bucket).

Accumulation: wrap non-boundary micro-batches in :meth:`no_sync` (stages 0-1 issue no collective
there; stage 2 reduces each micro-batch into its gradient shard regardless, as DeepSpeed does).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch
from torch import nn

from . import collectives as C
from .buckets import build_buckets
from .config import ZeroConfig
from .memory import MemoryReport
from .optimizer import ShardedOptimizer
from .reducer import GradReducer
from .state import consolidate_optimizer_state, load_sharded_optimizer_state


class ZeroEngine:
    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Optional[ZeroConfig] = None,
        compute_dtype: Optional[torch.dtype] = None,
        loss_scaler: Optional[Any] = None,
        check_finite: bool = False,
        group: Optional[Any] = None,
    ) -> None:
        self.config = config or ZeroConfig()
        if self.config.stage == 3:
            raise NotImplementedError("ZeRO stage 3 is not available in this engine yet; use stage 0, 1 or 2.")
        self.module = module
        self.optimizer = optimizer
        self.group = group
        self.compute_dtype = compute_dtype
        self.loss_scaler = loss_scaler
        self.check_finite = check_finite or loss_scaler is not None
        self.world_size = C.world_size(group)
        self.rank = C.rank(group)
        self.params = self._managed_params(module, optimizer)
        self.sync_module_states()
        self.buckets = build_buckets(
            self.params, self.world_size, self.rank, self.config.bucket_bytes, sharded=self.config.stage >= 1
        )
        # masters are cut from the fp32 values before the module drops to the compute dtype
        self.sharded = ShardedOptimizer(
            optimizer, self.buckets, self.config.stage, self.config.offload_optimizer, compute_dtype
        )
        if compute_dtype is not None and compute_dtype != torch.float32:
            module.to(compute_dtype)  # params and floating buffers, as DeepSpeed's module.half()
        self.reducer = GradReducer(self.buckets, self.config.stage, self.config.reduce_dtype, group)
        self._grads_final = False
        self._clip_coef: Optional[float] = None
        self._clip_value: Optional[float] = None
        self._sq_norm: Optional[torch.Tensor] = None
        self.last_step_skipped = False
        self.skipped_steps = 0

    @property
    def bucket_params(self) -> list[nn.Parameter]:
        """Managed parameters in bucket order (the order of masters and of full_master_params())."""
        return [p for b in self.buckets for p in b.params]

    # -- setup ------------------------------------------------------------------------------------
    @staticmethod
    def _managed_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        in_module = {id(p) for p in module.parameters()}
        stray = in_opt - in_module
        if stray:
            raise ValueError(
                f"The optimizer holds {len(stray)} tensor(s) that are not parameters of the module; "
                "ZeRO can only shard parameters of the module it wraps."
            )
        if len(optimizer.param_groups) and sum(len(g["params"]) for g in optimizer.param_groups) != len(in_opt):
            raise ValueError("A parameter appears more than once in the optimizer's param_groups.")
        return [p for p in module.parameters() if p.requires_grad and id(p) in in_opt]

    def sync_module_states(self) -> None:
        """Make every rank start from rank 0's parameters and buffers (as DDP does at wrap time)."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            tensors = [p.data for p in self.module.parameters()] + [b for b in self.module.buffers()]
            _broadcast_flat(tensors, self.group)

    def sync_buffers(self) -> None:
        if self.world_size > 1 and self.config.broadcast_buffers:
            with torch.no_grad():
                _broadcast_flat(list(self.module.buffers()), self.group)

    # -- backward-side controls ---------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no collective in stages 0-1) for non-boundary micro-batches."""
        prev = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = prev

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.scale) if self.loss_scaler is not None else 1.0

    # -- step-side ----------------------------------------------------------------------------------
    def finalize_grads(self) -> None:
        """Complete reductions and point the masters' ``.grad`` at this rank's reduced gradients."""
        if self._grads_final:
            return
        masks = self.reducer.finalize()
        grads: list[list[Optional[torch.Tensor]]] = []
        for b, mask in zip(self.buckets, masks):
            if self.config.stage == 0:
                row = [p.grad if used else None for p, used in zip(b.params, mask.tolist())]
            else:
                shard = self.reducer.grad_shards[b.index]
                views = b.local_views(shard) if shard is not None else [None] * len(b.params)
                row = [v if used else None for v, used in zip(views, mask.tolist())]
            grads.append(row)
        self.sharded.assign_grads(grads)
        self._grads_final = True

    def _global_sq_norm(self) -> torch.Tensor:
        if self._sq_norm is None:
            self.finalize_grads()
            sq = self.sharded.local_sq_norm()
            if self.config.stage >= 1:  # shards are disjoint: sum their squares over ranks
                dev = self.params[0].device if self.params else sq.device
                sq_dev = sq.to(dev)
                C.all_reduce(sq_dev, group=self.group)
                sq = sq_dev.to(sq.device)
            self._sq_norm = sq
        return self._sq_norm

    def global_grad_norm(self) -> torch.Tensor:
        """2-norm of the (unscaled) gradient over all ranks' shards: DDP's ``clip_grad_norm_`` total."""
        return self._global_sq_norm().sqrt() / self.loss_scale

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm; the multiply is fused with unscaling in :meth:`step`."""
        total = self.global_grad_norm()
        self._clip_coef = min(1.0, float(max_norm) / (float(total) + 1e-6)) if math.isfinite(total) else None
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        self._clip_value = float(clip_value)

    def step(self) -> bool:
        """Step the optimizer on the master shards and publish the new parameters.

        Returns False when the step was skipped because a gradient was non-finite on some rank
        (only when a loss scaler or ``check_finite`` is active); every rank then skips together.
        """
        self.finalize_grads()
        overflow = False
        if self.check_finite:
            overflow = not bool(torch.isfinite(self._global_sq_norm()))
        if self.loss_scaler is not None:
            skip = self.loss_scaler.update(overflow)
        else:
            skip = overflow
        self.last_step_skipped = skip
        self.skipped_steps += int(skip)
        if not skip:
            coef = (1.0 / self.loss_scale) * (self._clip_coef if self._clip_coef is not None else 1.0)
            self.sharded.scale_grads(coef)
            if self._clip_value is not None:
                self.sharded.clamp_grads(self._clip_value)
            self.sharded.step()
            self.publish_params()
        self.zero_grad()
        return not skip

    @torch.no_grad()
    def publish_params(self) -> None:
        """Copy the updated masters into the module's parameters (all-gather in stages 1-2)."""
        if self.config.stage == 0:
            for row, b in zip(self.sharded.masters, self.buckets):
                for m, p in zip(row, b.params):
                    if m is not p:
                        p.data.copy_(m.view_as(p))
            return
        pending = []
        for row, b in zip(self.sharded.masters, self.buckets):
            dtype, dev = b.params[0].dtype, b.params[0].device
            send = torch.zeros(b.shard_numel, dtype=dtype, device=dev)
            for view, m in zip(b.local_views(send), row):
                view.copy_(m, non_blocking=True)
            out = torch.empty(b.world_size * b.shard_numel, dtype=dtype, device=dev)
            pending.append((b, C.all_gather(out, send, group=self.group, async_op=True), out))
        for b, work, out in pending:
            work.wait()
            b.unpack_rank_major(out, [p.data for p in b.params])

    @torch.no_grad()
    def full_master_params(self) -> list[torch.Tensor]:
        """fp32 full values of every managed parameter, on every rank (one all-gather per bucket).

        In mixed precision the module holds rounded copies; checkpoints and the model handed back
        after training take these instead, so no precision is lost across a save/resume.
        """
        if self.config.stage == 0:
            return [m.detach().float().view_as(p) for row, b in zip(self.sharded.masters, self.buckets)
                    for m, p in zip(row, b.params)]
        fulls: list[torch.Tensor] = []
        for row, b in zip(self.sharded.masters, self.buckets):
            dev = b.params[0].device
            send = torch.zeros(b.shard_numel, dtype=torch.float32, device=dev)
            for view, m in zip(b.local_views(send), row):
                view.copy_(m)
            out = torch.empty(b.world_size * b.shard_numel, dtype=torch.float32, device=dev)
            C.all_gather(out, send, group=self.group)
            outs = [torch.empty(p.shape, dtype=torch.float32, device=dev) for p in b.params]
            b.unpack_rank_major(out, outs)
            fulls.extend(outs)
        return fulls

    @torch.no_grad()
    def restore_fp32_module(self) -> None:
        """Give the module back in fp32 with the master values (end of training in mixed precision)."""
        if self.compute_dtype in (None, torch.float32):
            return
        fulls = self.full_master_params()
        for p, f in zip(self.bucket_params, fulls):
            p.data = f
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()

    def zero_grad(self) -> None:
        self.reducer.clear()
        self.sharded.clear_grads()
        self._grads_final = False
        self._clip_coef = self._clip_value = None
        self._sq_norm = None

    # -- checkpoints ----------------------------------------------------------------------------------
    def optimizer_state_dict(self) -> dict:
        """The full (unsharded) optimizer state, as a plain optimizer would save it. Collective call."""
        return consolidate_optimizer_state(self)

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load a full optimizer state (from any world size or stage) into this rank's shards."""
        load_sharded_optimizer_state(self, state)

    # -- accounting -----------------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        r = MemoryReport(
            params=nbytes(self.params),
            grads=nbytes(p.grad for p in self.params),
            grad_shards=nbytes(self.reducer.grad_shards),
            master=self.sharded.master_bytes(),
            optimizer_state=self.sharded.state_bytes(),
        )
        if self.config.offload_optimizer:
            r.host = r.master + r.optimizer_state
        return r

    def remove(self) -> None:
        """Detach hooks (the module keeps its current, full parameters)."""
        self.reducer.remove_hooks()


def _broadcast_flat(tensors: list[torch.Tensor], group: Optional[Any], cap: int = 64 * 2**20) -> None:
    """Broadcast tensors from rank 0 through a few flat buffers (grouped by dtype and device)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), ts in groups.items():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in ts + [None]:
            if t is None or (chunk and (size + t.numel()) * t.element_size() > cap):
                flat = torch.cat([c.reshape(-1) for c in chunk])
                C.broadcast(flat, 0, group)
                off = 0
                for c in chunk:
                    c.copy_(flat[off : off + c.numel()].view_as(c))
                    off += c.numel()
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += t.numel()
