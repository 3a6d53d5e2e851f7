"""The states of stage 3, named: a unit's parameters and the recorded forward order.

[Note: unit lifecycle]
----------------------
A unit is always in one of three states, and only these moves exist::

    SHARDED ──launch all-gather──▶ GATHERING ──wait + copy-out──▶ UNSHARDED ──resize storage to 0──▶ SHARDED

* SHARDED: each parameter's storage is empty; this rank holds only ``unit.shard`` (its flat slice).
* GATHERING: an all-gather of the shards is in flight (``unit.inflight`` = (work, output buffer, whether that
  buffer is its own: with one rank it is the shard itself));
  parameters are still empty. A prefetch leaves a unit here until its own pre-forward/pre-backward hook
  (or ``end_of_backward``) waits for it.
* UNSHARDED: every parameter has its full storage, written through ``param.data`` so autograd's
  version counters do not move and tensors saved for backward stay valid across a release/re-gather.

Persistent units (the root, tiny units) skip the UNSHARDED → SHARDED move until the step is over;
``gathered()`` blocks every release while it is held. Every move goes through :meth:`UnitState.check`
so an impossible one (waiting on a gather never launched, releasing mid-gather) fails at once instead
of corrupting storage. FSDP2 names the same states ``ShardedState`` / ``TrainingState``.

[Note: order recording]
-----------------------
``RECORDING`` (first training forward: unit indices appended, every gather announced to the other
ranks) → ``RECORDED`` (end of that backward: the order is fixed, later forwards are checked against it
locally) → ``VERIFIED`` (after the first step: the order's digest agreed on every rank; now it drives
prefetch and gathers are no longer announced in training). How much of this runs is ``OrderCheck``
(``ZeroConfig.order_check``): STRICT all of it, ALWAYS announces every gather and never trusts an order
(so never prefetches), OFF neither records nor announces.

[Note: the last unit stays gathered]
------------------------------------
With a verified order two gathers of a training step are known before they are asked for, and
``reshard_after_forward=True`` would otherwise expose both on the critical path:

* the first units': the root is gathered at the forward's start (``begin_forward``, from the engine's
  ``prepare_forward`` or the root's own pre-forward hook) and the first ``prefetch`` units' all-gathers are
  issued behind it, so they travel during the root's wait and the compute before the first unit (the
  embedding) instead of after it;
* the last unit's: its backward comes first, right after the loss, so releasing it after its forward only
  makes backward start with a blocking all-gather of it. It stays UNSHARDED (FSDP2 users get the same by
  setting ``reshard_after_forward=False`` on the last block, as torchtitan does); the gradient reducer
  releases it after its backward like any other. Peak gathered bytes do not grow: backward would hold it
  and prefetch the next one at the same moment anyway. Not inside a checkpointed region's first forward:
  the region's recompute gathers its units again before their backward, and a kept one would be held
  through the whole recompute.

Values are the same either way (the shards do not change between forward and backward).
"""

from __future__ import annotations

import enum

from ..config import OrderCheck  # noqa: F401  (the knob's values; stage 3 reads them)


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"

    def check(self, to: "UnitState", name: str) -> "UnitState":
        """The one place unit moves are allowed or refused ([Note: unit lifecycle])."""
        if to is not _NEXT_UNIT[self]:
            raise RuntimeError(f"ZeRO-3 unit '{name}': no move from {self.name} to {to.name} "
                               f"(allowed: {self.name} -> {_NEXT_UNIT[self].name}).")
        return to


_NEXT_UNIT = {UnitState.SHARDED: UnitState.GATHERING, UnitState.GATHERING: UnitState.UNSHARDED,
              UnitState.UNSHARDED: UnitState.SHARDED}


class OrderState(enum.Enum):
    RECORDING = "recording"
    RECORDED = "recorded"
    VERIFIED = "verified"

    def check(self, to: "OrderState") -> "OrderState":
        """The one place order moves are allowed ([Note: order recording]); staying put is allowed."""
        if to is not self and to not in _NEXT_ORDER[self]:
            raise RuntimeError(f"ZeRO-3 forward order: no move from {self.name} to {to.name}.")
        return to


_NEXT_ORDER = {OrderState.RECORDING: {OrderState.RECORDED}, OrderState.RECORDED: {OrderState.VERIFIED},
               OrderState.VERIFIED: set()}
