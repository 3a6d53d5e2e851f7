"""Master shards and the in-place rebinding of the user's optimizer.

Design note
-----------
The user's optimizer object is kept: its ``param_groups`` are edited so that every managed parameter is
replaced by its *master shard* -- the fp32 copy of this rank's slice (stages 1-3) or of the whole
parameter (stage 0). Per-group hyper-parameters, ``optimizer.state`` and any LR scheduler bound to the
optimizer keep working because the object and its groups are the same ones; only the tensors changed.

A master shard shares storage with the parameter when nothing forces a copy (fp32 compute, no offload):
then the optimizer updates the parameter's own slice in place and no extra fp32 copy exists, which is
what the fp32 memory floors assume. With fp16/bf16 compute, or with the optimizer offloaded to the CPU,
the master is a separate fp32 tensor (pinned on CUDA machines so host<->device copies can overlap).

How the optimizer steps is its kind, asked once by the builder ([Note: optimizer kinds], kinds/): an
elementwise one steps the master shards at any stage; a whole-tensor one steps whole parameters, each on its
owner rank above stage 0 ([Note: owner-rank step], owner_step.py); a communicating one (the 1-bit family) takes its gradients through its kind. The gradient side (what the
masters' ``.grad`` are, norms, clipping) is master_grads.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ..layout import tensor_parallel as TP
from ..grads.buckets import Bucket
from ..placement import host_kernels as HK
from ..placement.location import Location
from ..placement.state_stores import DeviceStates, StateStore, planned_masters
from .optimizer_routes import user_class
from .optimizer_state import consolidate_optimizer_state, load_sharded_optimizer_state, zero_lr_step
from .low_precision import LowPrecisionStates
from .owner_step import OwnerStep
from ..plan import ShardingPlan
from .kinds import OptimizerKind, kind_of
from .master_grads import MasterGrads


class ShardedOptimizer(MasterGrads):
    """Owns the master shards of the managed parameters and steps the user's optimizer on them."""

    def full_state_dict(self, group=None) -> dict:
        """The full (unsharded) optimizer state on rank 0 of ``group``, as a plain optimizer saves it."""
        self.make_resident()
        return consolidate_optimizer_state(self, group)

    def load_full_state_dict(self, full: dict) -> None:
        """Re-slice a full optimizer state (any world size or stage) into this rank's shards (bf16 states:
        sliced from the masters' fp32 form, kept in bf16 after)."""
        self.make_resident()
        self.widen_masters()
        load_sharded_optimizer_state(self, full)
        self.low_precision.narrow_state(self.optimizer, self._all_masters())
        self.narrow_masters()

    def make_resident(self) -> None:
        """Masters and state in memory until the next step (whole views; the state store reads them back)."""
        self.states.make_resident()

    def widen_masters(self) -> None:
        """bf16 masters as fp32 (``hi + lo``) until the next step: what whole views, saves and loads see."""
        self.low_precision.make_resident(self._all_masters())

    def narrow_masters(self) -> None:
        """bf16 masters back to ``hi`` + ``lo`` after a whole view, save or load (bit-exact for a save's)."""
        self.low_precision.narrow_all(self._all_masters())

    def spill(self) -> None:
        """What a whole view read back given up again: bf16 masters narrowed, the store spilled (NVMe)."""
        self.narrow_masters()
        self.states.spill()

    def _all_masters(self) -> list[torch.Tensor]:
        return [m for row in self.masters for m in row]

    def close(self) -> None:
        """End of the engine: the state store lets go of what it holds (NVMe: the scratch file removed)."""
        self.states.close()

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buckets: list[Bucket],
        plan: ShardingPlan,
        states: Optional[StateStore] = None,
        compute_dtype: Optional[torch.dtype] = None,
        sources: Optional[list[list[torch.Tensor]]] = None,
        fused_on_cpu: bool = True,
        tp_group: Optional[object] = None,
        tp_size: int = 1,
        alias_sources: bool = True,
        source_scope: Optional[Callable] = None,
        kind: Optional[OptimizerKind] = None,
        low_precision: Optional[LowPrecisionStates] = None,
    ) -> None:
        """``sources`` (stage 3): per bucket and parameter, this rank's fp32 slice to take the master from
        (the parameter itself no longer holds its values then). ``plan`` ([Note: sharding plan]): whole or
        sliced masters, and ``separate_masters`` (never alias a parameter whose gathered copy is rounded:
        quantized publish). ``states``: where the masters and optimizer state live and how the step runs
        ([Note: optimizer-state stores] in engine/placement/state_stores.py; default: on the compute device).
        ``fused_on_cpu``: a step on the host swaps in torch's fused CPU kernel (``ZeroConfig.offload_kernel=
        "fused"``); False keeps the user's. ``alias_sources=False`` (a parameter-shard store whose shards are
        not always in memory: NVMe): a master never aliases its stage-3 source; the masters are separate fp32
        tensors. ``source_scope(bucket)``: a context in which that bucket's ``sources`` can be read (NVMe: its
        unit's shard read back for the block, so setup holds one unit's shard at a time). ``kind``: how the
        optimizer steps (kinds/, checked by the builder before anything is sharded; default: asked here).
        ``low_precision``: bf16 moments / masters ([Note: low-precision optimizer states]; default: fp32)."""
        self.low_precision = low_precision if low_precision is not None else LowPrecisionStates()
        self._source_scope = source_scope
        self.kind = kind if kind is not None else kind_of(optimizer)
        self.owner: Optional[OwnerStep] = None  # a whole-tensor kind's owner-rank step, bound at stages 1-3
        self.optimizer = optimizer
        self.plan = plan
        self.states = states if states is not None else DeviceStates()
        self._swap_kernel = self.states.steps_on_host and fused_on_cpu
        # a master may alias its parameter only if the parameter stays fp32 where the master lives
        self._compute_fp32 = compute_dtype in (None, torch.float32)  # else the shards are cast later
        self._alias_sources = alias_sources
        self._may_alias = (self._compute_fp32 and self.states.masters_alias_params and not plan.separate_masters
                           and alias_sources)
        params = [p for b in buckets for p in b.params]
        device = params[0].device if params else torch.device("cpu")
        self.device = device  # where the gradients are reduced (the compute device)
        self.master_device = self.states.master_device(device)
        self._pin = self.states.pin_masters
        self.masters: list[list[torch.Tensor]] = []  # per bucket of self.buckets
        self._aliased: list[bool] = []  # a master aliasing its source costs no extra bytes
        self.buckets: list[Bucket] = []  # this optimizer's buckets (a bucket never spans two optimizers)
        # tensor parallelism (engine/layout/tensor_parallel.py): the TP group the squares are also summed over, and
        # what each parameter's squares count for there (1/T for one every TP rank holds whole)
        self.tp_group, self.tp_size = tp_group, tp_size
        self.states.reserve(optimizer, *planned_masters(  # before any master is made
            buckets, sources, self.plan.shards_optimizer_state,
            lambda p, spec, src: self._aliases(self._source(p, spec, src), src is not None)))
        self._rebind(self._add_masters(buckets, sources))
        if self._swap_kernel:
            HK.use_fused_cpu_kernels(self.optimizer)
        self.reset_step_state()

    def _add_masters(self, buckets: list[Bucket], sources) -> dict[int, torch.Tensor]:
        by_param: dict[int, torch.Tensor] = {}
        for bi, b in enumerate(buckets):
            row = []
            scope = self._source_scope if sources is not None and self._source_scope is not None else None
            with scope(b) if scope is not None else contextlib.nullcontext():
                for pi, (p, spec) in enumerate(zip(b.params, b.specs)):
                    src = sources[bi][pi] if sources is not None else None
                    m = self._make_master(p, spec, self._pin, src)
                    row.append(m)
                    by_param[id(p)] = m
            self.masters.append(row)
            self.buckets.append(b)
            # into the store now (NVMe: the file; setup holds one bucket's masters at a time)
            self.states.add_chunk(row, [not a for a in self._aliased[-len(row):]])
        return by_param

    def add_group(self, group: dict, buckets: list[Bucket], sources=None) -> None:
        """``optimizer.add_param_group`` after setup: masters for the new buckets (from the parameters'
        current values), then torch's own add_param_group on them (defaults filled in, existing state
        untouched). ``group["params"]``: the module's parameters, frozen ones included."""
        by_param = self._add_masters(buckets, sources)
        params = list(group["params"])
        self.group_layout.append([by_param.get(id(p)) for p in params])
        self.group_params.append(params)
        user_class(self.optimizer).add_param_group(
            self.optimizer, {**group, "params": [by_param[id(p)] for p in params if id(p) in by_param]})
        if self._swap_kernel:
            HK.use_fused_cpu_kernels(self.optimizer)

    def _source(self, p: torch.Tensor, spec, src: Optional[torch.Tensor]) -> torch.Tensor:
        if src is not None:
            return src
        return TP.local_data(p).view(-1)[spec.lo : spec.hi] if self.plan.shards_optimizer_state else TP.local(p)

    def _aliases(self, src: torch.Tensor, sources_given: bool) -> bool:
        """Whether the master of ``src`` is ``src`` itself. Stage 3 sources are this rank's unit shards: an fp32
        shard already where the master must live (host memory, shards and states both there) is the master;
        no second copy."""
        may_alias = self._may_alias or (sources_given and self._compute_fp32 and self._alias_sources)
        return may_alias and src.dtype == torch.float32 and src.device == self.master_device

    def _make_master(self, p: torch.Tensor, spec, pin: bool, src: Optional[torch.Tensor]) -> torch.Tensor:
        sources_given = src is not None
        src = self._source(p, spec, src)
        if self.low_precision.masters:  # bf16 + compensation; aliased to the bf16 parameter after the cast
            self._aliased.append(False)
            return self.low_precision.make_master(src, self.master_device, pin)
        alias = self._aliases(src, sources_given)
        self._aliased.append(alias)
        if alias:
            return src  # stage 0: the parameter itself (DDP); else a view of this rank's slice
        m = src.detach().to(device=self.master_device, dtype=torch.float32, copy=True)
        return m.pin_memory() if pin else m

    def alias_low_precision_masters(self, sources: Optional[list[list[torch.Tensor]]]) -> None:
        """After the module dropped to bf16: each bf16 master whose parameter slice (``sources``, stage 3: the
        unit shards' new views) is bf16 where the master lives becomes that slice (no second copy)."""
        if not self.low_precision.masters or self.states.steps_on_host:
            return
        flat = 0
        for bi, (b, row) in enumerate(zip(self.buckets, self.masters)):
            for pi, (p, spec, m) in enumerate(zip(b.params, b.specs, row)):
                src = sources[bi][pi] if sources is not None else None
                if src is not None and not self._alias_sources:
                    pass
                elif self.low_precision.alias(m, self._source(p, spec, src)):
                    self._aliased[flat] = True
                flat += 1

    def _rebind(self, by_param: dict[int, torch.Tensor]) -> None:
        if self.optimizer.state:
            raise ValueError(
                "The optimizer already holds state; ZeRO must shard it before the first step. "
                "Create the engine right after the optimizer (restore state afterwards with load_state_dict)."
            )
        # per group, the user's original parameter list as masters (None: frozen, never stepped), so a
        # consolidated checkpoint lists the same parameters as a plain optimizer's would
        self.group_layout = [[by_param.get(id(p)) for p in g["params"]] for g in self.optimizer.param_groups]
        # ... and the module's parameters themselves, for code that thinks in parameters (toggle_optimizer)
        self.group_params = [list(g["params"]) for g in self.optimizer.param_groups]
        # frozen at setup, hence without master or bucket: unfreezing one later would train nothing
        self.frozen_at_setup = [p for g in self.group_params for p in g if id(p) not in by_param]
        for group in self.optimizer.param_groups:
            group["params"] = [by_param[id(p)] for p in group["params"] if id(p) in by_param]

    @property
    def uses_fused(self) -> bool:
        return HK.uses_fused(self.optimizer)

    def kernel_note(self) -> Optional[str]:
        """What the host step runs instead of the user's kernel (the setup line says it); None if the kernel
        is the user's own."""
        return HK.kernel_note(self.optimizer) if self._swap_kernel else None

    def check_not_unfrozen(self, names) -> None:
        """One clear error instead of a parameter that silently never trains (DDP would drift instead).
        ``names()``: {id(param): name}, built only for the message."""
        thawed = [p for p in self.frozen_at_setup if p.requires_grad]
        if thawed:
            raise ValueError(
                f"Parameter '{names().get(id(thawed[0]), '?')}' (and {len(thawed) - 1} more) was frozen when ZeRO "
                "sharded the optimizer and requires a gradient now; it has no master shard, so it would never "
                "be stepped. Allowed: pass only trainable parameters to the optimizer and add the unfrozen ones "
                "with optimizer.add_param_group (what Lightning's BaseFinetuning does), or unfreeze before setup."
            )

    # -- update -------------------------------------------------------------------------------------
    def step(self, publish_chunk: Optional[Callable[[list[torch.Tensor], Bucket], None]] = None) -> None:
        """The optimizer's step on the masters, as the state store runs it: all at once, or (``states.streams``:
        NVMe) bucket by bucket through its ring, each bucket published by ``publish_chunk(masters, bucket)``
        while its masters are in memory."""
        after = (lambda k: publish_chunk(self.masters[k], self.buckets[k])) if publish_chunk is not None else None
        self.low_precision.narrow_all(self._all_masters())  # a checkpoint since the last step widened them
        if self.low_precision.active and not self.states.streams:  # bucket by bucket: fp32 one bucket at a time
            run = lambda: [self._step_bucket(k) for k in range(len(self.buckets))]  # noqa: E731
        else:
            run = lambda: self.states.step(self.optimizer, self._step_bucket, after)  # noqa: E731
        self.kind.step(self, run)

    def state_holder(self, master: torch.Tensor) -> Optional[torch.Tensor]:
        """The tensor ``optimizer.state`` keys ``master``'s parameter on here: the master itself, or (owner-rank
        step) the owner's whole master; None where another rank owns the parameter and its state."""
        return master if self.owner is None else self.owner.holder(master)

    def local_state_view(self):
        """A context in which torch's ``state_dict`` / ``load_state_dict`` of the optimizer see this rank's part
        (what the user's direct call gets; checkpoints take the engine's whole views)."""
        return self.owner.whole_groups() if self.owner is not None else contextlib.nullcontext()

    def init_state(self, masters: list[torch.Tensor]) -> None:
        """Create the optimizer state of ``masters`` that have none, as their first step would (a checkpoint
        load fills it next); the masters keep their values."""
        with self.low_precision.widened(self.optimizer, masters):  # state created in the dtype it is kept in
            self.kind.init_state(self, masters, zero_lr_step)

    def _step_bucket(self, k: int) -> None:
        """The user's optimizer on bucket ``k``'s masters only: every group keeps its hyper-parameters and
        per-parameter state; an elementwise update of a subset is that subset of the whole update."""
        mine = {id(m) for m in self.masters[k]}
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, saved):
                g["params"] = [m for m in params if id(m) in mine]
            with self.low_precision.widened(self.optimizer, self.masters[k]):
                self.optimizer.step()
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank owns, wherever they are (see bytes_by_location)."""
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return total

    def master_bytes(self) -> int:
        """Bytes of fp32 master storage *separate* from the parameters (0 when masters are views)."""
        flat = (m for row in self.masters for m in row)
        wide = self.low_precision.wide_ids()  # counted by extra_bytes (fp32 until the next step)
        own = sum(m.numel() * m.element_size() for m, a in zip(flat, self._aliased) if not a and id(m) not in wide)
        return own + self.low_precision.extra_bytes()

    def bytes_by_location(self) -> dict[Location, int]:
        """Where the masters (those separate from the parameters) and the optimizer state are now."""
        return self.states.bytes_by_location(self.master_bytes() + self.state_bytes())

    def ring_bytes(self) -> int:
        """Host bytes of the state store's ring buffers (NVMe: the bound on the states' host memory in a step)."""
        return self.states.ring_bytes
