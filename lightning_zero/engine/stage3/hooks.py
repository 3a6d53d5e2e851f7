"""Stage 3's module hooks: what runs a unit's gathers, releases and prefetches around its forward and backward.

:class:`UnitHooks` is the hook half of :class:`~.partition.ParamPartitioner` (which inherits it): the
pre-forward hook gathers the unit and, once the order is verified, prefetches the ones after it (and tells
the parameter-shard store of those after them: NVMe reads them ahead); the post-forward hook releases it and arms a pre-backward hook
on its outputs, which gathers it again and prefetches in reverse recorded order. The first training forward
records the unit order here (:meth:`_track_forward`); later ones are checked against it before any
collective. The lifecycle and its states: partition.py's design note and lifecycle.py.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ..memory.activations import in_checkpointed_forward, recomputing
from .guard import ReleasedParamGuard
from .join import RankDivergenceError
from .lifecycle import OrderCheck, OrderState, UnitState
from .units import Unit


class UnitHooks:
    """The forward / backward hooks of a :class:`~.partition.ParamPartitioner` (state and gathers live there)."""

    def _install_hooks(self) -> None:
        for u in self.units[:-1]:
            self._handles.append(u.module.register_forward_pre_hook(self._make_pre_forward(u)))
            self._handles.append(u.module.register_forward_hook(self._make_post_forward(u)))
        # root parameters are used by plain modules (and attributes) anywhere: gather on first touch
        owners = {id(m): m for m in self.module.modules() for p in m.parameters(recurse=False)
                  if self.unit_of.get(id(p)) is self.root}
        owners[id(self.module)] = self.module
        for m in owners.values():
            self._handles.append(m.register_forward_pre_hook(lambda *_: self.begin_forward()))
        self._handles.append(self.module.register_load_state_dict_pre_hook(self._refuse_load_into_released))
        self.guard = ReleasedParamGuard(self)  # modules reached around the unit hooks: gather or one clear error

    def _refuse_load_into_released(self, module, state_dict, prefix, *_args) -> None:
        """``load_state_dict`` would copy into parameters whose storage is released (a crash, or values
        lost at the next release): point to the loader that writes into the shards instead."""
        released = [n for n, p in module.named_parameters(prefix.rstrip("."))  # names carry the prefix
                    if n in state_dict and p.numel() and p.untyped_storage().nbytes() == 0]
        if released and not self._gathered_depth:
            raise RuntimeError(
                f"ZeRO-3 holds {len(released)} of these parameters only as shards (e.g. '{released[0]}'); "
                "load_state_dict cannot write into them. Use engine.load_full_state_dict(state_dict) "
                "(trainer.strategy.engine under Lightning) or fit/validate(ckpt_path=...)."
            )

    def _tracking(self, u: Unit) -> bool:
        # a checkpointed region recomputed in backward re-runs the forwards of the units inside it: not part
        # of the recorded order (activations.py)
        return (self.order_check is OrderCheck.STRICT and u.module.training and torch.is_grad_enabled()
                and not self._gathered_depth and not recomputing())

    def _make_pre_forward(self, u: Unit):
        def hook(_module, _args):
            if recomputing() and not u.gathered:  # its own pre-backward hook has not run yet: see post-forward
                self._recompute_gathered.add(u.index)
            if self._tracking(u):
                self._track_forward(u)
            self.gather(u)
            if self._tracking(u) and self.order_state is OrderState.VERIFIED:
                self._prefetch_next(self._order[self._pos:])

        return hook

    def _track_forward(self, u: Unit) -> None:
        if self.order_state is OrderState.RECORDING:
            self._order.append(u.index)
            return
        expected = self._order[self._pos] if self._pos < len(self._order) else None
        if expected != u.index:
            raise RankDivergenceError(
                f"rank {self.rank}: ZeRO-3 unit '{u.name}' ran where the recorded order has "
                f"'{self.units[expected].name if expected is not None else '<end of forward>'}' "
                f"(position {self._pos}). Forward order must be the same every step and on every rank; "
                "wrap generation or other data-dependent control flow in strategy.gathered_params()."
            )
        self._pos += 1

    def _make_post_forward(self, u: Unit):
        def hook(_module, _args, output):
            if recomputing():
                # a region holding several units is recomputed at its first backward node: a unit whose own
                # pre-backward hook is still to come is released (that hook gathers it again); one that hook has
                # gathered already stays for its backward. No hooks: the recomputed graph is discarded.
                if u.index in self._recompute_gathered:
                    self._recompute_gathered.discard(u.index)
                    self.release(u)
                return output
            if not self._keeps_for_backward(u) or (self.reshard_after_forward and not self._backward_starts_at(u)):
                self.release(u)
            if torch.is_grad_enabled() and not self._gathered_depth:
                tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda _grads: self._pre_backward(u), mode="any"
                    )
            return output

        return hook

    def _backward_starts_at(self, u: Unit) -> bool:
        """Whether ``u`` ran last in a verified training forward: its backward comes first, so releasing it
        now would only gather it again right after the loss ([Note: the last unit stays gathered])."""
        return (self.order_state is OrderState.VERIFIED and self._pos == len(self._order)
                and self._order[-1] == u.index and not in_checkpointed_forward())

    def _keeps_for_backward(self, u: Unit) -> bool:
        """``reshard_after_forward=False``: a training forward that autograd will differentiate keeps its
        unit gathered; the backward releaser (or the end of backward) releases it."""
        return u.module.training and torch.is_grad_enabled() and not self._gathered_depth

    def _pre_backward(self, u: Unit) -> None:
        if self.on_backward is not None:
            self.on_backward()
        self.gather(u)  # a no-op for a unit kept since its forward
        if self.order_state is OrderState.VERIFIED and (self.prefetch or self.store.read_ahead_depth) \
                and u.index in self._order:
            i = len(self._order) - 1 - self._order[::-1].index(u.index)
            self._prefetch_next(self._order[:i][::-1])

    def begin_forward(self) -> None:
        """Before a step's forward: the root, and in a verified training forward the first units' gathers
        issued behind it, so they travel while the root's wait and the compute before the first unit run."""
        self._launch_gather(self.root)
        if self._tracking(self.root) and self.order_state is OrderState.VERIFIED and self._pos == 0:
            self._prefetch_next(self._order)
        self._finish_gather(self.root)

    def _prefetch_next(self, upcoming: list[int]) -> None:
        """``upcoming``: the recorded order from the next unit on (forward, or reversed for backward): the
        first ``prefetch`` units are gathered ahead; the store is told of the ``read_ahead_depth`` after them
        (NVMe: their shards read ahead, as far as the ring has free slots)."""
        for k in upcoming[: self.prefetch]:
            self._prefetch(self.units[k])
        for k in upcoming[self.prefetch : self.prefetch + self.store.read_ahead_depth]:
            self.store.read_ahead(self.units[k])

    def _prefetch(self, u: Unit) -> None:
        if u.state is UnitState.SHARDED and u.params:
            self.prefetches += 1
            self._launch_gather(u)

    def remove_hooks(self) -> None:
        self.guard.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()
