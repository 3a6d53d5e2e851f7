"""Optimizer-state stores: where one ShardedOptimizer's fp32 masters and optimizer state live, and how its step runs.

[Note: optimizer-state stores]
The :class:`~..optim.optimizer.ShardedOptimizer` never asks a knob where its masters go; it asks the store the
plan chose ([Note: placement], placement.py):

    master_device(device)   where a master is made (the compute device, or the host)
    pin_masters             each master in pinned host memory (host<->device copies overlap)
    masters_alias_params    a master may be its parameter's own fp32 slice (no separate copy)
    steps_on_host           the step runs on the CPU (torch's fused CPU kernel is swapped in, offload_kernel)
    reserve(...)            the sizes every bucket's masters + state will take, before any is made
    add_chunk(masters, in)  a bucket's masters, just made, join the store (setup, add_param_group)
    step(...)               the user's optimizer over all masters at once, or streamed bucket by bucket, each
                            bucket published as it is stepped (``streams``: the engine's publish leaves it out)
    make_resident / spill   whole views (checkpoints) read the masters and state back / give them up again
    bytes_by_location(n)    where the ``n`` bytes of masters + state are now (the memory report)
    ring_bytes, failure, checks_io, close

:class:`DeviceStates` and :class:`HostStates` are here; the NVMe file and its ring are
``nvme_states.NvmeStates``. ``make_state_store(location, config, group)`` (stores.py) builds the plan's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .location import Location


class StateStore:
    """Masters and state held in memory ([Note: optimizer-state stores]); the step is the optimizer's own."""

    location: Location = Location.DEVICE
    knob = "offload_optimizer"  # what an I/O error names
    masters_alias_params = True
    pin_masters = False
    streams = False
    checks_io = False

    def __init__(self) -> None:
        self.failure: Optional[str] = None

    @property
    def steps_on_host(self) -> bool:
        return self.location.off_device

    def master_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu") if self.steps_on_host else device

    def reserve(self, optimizer: torch.optim.Optimizer, numel: list[list[int]], in_store: list[list[bool]]) -> None:
        """``numel`` / ``in_store``: per bucket, each master's size and whether the store holds it (a stage-3
        fp32 host shard that is its own master stays where it is)."""

    def add_chunk(self, masters: list[torch.Tensor], in_store: list[bool]) -> None:
        pass

    def grads_landed(self, device: torch.device) -> None:
        """The gradients handed to the masters are readable where the step runs. A host step on a CUDA run
        waits for the device->host copies: they were queued on the reducer's side stream as buckets completed
        (which the current stream of the gradients' device waits for) or as the masters took them; that device
        need not be torch.cuda.current_device() (an engine on cuda:1 without torch.cuda.set_device(1))."""
        if self.steps_on_host and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def step(self, optimizer: torch.optim.Optimizer, step_bucket: Callable[[int], None],
             after_bucket: Optional[Callable[[int], None]]) -> None:
        """The step over every master; ``after_bucket(k)`` is for a store that streams (published there)."""
        optimizer.step()

    def make_resident(self) -> None:
        pass

    def spill(self) -> None:
        pass

    def swapped_bytes(self) -> int:
        return 0

    @property
    def ring_bytes(self) -> int:
        return 0

    def bytes_by_location(self, nbytes: int) -> dict[Location, int]:
        return {self.location: nbytes}

    def close(self) -> None:
        pass


class DeviceStates(StateStore):
    """On the compute device (``offload_optimizer=False``): an fp32 master may alias its parameter."""


class HostStates(StateStore):
    """In host memory, pinned on CUDA machines (``offload_optimizer=True`` / ``"cpu"``); the step on the CPU."""

    location = Location.HOST
    masters_alias_params = False

    def __init__(self) -> None:
        super().__init__()
        self.pin_masters = torch.cuda.is_available()


def planned_masters(buckets: list, sources: Optional[list], sliced: bool,
                    aliases: Callable[[Any, Any, Any], bool]) -> tuple[list[list[int]], list[list[bool]]]:
    """What :meth:`StateStore.reserve` is given: per bucket, each master's size (``sliced``: this rank's slice)
    and whether the store holds it -- not when ``aliases(param, spec, source)`` says the master is its source
    (a stage-3 fp32 host shard is the master itself and stays where it is)."""
    numel, held = [], []
    for bi, b in enumerate(buckets):
        numel.append([spec.shard_len if sliced else spec.numel for spec in b.specs])
        held.append([not aliases(p, spec, sources[bi][pi] if sources is not None else None)
                     for pi, (p, spec) in enumerate(zip(b.params, b.specs))])
    return numel, held
