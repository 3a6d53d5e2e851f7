"""Whole-model views of a sharded engine: for checkpoints, consolidation and handing the model back.

Design note
-----------
Training never needs a full copy of anything, but users do: a checkpoint must name every parameter, a
consolidated state dict must hold full fp32 values, and after ``fit`` the user expects a normal module.
These methods build those views from the shards -- one all-gather per bucket, in fp32 from the masters
(the module may hold fp16/bf16 copies) -- and describe each shard (name, slice, full shape) so sharded
checkpoints can be written without ever materializing the model on one rank.
"""

from __future__ import annotations

import torch

from . import collectives as C
from .sharding import ShardSpec


class FullStateMixin:
    """Mixed into :class:`~.engine.ZeroEngine` (uses its buckets, masters, partitioner and module)."""

    @torch.no_grad()
    def full_master_params(self) -> list[torch.Tensor]:
        """fp32 full values of every managed parameter, on every rank (one all-gather per bucket).

        In mixed precision the module holds rounded copies; checkpoints and the model handed back
        after training take these instead, so no precision is lost across a save/resume.
        """
        if self.config.stage == 0:
            return [m.detach().float().view_as(p) for row, b in self.master_rows()
                    for m, p in zip(row, b.params)]
        fulls: list[torch.Tensor] = []
        for row, b in self.master_rows():
            fulls.extend(b.full_tensors(b.all_gather(row, torch.float32, self.shard_group)[1]))
        return fulls

    @torch.no_grad()
    def restore_fp32_module(self) -> None:
        """Hand the module back whole and in fp32, with the master values (end of training).

        Stages 0-2 in fp32 have nothing to do. Stage 3 un-partitions the module for good: every rank ends
        with full parameters (as after DeepSpeed's ``zero_to_fp32``), and the engine is spent.
        """
        if self.partitioner is not None:
            self._unpartition()
            return
        if self.compute_dtype in (None, torch.float32):
            return
        fulls = self.full_master_params()
        for p, f in zip(self.bucket_params, fulls):
            p.data = f
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()

    @torch.no_grad()
    def _unpartition(self) -> None:
        masters = dict(zip(map(id, self.bucket_params), self.full_master_params())) if self.sharded else {}
        with self.partitioner.gathered():
            full = {id(p): p.detach().clone() for p in self.module.parameters()}
        self.partitioner.remove_hooks()
        if self.reducer is not None:
            self.reducer.remove_hooks()
        for p in self.module.parameters():
            p.data = masters.get(id(p), full[id(p)].float() if full[id(p)].is_floating_point() else full[id(p)])
        for b in self.module.buffers():
            if b.is_floating_point():
                b.data = b.data.float()
        self.partitioner = None

    @torch.no_grad()
    def load_masters_from_module(self) -> None:
        """Cut each master from the module's (whole) parameter: after training, when the module handed
        back is what the user holds and may change (load weights, average them). No collective."""
        if self.partitioner is not None or self.sharded is None:
            raise RuntimeError("load_masters_from_module needs a detached engine (module whole, masters present).")
        for p, (_, m, spec, _) in zip(self.bucket_params, self.master_items()):
            if m is not p:
                flat = p.detach().reshape(-1).to(device=m.device, dtype=m.dtype)
                m.copy_((flat if spec.world_size == 1 else flat[spec.lo : spec.hi]).view_as(m))

    def param_names(self) -> list[str]:
        """Fully-qualified name of each managed parameter, in bucket order (first name of a tied one)."""
        names = {}
        for name, p in self.module.named_parameters():
            names.setdefault(id(p), name)
        return [names[id(p)] for p in self.bucket_params]

    def master_items(self) -> list[tuple[str, torch.Tensor, "ShardSpec", torch.Size]]:
        """(name, master, spec, full shape) per managed parameter, in bucket order.

        ``master`` is this rank's fp32 slice ``[spec.lo, spec.hi)`` of the flattened parameter (stages 1-3;
        the slices of all ranks, in rank order, concatenate to the parameter -- ``torch.chunk`` layout),
        or the whole fp32 parameter in stage 0 (``spec.world_size == 1``). Writing into a master and
        calling :meth:`publish_params` updates the module.
        """
        out = []
        if self.sharded is None:
            return out
        names = iter(self.param_names())
        for row, b in self.master_rows():
            for m, p, spec in zip(row, b.params, b.specs):
                out.append((next(names), m, spec, p.shape))
        return out

    def unmanaged_shard_items(self) -> list[tuple[str, torch.Tensor, "ShardSpec", torch.Size]]:
        """Stage 3: (name, this rank's slice in the unit shard, spec, shape) of every parameter without a
        master (frozen ones; all of them in an evaluation-only engine). Empty below stage 3, where such
        parameters are whole in the module."""
        if self.partitioner is None:
            return []
        managed = {id(p) for p in self.bucket_params} if self.sharded is not None else set()
        names: dict[int, str] = {}
        for name, p in self.module.named_parameters():
            names.setdefault(id(p), name)
        out = []
        for u in self.partitioner.units:
            if not u.params:
                continue
            for p, view, spec in zip(u.params, u.local_views(), u.layout.specs):
                if id(p) not in managed:
                    out.append((names[id(p)], view, spec, p.shape))
        return out

    def optimizer_state_dict(self, optimizer=None) -> dict:
        """The full (unsharded) state of ``optimizer`` (default: the first), as a plain optimizer would
        save it. Collective call."""
        s = self.sharded_for(optimizer) if optimizer is not None else self.sharded
        return s.full_state_dict(self.shard_group)

    def load_optimizer_state_dict(self, state: dict, optimizer=None) -> None:
        """Load a full optimizer state (from any world size or stage) into this rank's shards."""
        s = self.sharded_for(optimizer) if optimizer is not None else self.sharded
        s.load_full_state_dict(state)

    @torch.no_grad()
    def load_full_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load a full (unsharded) state dict: into the module, the fp32 masters and, under stage 3, the
        unit shards (a stage-3 parameter has no storage of its own to write into). Same key checks as
        ``load_state_dict(strict=True)``; no collective except the stage 1-2 all-gather of the result."""
        module = self.module
        if self.partitioner is None:
            module.load_state_dict(state_dict, strict=strict)
        else:
            expected = set(module.state_dict().keys())
            missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
            if strict and (missing or unexpected):
                raise RuntimeError(f"Error loading a state dict into {type(module).__name__}: missing keys "
                                   f"{missing}, unexpected keys {unexpected}.")
            buffers = {n for n, _ in module.named_buffers()}
            module.load_state_dict({k: v for k, v in state_dict.items() if k in buffers}, strict=False)
        for name, m, spec, _ in list(self.master_items()) + list(self.unmanaged_shard_items()):
            if name in state_dict:
                flat = state_dict[name].to(device=m.device, dtype=torch.float32).reshape(-1)
                m.copy_((flat if spec.world_size == 1 else flat[spec.lo : spec.hi]).view_as(m))
        if self.sharded is not None or self.partitioner is not None:
            self.publish_params() if self.sharded is not None else self.partitioner.after_step()
