"""When a stage-3 unit's backward is over, so that its gathered parameters can be released.

Design note
-----------
A unit is gathered again for its backward and should be released as soon as no backward node can read
its parameters any more -- otherwise every unit stays gathered until the end of backward and stage 3
holds the whole model at its peak.

* A unit whose parameters are all in its gradient bucket is done when the bucket is complete: every
  node that saved one of its parameters also produced a gradient for one of them.
* A unit that also holds parameters outside the bucket (frozen, or not in the optimizer: the LoRA shape)
  is not: a frozen weight is read by the node that computes the gradient of the unit's *input*
  (``grad_x = grad_y @ W``), which can run after the trainable gradients are complete. Such a unit is
  done when its bucket is complete **and** the gradients w.r.t. every tensor that entered its forward
  (positional and keyword arguments) are computed: any node that saved a parameter of the unit feeds a
  gradient either to one of the unit's trainable parameters or to one of its inputs, so both events
  come after it. A forward whose inputs need no gradient leaves the unit to ``end_of_backward``.
* A unit with no trainable parameter at all (a frozen encoder under a trainable embedding) has no bucket;
  it is gathered for its backward only to pass gradients through, and done when its inputs' gradients
  are computed.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from ..memory.activations import recomputing


class BackwardReleaser:
    """Calls ``release(unit)`` as soon as a unit's backward is over.

    A unit may own several gradient buckets (one per optimizer holding its parameters, or added later by
    ``add_param_group``): it is done when all of them are complete. ``frozen_units`` have none.
    """

    def __init__(self, buckets, bucket_units, release: Callable, frozen_units=()) -> None:
        self.release = release
        self.units: list = []
        self._entry: dict[int, int] = {}  # id(unit) -> position in self.units
        self._bucket_entry: list[int] = []  # bucket index -> position of its unit
        self._n_buckets: list[int] = []
        self._bucketed: list[int] = []  # parameters of the unit that are in one of its buckets
        for b, u in zip(buckets, bucket_units):
            self._count_bucket(b, u)
        for u in frozen_units:
            self._entry_of(u)
        # units with parameters outside their buckets (or no bucket) must also wait for their inputs' gradients
        self.watch = [n < len(u.params) for n, u in zip(self._bucketed, self.units)]
        self._handles = [
            u.module.register_forward_pre_hook(functools.partial(self._on_forward, i), with_kwargs=True)
            for i, u in enumerate(self.units) if self.watch[i]
        ]
        self.reset()

    @classmethod
    def for_units(cls, units, buckets, bucket_units, release: Callable) -> "BackwardReleaser":
        """The releaser of a partitioned model: units without a gradient bucket (no trainable parameter)
        are watched through their inputs; persistent units are never released in backward."""
        with_bucket = {id(u) for u in bucket_units}
        frozen = [u for u in units if id(u) not in with_bucket and u.params and not u.persistent]
        return cls(buckets, bucket_units, release, frozen)

    def _entry_of(self, u) -> int:
        if id(u) not in self._entry:
            self._entry[id(u)] = len(self.units)
            self.units.append(u)
            self._n_buckets.append(0)
            self._bucketed.append(0)
        return self._entry[id(u)]

    def _count_bucket(self, b, u) -> None:
        i = self._entry_of(u)
        self._bucket_entry.append(i)
        self._n_buckets[i] += 1
        self._bucketed[i] += len(b.params)

    def add_bucket(self, b, u) -> None:
        """A bucket of parameters added to an optimizer after setup. Such parameters were outside every
        bucket until now, so their unit is already watched (or persistent); it stays watched, which is
        conservative (release waits for the input gradients too) and never early."""
        i = self._entry_of(u)
        if i == len(self.watch):  # a persistent unit seen for the first time: release() keeps it anyway
            self.watch.append(False)
            self._pending_inputs.append(0)
            self._blind.append(False)
            self._remaining.append(0)
        self._count_bucket(b, u)
        self._remaining[i] += 1

    def reset(self) -> None:
        """At the end of backward: the next forward starts counting again."""
        n = len(self.units)
        self._remaining = list(self._n_buckets)  # buckets of the unit not complete yet in this backward
        self._pending_inputs = [0] * n  # forwards of this unit whose input gradients are not computed yet
        self._blind = [False] * n  # a forward had no input needing a gradient: wait for end of backward

    def _on_forward(self, i: int, module, args, kwargs) -> None:
        # eval mode is no reason to skip: autograd differentiates an eval-mode forward all the same (HF's
        # from_pretrained returns its model in eval mode, and Lightning keeps a submodule's mode), and a unit
        # released before its frozen weights computed its input's gradient would be read empty
        if not torch.is_grad_enabled() or recomputing():  # a recompute's graph is discarded
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t) and t.requires_grad]
        if not inputs:
            self._blind[i] = True
            return
        self._pending_inputs[i] += 1
        torch.autograd.graph.register_multi_grad_hook(inputs, functools.partial(self._on_input_grads, i), mode="all")

    def _on_input_grads(self, i: int, _grads) -> None:
        self._pending_inputs[i] -= 1
        self._maybe_release(i)

    def bucket_complete(self, bi: int) -> None:
        i = self._bucket_entry[bi]
        self._remaining[i] -= 1
        self._maybe_release(i)

    def _maybe_release(self, i: int) -> None:
        if self._remaining[i] == 0 and (not self.watch[i] or (self._pending_inputs[i] == 0 and not self._blind[i])):
            self.release(self.units[i])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
