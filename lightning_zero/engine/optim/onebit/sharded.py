"""1-bit Adam at ZeRO stage 1: momentum, frozen variance and fp32 masters sharded 1/N, the compressed phase a
compressed reduce-scatter and two all-gathers.

[Note: 1-bit Adam at stage 1]
In the compressed phase each worker forms its *own* momentum over the whole tensor, ``b1 * m + (1 - b1) * g_r``,
from the averaged momentum ``m`` of the last exchange and its own whole gradient ``g_r`` (stage 1 keeps whole
gradients until the step; the engine reduces none in this phase). A step is then:

1. compressed reduce-scatter: each worker's error-compensated 1-bit rows go to their server (one all-to-all,
   exchange.py); the server averages them, adds its server error and compresses its chunk again;
2. all-gather of the servers' *compressed* rows: every rank now holds the whole averaged momentum at one bit
   per element (plus a scale per chunk) -- which it needs for its next local momentum;
3. each owner updates its master shard with its slice of that momentum over its slice of the frozen variance;
4. the engine's ordinary stage-1 publish: an all-gather of the updated parameters.

Why both all-gathers: the update divides by the frozen variance elementwise, so only a rank holding the
variance of an element can apply it. Applying the compressed momentum everywhere would need the whole
variance (and, in mixed precision, whole fp32 masters) on every rank -- stage 0's memory. Gathering the
updated parameters instead keeps the state sharded; the compressed all-gather (1/32 of fp32) is still needed
because the next local momentum needs the whole averaged one. Bytes per element after warmup: about
``(N-1)/N * (2/8 + 4)`` in fp32, ``(N-1)/N * (2/8 + 2)`` in bf16, against DDP's ``2 (N-1)/N * 4``: about
1/2 and 1/4 of DDP (1-bit Adam at stage 0: 1/32). Measured: docs/benchmarks.md.

What each rank holds beyond stage 1's AdamW state: its whole worker error (fp32, as at stage 0), its
server error (one chunk per tensor), and the whole averaged momentum as the gathered packed rows plus a
1-bit mask of the elements with a gradient ([Note: elements without a gradient], base.py; both 1/32 of an
fp32 copy). The server chunks follow the exchange's own layout (``ChunkLayout``, padded to ``8 N``), not the
masters' ``ShardSpec`` slices: the compressed result reaches every rank whole, so an owner reads its slice
from it and the two layouts need not meet.

The whole momentum is *derived* state: at the first compressed step (it is then AdamW's fp32 momentum) and
after a checkpoint load it is rebuilt from the owners' fp32 momentum shards by one uncompressed all-gather
(with the variance mask). An owner's shard is exactly its slice of the masked decompressed result, so the
rebuilt value equals the kept one bit for bit: resume is exact without saving it. Every step is the same
arithmetic as stage 0's, elementwise on slices, so stage 1 equals stage 0 bit for bit (tests/test_onebit_zero1.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...comm import collectives as C
from .compress import pack_bits, unpack_bits
from .exchange import ChunkLayout, gathered_result


class ShardBinding:
    """What the engine tells a compressed optimizer at stage 1 (its kind's ``bind``, kind.py): per master the parameter
    it is a slice of and its ``ShardSpec``, and this step's whole local gradients (engine/optim/optimizer.py
    ``whole_grads``, set when the engine reduced nothing: kinds/communicating.py)."""

    def __init__(self, sharded: Any) -> None:
        self.sharded = sharded  # the engine's ShardedOptimizer over this optimizer
        self._by_master: dict[int, Any] = {}

    def specs(self, masters: list[torch.Tensor]) -> list[Any]:
        if any(id(m) not in self._by_master for m in masters):  # built once (again after add_param_group)
            self._by_master = {id(m): spec for row, b in zip(self.sharded.masters, self.sharded.buckets)
                               for m, spec in zip(row, b.specs)}
        return [self._by_master[id(m)] for m in masters]

    def whole_grad(self, master: torch.Tensor, numel: int) -> torch.Tensor:
        """This rank's whole fp32 gradient of the parameter ``master`` is a slice of, flat (zeros if unused)."""
        g = self.sharded.whole_grads.get(id(master))
        return g.view(-1) if g is not None else torch.zeros(numel, dtype=torch.float32, device=master.device)


class WholeMomentum:
    """The whole averaged momentum every worker needs (see the note): the last exchange's gathered packed rows
    and the packed variance mask, or nothing (then :meth:`whole` rebuilds it by one all-gather)."""

    def __init__(self) -> None:
        self.rows: Optional[torch.Tensor] = None  # [N, row_bytes] uint8: the last exchange's result
        self.mask: Optional[torch.Tensor] = None  # packed bits: which elements have a variance (frozen)
        self.at_step = -1  # the optimizer step count ``rows`` belongs to

    def invalidate(self) -> None:
        """After a state load: the kept rows and mask describe the state before it."""
        self.rows, self.mask, self.at_step = None, None, -1

    def keep(self, rows: torch.Tensor, step: int) -> None:
        self.rows, self.at_step = rows, step

    def nbytes(self) -> int:
        return sum(t.numel() for t in (self.rows, self.mask) if t is not None)

    def whole(self, layout: ChunkLayout, states: list[dict], specs: list[Any], step: int,
              group: Optional[Any], takes_part: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per parameter, the whole momentum (flat fp32, new tensors): stage 0's ``exp_avg`` before the step.
        ``takes_part``: this rank's slice of the elements with a gradient ([Note: elements without a
        gradient], base.py), the mask the kept result is multiplied by."""
        numels = [s.numel for s in specs]
        if self.rows is None or self.at_step != step or self.mask is None:
            m, has_var = gather_whole([[st["exp_avg"] for st in states],
                                       [t.float() for t in takes_part]], specs, group)
            flags = torch.cat([v > 0 for v in has_var])
            pad = -flags.numel() % 8
            self.mask = pack_bits(torch.cat([flags, flags.new_zeros(pad)]) if pad else flags)
            self.rows = None
            return m
        flats = layout.from_rows(gathered_result(layout, self.rows))
        masks = unpack_bits(self.mask)[: sum(numels)].split(numels)
        return [f[:n].mul_(mk) for f, n, mk in zip(flats, numels, masks)]


def gather_whole(fields: list[list[torch.Tensor]], specs: list[Any], group: Optional[Any]) -> list[list[torch.Tensor]]:
    """Whole flat tensors from every rank's slices: ``fields[f][k]`` is this rank's slice of field ``f`` of
    parameter ``k`` (``specs[k]``); one all-gather for all of them (rank-major rows, padded to ``shard_numel``)."""
    n = C.world_size(group)
    nf = len(fields)
    device = fields[0][0].device if fields and fields[0] else torch.device("cpu")
    parts = []
    for k, spec in enumerate(specs):
        block = torch.zeros(nf, spec.shard_numel, dtype=torch.float32, device=device)
        for f in range(nf):
            block[f, : spec.shard_len].copy_(fields[f][k].reshape(-1))
        parts.append(block.view(-1))
    send = torch.cat(parts) if parts else torch.zeros(0, device=device)
    out = torch.empty(n, send.numel(), dtype=torch.float32, device=device)
    C.all_gather(out, send, group=group)
    result: list[list[torch.Tensor]] = [[] for _ in range(nf)]
    off = 0
    for spec in specs:
        block = out[:, off: off + nf * spec.shard_numel].reshape(n, nf, spec.shard_numel)
        for f in range(nf):
            result[f].append(block[:, f].reshape(-1)[: spec.numel].clone())
        off += nf * spec.shard_numel
    return result
