"""What a rank really holds: tensor bytes counted by kind (``ZeroEngine.memory_report()``), no allocator guesses,
so tests compare them exactly with the floors of memory.py."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..layout.tensor_parallel import local
from ..placement.location import Location


def measure_model_states(params, shardeds, reducer=None, partitioner=None, frozen=()) -> "MemoryReport":
    """The tensor bytes one rank holds now: ``params`` (managed parameters) and ``frozen`` (the module's
    parameters no optimizer manages: LoRA's base, whole and replicated on every rank at stages 0-2, like
    DDP's), the ShardedOptimizers' masters and state, the reducer's gradient shards, stage 3's unit shards
    (frozen parameters are partitioned like the others) and gathered units. Where the masters, the state and
    the unit shards are (host, NVMe) is their stores' answer ([Note: placement])."""
    def nbytes(ts):  # a DTensor (tensor parallel) counts its local piece: what this rank holds
        return sum(local(t).numel() * t.element_size() for t in ts if t is not None)

    part = partitioner
    r = MemoryReport(
        params=part.shard_bytes() + part.gathered_bytes() if part is not None else nbytes(params) + nbytes(frozen),
        grads=nbytes(p.grad for p in params),
        # hybrid sharding under accumulation: the replicas' un-synced sums are gradient shards too
        grad_shards=nbytes(reducer.grad_shards) + nbytes(reducer.unreplicated_shards) if reducer is not None else 0,
        master=sum(s.master_bytes() for s in shardeds),
        optimizer_state=sum(s.state_bytes() for s in shardeds),
        owner_step=sum(s.owner.step_bytes() for s in shardeds if s.owner is not None),
    )
    stores = [s.bytes_by_location() for s in shardeds]
    stores += [part.store.bytes_by_location()] if part is not None else []
    r.host = sum(b.get(Location.HOST, 0) for b in stores)
    r.nvme = sum(b.get(Location.NVME, 0) for b in stores)  # only in the scratch files now: on disk, not in memory
    r.ring = sum(s.ring_bytes() for s in shardeds) + (part.store.ring_bytes if part is not None else 0)
    return r


@dataclass
class MemoryReport:
    """Tensor bytes one rank holds right now, by kind."""

    params: int = 0  # every parameter (frozen too) as this rank holds it (full, or shards in stage 3)
    grads: int = 0  # full-size gradients in ``param.grad``
    grad_shards: int = 0  # reduced gradient shards (stages 1-3)
    master: int = 0  # fp32 master copies that do not alias the parameters
    optimizer_state: int = 0  # tensors in optimizer.state
    host: int = 0  # bytes of the above that live in CPU memory while compute is on an accelerator
    nvme: int = 0  # bytes of the above only in NVMe scratch files now (offload_optimizer="nvme")
    ring: int = 0  # host buffers the NVMe step streams those through (not model states: the bound on them)
    comm_buffers: int = 0  # flat collective buffers held now (buffer_pool.py: none between a backward and a step; not model states)
    # a whole-tensor optimizer's owner-rank step: the most it allocates inside a step (its owned parameters'
    # whole masters and gradients, one bucket's buffers), freed before the step returns ([Note: owner-rank step])
    owner_step: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.grad_shards + self.master + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["model_states"] = self.model_states
        return d
