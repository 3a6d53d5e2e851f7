"""``engine.comm_report()``: the bytes one training step put on the wire, by collective and group.

Design note
-----------
:data:`collectives.stats` counts every collective this process issues (calls, payload bytes, and the
bytes this rank sends under the ring algorithms), keyed by (op, group label). The engine marks the
counters at the end of every ``step()``; a report is the difference between the last two marks: one
step's forward, backward (all micro-batches) and optimizer step, the parameter all-gather included (it
is issued inside ``step()`` even when it overlaps the next forward). The counters are per process, so two
engines stepping in turn in one process see each other's traffic; measure one engine at a time.

``payload``: the bytes handed to the collective (all-gather: this rank's chunk; reduce-scatter and
all-to-all: the whole input; quantized collectives: the int8 blocks plus their fp32 scales). ``wire``:
what this rank sends -- the number that decides speed across nodes.

With a compressed optimizer (1-bit Adam, 0/1 Adam; engine/optim/onebit/) each step is also labelled with its phase
("warmup": gradients all-reduced in full precision; "compressed": 1-bit exchanges only) and
``phases`` accumulates steps and bytes per phase since the engine was built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from . import collectives as C


def _diff(now: dict, before: dict) -> dict:
    out = {}
    for key, row in now.items():
        prev = before.get(key, [0, 0, 0])
        delta = [a - b for a, b in zip(row, prev)]
        if delta[0]:
            out[key] = delta
    return out


@dataclass
class CommReport:
    """Per (op, group): ``calls``, ``payload`` bytes and ``wire`` bytes of one step on this rank."""

    rows: dict = field(default_factory=dict)  # (op, group label) -> [calls, payload bytes, wire bytes]
    world_size: int = 1
    phase: Optional[str] = None  # the last step's phase under a compressed optimizer, else None
    phases: dict = field(default_factory=dict)  # phase -> [steps, calls, payload bytes, wire bytes], cumulative

    def phase_table(self) -> str:
        """Bytes per step by phase (warmup vs compressed), averaged over the steps of each phase."""
        lines = ["| phase | steps | calls/step | payload B/step | wire B/step |", "|---|---:|---:|---:|---:|"]
        for name, (steps, calls, payload, wire) in self.phases.items():
            lines.append(f"| {name} | {steps} | {calls / steps:.1f} | {payload / steps:,.0f} | {wire / steps:,.0f} |")
        return "\n".join(lines)

    @property
    def calls(self) -> int:
        return sum(r[0] for r in self.rows.values())

    @property
    def payload_bytes(self) -> int:
        return sum(r[1] for r in self.rows.values())

    @property
    def wire_bytes(self) -> int:
        return sum(r[2] for r in self.rows.values())

    def by_op(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for (op, _group), r in self.rows.items():
            acc = out.setdefault(op, [0, 0, 0])
            for i in range(3):
                acc[i] += r[i]
        return out

    def table(self) -> str:
        lines = [f"| collective | group | calls | payload B | wire B (this rank, {self.world_size} ranks) |",
                 "|---|---|---:|---:|---:|"]
        for (op, group), (calls, payload, wire) in sorted(self.rows.items()):
            lines.append(f"| {op} | {group} | {calls} | {payload:,} | {wire:,} |")
        lines.append(f"| total | | {self.calls} | {self.payload_bytes:,} | {self.wire_bytes:,} |")
        if self.phases:
            lines += ["", f"last step: {self.phase}", self.phase_table()]
        return "\n".join(lines)

    __str__ = table


class StepTraffic:
    """The marks at the ends of steps; :meth:`report` is the window between the last two."""

    def __init__(self, group=None) -> None:
        self._world_size = C.world_size(group)
        self._mark = C.stats.snapshot()
        self._last: dict = {}
        self._phase: Optional[str] = None
        self._phases: dict = {}

    def step_done(self, phase: Optional[str] = None) -> None:
        now = C.stats.snapshot()
        self._last, self._mark = _diff(now, self._mark), now
        self._phase = phase
        if phase is not None:
            acc = self._phases.setdefault(phase, [0, 0, 0, 0])
            acc[0] += 1
            for i in range(3):
                acc[i + 1] += sum(r[i] for r in self._last.values())

    def report(self) -> CommReport:
        return CommReport({k: list(v) for k, v in self._last.items()}, self._world_size, self._phase,
                          {k: list(v) for k, v in self._phases.items()})
