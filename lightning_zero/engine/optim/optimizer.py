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
elementwise one steps the master shards at any stage; whole-tensor ones are refused above stage 0; a
communicating one (the 1-bit family) takes its gradients through its kind. The gradient side (what the
masters' ``.grad`` are, norms, clipping) is master_grads.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ..layout import tensor_parallel as TP
from ..grads.buckets import Bucket
from ..placement.nvme_states import NvmeStates
from .optimizer_routes import user_class
from .optimizer_state import consolidate_optimizer_state, load_sharded_optimizer_state
from ..plan import ShardingPlan
from .kinds import OptimizerKind, kind_of
from .master_grads import MasterGrads

# torch's fused implementations run on the CPU: the offloaded step swaps them in (offload_kernel="fused").
# They are not bit-identical to the default (for-loop) kernel DDP runs: about 1 ulp per step, which Adam's
# normalization turns into a full +-lr update where the true gradient is zero (a bias whose gradient
# cancels); offload_kernel="user" keeps the user's kernel for DDP-exact runs.
_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


class ShardedOptimizer(MasterGrads):
    """Owns the master shards of the managed parameters and steps the user's optimizer on them."""

    def full_state_dict(self, group=None) -> dict:
        """The full (unsharded) optimizer state on rank 0 of ``group``, as a plain optimizer saves it."""
        self.make_resident()
        return consolidate_optimizer_state(self, group)

    def load_full_state_dict(self, full: dict) -> None:
        """Re-slice a full optimizer state (any world size or stage) into this rank's shards."""
        self.make_resident()
        load_sharded_optimizer_state(self, full)

    def make_resident(self) -> None:
        """NVMe offload: masters and state back in host memory until the next step (whole views)."""
        if self.nvme is not None:
            self.nvme.make_resident()

    def close(self) -> None:
        """End of the engine: the NVMe scratch file removed (no-op otherwise)."""
        if self.nvme is not None:
            self.nvme.close()

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buckets: list[Bucket],
        plan: ShardingPlan,
        offload: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
        sources: Optional[list[list[torch.Tensor]]] = None,
        fused_on_cpu: bool = True,
        tp_group: Optional[object] = None,
        tp_size: int = 1,
        nvme: Optional[dict] = None,
        alias_sources: bool = True,
        source_scope: Optional[Callable] = None,
        kind: Optional[OptimizerKind] = None,
    ) -> None:
        """``sources`` (stage 3): per bucket and parameter, this rank's fp32 slice to take the master from
        (the parameter itself no longer holds its values then). ``plan`` ([Note: sharding plan]): whole or
        sliced masters, and ``separate_masters`` (never alias a parameter whose gathered copy is rounded:
        quantized publish). ``fused_on_cpu``: an offloaded step
        swaps in torch's fused CPU kernel (``ZeroConfig.offload_kernel="fused"``); False keeps the user's.
        ``nvme`` (``offload_optimizer="nvme"``): dict(directory, rank, buffer_count): the offloaded masters and
        state live in a scratch file there between steps and the step streams them (nvme_states.py).
        ``alias_sources=False`` (``offload_params="nvme"``): a master never aliases its stage-3 source, whose
        storage is empty whenever the unit shard is on disk; the masters are separate fp32 tensors.
        ``source_scope(bucket)``: a context in which that bucket's ``sources`` can be read (NVMe: its unit's
        shard read back for the block, so setup holds one unit's shard at a time). ``kind``: how the optimizer
        steps (kinds/, checked by the builder before anything is sharded; default: asked here)."""
        self._source_scope = source_scope
        self.kind = kind if kind is not None else kind_of(optimizer)
        self.optimizer = optimizer
        self.plan = plan
        self.offload = offload
        self._swap_kernel = offload and fused_on_cpu
        # a master may alias its parameter only if the parameter stays fp32 on the compute device
        self._compute_fp32 = compute_dtype in (None, torch.float32)  # else the shards are cast later
        self._alias_sources = alias_sources
        self._may_alias = self._compute_fp32 and not offload and not plan.separate_masters and alias_sources
        params = [p for b in buckets for p in b.params]
        device = params[0].device if params else torch.device("cpu")
        self.device = device  # where the gradients are reduced (the compute device)
        self.master_device = torch.device("cpu") if offload else device
        pin = offload and torch.cuda.is_available()
        self._pin = pin and nvme is None  # NVMe: the ring's slots are pinned, not every master
        self.nvme: Optional[NvmeStates] = None
        self.masters: list[list[torch.Tensor]] = []  # per bucket of self.buckets
        self._aliased: list[bool] = []  # a master aliasing its source costs no extra bytes
        self.buckets: list[Bucket] = []  # this optimizer's buckets (a bucket never spans two optimizers)
        # tensor parallelism (engine/layout/tensor_parallel.py): the TP group the squares are also summed over, and
        # what each parameter's squares count for there (1/T for one every TP rank holds whole)
        self.tp_group, self.tp_size = tp_group, tp_size
        if nvme is not None:
            self.nvme = self._nvme_states(nvme, buckets, sources, pin)
        self._rebind(self._add_masters(buckets, sources))
        if self._swap_kernel:
            self._use_fused_cpu_kernels()
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
            if self.nvme is not None:  # into the file now: setup holds one bucket's masters at a time
                self.nvme.add_chunk(row, [not a for a in self._aliased[-len(row):]])
        return by_param

    def _nvme_states(self, nvme: dict, buckets: list[Bucket], sources, pin: bool) -> NvmeStates:
        """The scratch file, its free space checked for every bucket's masters + state before any is written."""
        numel, swap = [], []
        for bi, b in enumerate(buckets):
            numel.append([spec.shard_len if self.plan.shards_optimizer_state else spec.numel for spec in b.specs])
            # a stage-3 host fp32 shard is the master itself (offload_params): it stays where it is
            swap.append([not (sources is not None and self._alias_sources and self._compute_fp32
                              and sources[bi][pi].dtype == torch.float32
                              and sources[bi][pi].device.type == "cpu") for pi in range(len(b.params))])
        return NvmeStates(self.optimizer, nvme["directory"], nvme["rank"], nvme["buffer_count"], pin, numel, swap,
                          nvme.get("direct", False), nvme.get("group"))

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
            self._use_fused_cpu_kernels()

    def _make_master(self, p: torch.Tensor, spec, pin: bool, src: Optional[torch.Tensor]) -> torch.Tensor:
        sources_given = src is not None
        if src is None:
            src = TP.local_data(p).view(-1)[spec.lo : spec.hi] if self.plan.shards_optimizer_state else TP.local(p)
        # stage 3 sources are this rank's unit shards: an fp32 shard already where the master must live
        # (host memory with offload_params) is the master; no second copy
        may_alias = self._may_alias or (sources_given and self.offload and self._compute_fp32 and self._alias_sources)
        alias = may_alias and src.dtype == torch.float32 and src.device == self.master_device
        self._aliased.append(alias)
        if alias:
            return src  # stage 0: the parameter itself (DDP); else a view of this rank's slice
        m = src.detach().to(device=self.master_device, dtype=torch.float32, copy=True)
        return m.pin_memory() if pin else m

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

    def _use_fused_cpu_kernels(self) -> None:
        if not isinstance(self.optimizer, _FUSED_ON_CPU):
            for group in self.optimizer.param_groups:
                if "foreach" in group and group.get("foreach") is None:
                    group["foreach"] = True
            return
        for group in self.optimizer.param_groups:
            if group.get("differentiable") or group.get("capturable"):
                continue
            group["fused"], group["foreach"] = True, False
        self.optimizer.defaults.update(fused=True, foreach=False)

    @property
    def uses_fused(self) -> bool:
        return all(g.get("fused") for g in self.optimizer.param_groups)

    def kernel_note(self) -> Optional[str]:
        """What the offloaded step runs instead of the user's kernel (the setup line says it); None if the
        kernel is the user's own."""
        if not self._swap_kernel:
            return None
        name = type(self.optimizer).__name__
        if self.uses_fused:
            return f"{name} steps with torch's fused CPU kernel (fused=True)"
        if any(g.get("foreach") for g in self.optimizer.param_groups):
            return f"{name} steps with torch's foreach kernel (foreach=True)"
        return None

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
        """The optimizer's step on the masters. NVMe offload: bucket by bucket through the ring, each bucket
        published by ``publish_chunk(masters, bucket)`` while its masters are in memory."""
        if self.nvme is None:
            self.optimizer.step()
            return
        after = (lambda k: publish_chunk(self.masters[k], self.buckets[k])) if publish_chunk is not None else None
        self.nvme.stream(self._step_bucket, after)

    def _step_bucket(self, k: int) -> None:
        """The user's optimizer on bucket ``k``'s masters only: every group keeps its hyper-parameters and
        per-parameter state; an elementwise update of a subset is that subset of the whole update."""
        mine = {id(m) for m in self.masters[k]}
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, saved):
                g["params"] = [m for m in params if id(m) in mine]
            self.optimizer.step()
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank owns (NVMe offload: wherever they are; see nvme_bytes)."""
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return total

    def master_bytes(self) -> int:
        """Bytes of fp32 master storage *separate* from the parameters (0 when masters are views)."""
        flat = (m for row in self.masters for m in row)
        return sum(m.numel() * m.element_size() for m, a in zip(flat, self._aliased) if not a)

    def nvme_bytes(self) -> int:
        """Bytes of masters and state now only in the NVMe scratch file (0 without NVMe offload)."""
        return self.nvme.swapped_bytes() if self.nvme is not None else 0

    def ring_bytes(self) -> int:
        """Host bytes of the NVMe ring buffers (the bound on the states' host memory during a step)."""
        return self.nvme.ring_bytes if self.nvme is not None else 0


def kernel_swap_line(shardeds: list["ShardedOptimizer"]) -> Optional[str]:
    """The setup line of an offloaded engine whose step does not run the user's own kernel."""
    notes = [n for n in (s.kernel_note() for s in shardeds) if n is not None]
    if not notes:
        return None
    return (f"offload_optimizer: {'; '.join(notes)} instead of the default kernel DDP runs: faster on the "
            "CPU, but not bit-identical to DDP (about 1 ulp per step; Adam turns that into +-lr where the true "
            "gradient is zero). offload_kernel='user' keeps your optimizer's own kernel (DDP-exact).")
