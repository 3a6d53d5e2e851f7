"""What 1-bit Adam and 0/1 Adam share: the error buffers, the exchange over every parameter at once, the
protocol the engine reads (``uses_local_grads``) and the per-rank state a checkpoint must keep per rank.

Design note
-----------
Counters that decide the phase (steps taken, 0/1 Adam's intervals) live in the param groups, not in
``optimizer.state``: every checkpoint path (torch's ``state_dict``, the engine's sharded directories)
restores param-group entries, so a resumed run is in the same phase at the same step. The error buffers
(``worker_error``: this rank's compression loss over the whole padded tensor; ``server_error``: the loss
on the chunk this rank serves) differ per rank: :attr:`per_rank_state` names them, and the checkpoint
writes them as one row per rank (checkpoint/sharded_state.py), so resume is exact -- DeepSpeed resets them
on load. A full-format checkpoint (one plain optimizer ``state_dict``, ``checkpoint_format="full"`` or
``engine.optimizer_state_dict()``) has no place for per-rank values: it leaves them out and they restart at
zero on load, as DeepSpeed's always did. All parameters of all groups travel in one exchange (two collectives per step, not two per tensor).

[Note: elements without a gradient]
One bit cannot say "zero" nor "small": every element of a chunk is sent as ``+-scale``, the chunk's RMS, and
the error feedback only makes the *sum* over steps right. Adam then divides by ``sqrt(v_hat) + eps``. For an
element whose own gradient scale ``sqrt(v_hat)`` is far below its chunk's, each step applies
``lr * scale / (sqrt(v_hat) + eps)`` with alternating signs, and the error feedback lets the sum drift by a
few of those before it turns back: the element random-walks with steps of that size. The extreme case is
an element whose *true* gradient is zero and whose computed one is rounding noise: GPT-2's attention key bias
(softmax is shift-invariant, so ``d loss / d b_k = 0``; in fp32 its gradient is ~1e-11, ``sqrt(v_hat)``
~1e-12, against ~1e-4 for the query and value thirds sharing its tensor and chunk). Its denominator is then
``eps`` itself: ``lr * scale / eps`` per step, 1e-3 * 1e-4 / 1e-8 = 10, and the key bias reached 246 in 100
steps (bench/onebit_adam.py's GPT-2, 2 ranks, freeze at 20; AdamW: 2.4e-5; with this rule: 9.5e-6).
DeepSpeed's error feedback does nothing about it: its 1-bit Adam multiplies the averaged momentum by a
user-given ``exp_avg_mask`` and otherwise lets such elements move.

The rule here (:meth:`has_gradient`): an element takes part only if its gradient scale reaches Adam's own
noise floor, ``sqrt(v_hat) >= eps`` (and ``v > 0``, so ``eps=0`` keeps elements with any variance); the
others keep momentum 0 and stay where the full-precision phase left them. Adam itself moves such an element
by ``lr * |m_hat| / (sqrt(v_hat) + eps) < lr / 2`` a step (``|m_hat| <= sqrt(v_hat) < eps``), so this is
the bound: zero instead of under ``lr / 2`` per step, where the 1-bit step would be ``lr * scale / eps``.
Elements with a real gradient (``sqrt(v_hat) >= eps``) are untouched, so the loss is the one 1-bit Adam
gives: on GPT-2 the key bias only is left out (tests/test_onebit_key_bias.py). The variance is frozen in
the compressed phase, so the set is fixed from the freeze on; 0/1 Adam applies the same rule to its 1-bit
gradient steps and to its synchronizations, whose applied update is divided by the same denominator.

At ZeRO stage 1 (the engine binds :class:`~.sharded.ShardBinding`, [Note: 1-bit Adam at stage 1]) the params
are master *slices*: the exchange runs over the whole parameters (the worker error is whole, the server error
one chunk per tensor) and hands each rank its slice of the result.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ...comm import collectives as C
from .exchange import ChunkLayout, compressed_all_reduce, compressed_exchange, gathered_result
from .sharded import ShardBinding, WholeMomentum


class CompressedAdamBase(torch.optim.Optimizer):
    """Adam whose communication the optimizer does itself in its compressed phases (see subclasses)."""

    per_rank_state = ("worker_error", "server_error")  # state entries that differ by rank (checkpoints)

    def __init__(self, params, defaults: dict, group: Optional[Any] = None) -> None:
        lr, (b1, b2), eps = defaults["lr"], defaults["betas"], defaults["eps"]
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate {lr!r}: allowed lr >= 0.")
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"Invalid betas {defaults['betas']!r}: allowed 0 <= beta < 1.")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid eps {eps!r}: allowed eps >= 0.")
        if defaults.get("weight_decay", 0.0) < 0.0:
            raise ValueError(f"Invalid weight_decay {defaults['weight_decay']!r}: allowed >= 0.")
        super().__init__(params, defaults)
        self.process_group = group  # the data-parallel group the exchange runs over (None: the world)
        self._layout: Optional[tuple[tuple, ChunkLayout]] = None
        self.shards: Optional[ShardBinding] = None  # ZeRO stage 1: the params are master slices (sharded.py)
        self.whole_momentum = WholeMomentum()  # stage 1: the last exchange's result, kept at one bit

    def bind_shards(self, binding: Optional[ShardBinding]) -> None:
        """ZeRO stage 1 (kind.py): the params are slices of whole parameters, described by ``binding``."""
        self.shards = binding
        self._layout = None
        self.whole_momentum.invalidate()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.whole_momentum.invalidate()  # derived from the state just replaced

    def state_restored(self) -> None:
        """The state tensors were written in place (a sharded checkpoint load, checkpoint/format.py)."""
        self.whole_momentum.invalidate()

    # -- the protocol the engine reads ----------------------------------------------------------------
    def rank_local_state(self) -> tuple[str, ...]:
        """The per-element state entries whose values differ by rank *now*, together with the parameters
        (0/1 Adam's local steps, [Note: the ranks' own models] in local_models.py); empty: every rank holds
        the same parameters and these entries (1-bit Adam always; the error buffers are apart,
        :attr:`per_rank_state`)."""
        return ()

    def uses_local_grads(self) -> bool:
        """Whether the *next* step takes this rank's own (unreduced) gradients: the engine then reduces
        nothing in backward."""
        raise NotImplementedError

    def _begin_step(self, closure) -> tuple[Any, bool, list[torch.Tensor], list[dict]]:
        """The closure's loss, whether this step takes local gradients (decided before the step counts), the
        parameters and each one's param group; the step counted."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        local = self.uses_local_grads()
        for g in self.param_groups:
            g["steps"] = g.get("steps", 0) + 1
        return loss, local, self.all_params(), [g for g in self.param_groups for _ in g["params"]]

    def steps_taken(self) -> int:
        return int(self.param_groups[0].get("steps", 0)) if self.param_groups else 0

    def phase(self) -> str:
        """"warmup" (gradients all-reduced in full precision) or "compressed" (for comm_report's split)."""
        return "compressed" if self.uses_local_grads() else "warmup"

    # -- state -----------------------------------------------------------------------------------------
    def _world(self) -> int:
        return C.world_size(self.process_group)

    def all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def whole_numels(self) -> list[int]:
        """Elements of the whole parameter behind each param (stage 1: a master slice's parameter)."""
        params = self.all_params()
        return [s.numel for s in self.shards.specs(params)] if self.shards is not None else [p.numel() for p in params]

    def layout(self) -> ChunkLayout:
        params = self.all_params()
        numels = self.whole_numels()
        key = tuple((id(p), k) for p, k in zip(params, numels)) + (self._world(),)
        if self._layout is None or self._layout[0] != key:
            device = params[0].device if params else torch.device("cpu")
            self._layout = (key, ChunkLayout(numels, self._world(), device))
        return self._layout[1]

    def init_state(self, p: torch.Tensor, k: int, extra: tuple = ()) -> dict:
        """The state of parameter ``k`` (its index in :meth:`all_params`), created at its first step with
        every entry it will ever have, so the set of keys never depends on the phase (checkpoints)."""
        state = self.state[p]
        if not state:
            layout = self.layout()
            state["step"] = torch.zeros((), dtype=torch.float32)  # momentum updates (its bias correction)
            state["var_step"] = torch.zeros((), dtype=torch.float32)  # variance updates (frozen: stops)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["worker_error"] = torch.zeros(layout.padded[k], dtype=torch.float32, device=p.device)
            state["server_error"] = torch.zeros(layout.chunks[k], dtype=torch.float32, device=p.device)
            for name in extra:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def exchange(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """The error-compensated 1-bit mean of ``values`` (one tensor per parameter of :meth:`all_params`,
        each this rank's, whole) over the process group; each result has its param's shape (stage 1: the
        slice of the mean that this rank's master is). One rank: the values themselves (nothing to exchange,
        nothing compressed; DeepSpeed's rule too)."""
        params = self.all_params()
        if self._world() == 1:
            return self._mine([v.clone() for v in values])
        layout = self.layout()
        states = [self.state[p] for p in params]
        for k, st in enumerate(states):  # absent after a full-format (single optimizer state dict) load
            if st.get("worker_error") is None or st["worker_error"].numel() != layout.padded[k]:
                st["worker_error"] = torch.zeros(layout.padded[k], dtype=torch.float32, device=params[k].device)
                st["server_error"] = torch.zeros(layout.chunks[k], dtype=torch.float32, device=params[k].device)
        werr = layout.to_rows([s["worker_error"] for s in states])
        serr = torch.cat([s["server_error"] for s in states]).unsqueeze(0)
        if self.shards is None:
            out = compressed_all_reduce(layout, layout.to_rows(values), werr, serr, self.process_group)
        else:  # keep the packed result: the next step's whole momentum (sharded.py)
            rows = compressed_exchange(layout, layout.to_rows(values), werr, serr, self.process_group)
            self.whole_momentum.keep(rows, self.steps_taken())
            out = gathered_result(layout, rows)
        for s, w, e in zip(states, layout.from_rows(werr), layout.server_split(serr[0])):
            s["worker_error"].copy_(w)
            s["server_error"].copy_(e)
        return self._mine(layout.from_rows(out))

    def _mine(self, wholes: list[torch.Tensor]) -> list[torch.Tensor]:
        """The part of each parameter's whole (flat or shaped) value this rank steps: all of it, or its slice."""
        params = self.all_params()
        if self.shards is None:
            return [w.reshape(-1)[: p.numel()].view_as(p).to(p.dtype) for w, p in zip(wholes, params)]
        return [w.reshape(-1)[s.lo: s.hi].view_as(p) for w, p, s in zip(wholes, params, self.shards.specs(params))]

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's own gradient of every param (whole: stage 1 reads the parameter's, flat, not the slice's)."""
        params = self.all_params()
        if self.shards is None:
            return [self.grad_or_zero(p) for p in params]
        return [self.shards.whole_grad(p, n) for p, n in zip(params, self.whole_numels())]

    @staticmethod
    def has_gradient(g: dict, st: dict) -> torch.Tensor:
        """Which elements take part in a 1-bit step: those whose gradient scale is above Adam's ``eps`` (bool,
        the state's shape; [Note: elements without a gradient])."""
        v = st["exp_avg_sq"]
        k = float(st["var_step"])
        scale = v.sqrt()
        if g["bias_correction"] and k > 0:
            scale.div_(math.sqrt(1 - g["betas"][1] ** k))
        return (v > 0) & (scale >= g["eps"])

    @staticmethod
    def grad_or_zero(p: torch.Tensor) -> torch.Tensor:
        """A compressed exchange involves every parameter on every rank (the collectives must match): a
        parameter this rank did not use contributes a zero gradient."""
        return p.grad if p.grad is not None else torch.zeros_like(p)
