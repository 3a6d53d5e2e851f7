"""Optimizer states below fp32: bf16 moments and bf16 masters with a Kahan compensation term.

[Note: low-precision optimizer states]
Two knobs (``ZeroConfig.optimizer_state_dtype`` / ``master_dtype``), each "fp32" or "bf16", change what a
:class:`~.optimizer.ShardedOptimizer` keeps *between* steps; the user's optimizer never sees them:

* **Moments** (every floating state tensor shaped like its master: Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's
  ``momentum_buffer``): bf16 between steps. Each bucket's step widens them to fp32, runs the user's optimizer on
  that bucket (its kernel, its hyper-parameters, its ``step`` counters) and rounds them back to nearest, into the
  same bf16 tensors (an NVMe ring's binding of them survives).
* **Masters**: the master *is* a bf16 tensor ``hi`` (the module's own bf16 parameter slice or stage-3 unit shard
  when the states live with it: no second copy), and a bf16 compensation ``lo`` keeps what rounding dropped:
  the step runs on ``x = hi + lo`` in fp32 and splits the result again, ``hi = bf16(x)`` (to nearest),
  ``lo = bf16(x - hi)`` (toward zero: :func:`residual` says why).
  This is Kahan's compensated summation with the compensation stored (``-lo`` is Kahan's ``c``): an update far
  below a bf16 ulp accumulates in ``lo`` until it moves ``hi``, so the master holds 16 significant bits and loses
  nothing a plain bf16 master would round away. The gradients stay fp32 (``grad_dtype``): the masters' ``.grad``
  is the fp32 reduced shard, so norms and clipping are the fp32 ones.

Why compensation and not stochastic rounding: both keep small updates on average; compensation keeps them
deterministically, so a run is bit-for-bit reproducible at any world size and after resharding a checkpoint
(stochastic rounding needs random bits keyed by each element's global index and the step to be
layout-independent, and its error grows like a random walk with the number of steps). Its price is 2 bytes per
element, which aliasing ``hi`` to the bf16 parameter pays back: mixed-precision Adam at stage 3 keeps
2 (param = hi) + 2 (lo) + 4 (moments) + the gradient per element, against 2 + 4 + 8 + the gradient in fp32.

Lifecycle (:class:`MasterForm`): NARROW (``hi``, ``lo`` between steps), WIDE (``make_resident``: checkpoints,
whole views and loads read and write the masters as fp32 -- a checkpoint carries the exact ``hi + lo`` -- until
the next step narrows them again). Widening swaps the master tensor's ``.data``, so the tensor keyed in
``optimizer.state`` and held in ``param_groups`` stays the same object.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Iterable, Iterator, Optional

import torch

from .kinds.base import Kind

BF16 = torch.bfloat16


class MasterForm(enum.Enum):
    NARROW = "narrow"  # bf16 hi (+ lo): between steps
    WIDE = "wide"  # fp32: made resident for checkpoints / loads, until the next step


def residual(x: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``lo = bf16(x - hi)`` rounded toward zero (the low 16 bits of the fp32 difference cut): ``|lo|`` then
    stays below half an ulp of ``hi`` unless ``x`` itself was a tie, so ``bf16(hi + lo) == hi`` always and a
    widen -> narrow round trip (a checkpoint between two steps) gives back the same ``hi`` and ``lo`` bit for
    bit; to nearest, ``lo`` could round up to exactly half an ulp and the tie flip ``hi``."""
    d = x - hi.float()
    return (d.view(torch.int32) & -65536).view(torch.float32).to(BF16)


def _per_element(v, m: torch.Tensor) -> bool:
    return torch.is_tensor(v) and v.dim() > 0 and v.is_floating_point() and v.shape == m.shape


class LowPrecisionStates:
    """One ShardedOptimizer's low-precision moments and masters ([Note: low-precision optimizer states])."""

    def __init__(self, optimizer_state_dtype: str = "fp32", master_dtype: str = "fp32") -> None:
        self.moments = optimizer_state_dtype == "bf16"
        self.masters = master_dtype == "bf16"
        self.compensation: dict[int, torch.Tensor] = {}  # id(master) -> lo, bf16, where the master lives
        self._narrow: dict[int, torch.Tensor] = {}  # id(master) -> its bf16 storage while WIDE
        self.form = MasterForm.NARROW

    @property
    def active(self) -> bool:
        return self.moments or self.masters

    # -- masters ----------------------------------------------------------------------------------------
    def make_master(self, src: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
        """A bf16 master of ``src``'s values (fp32 at setup) and its compensation, on ``device``."""
        x = src.detach().to(device=device, dtype=torch.float32)
        hi = x.to(BF16)
        lo = residual(x, hi)
        if pin:
            hi, lo = hi.pin_memory(), lo.pin_memory()
        hi.grad_dtype = torch.float32  # the fp32 reduced gradient is the master's .grad
        self.compensation[id(hi)] = lo
        return hi

    def alias(self, m: torch.Tensor, src: torch.Tensor) -> bool:
        """``m``'s bf16 values in ``src`` (the module's bf16 slice or unit shard, equal to them: both are the
        fp32 value rounded to nearest) from now on: the master is the parameter. False where it cannot be."""
        if not self.masters or src.dtype != BF16 or src.device != m.device or src.shape != m.shape:
            return False
        m.set_(src.detach())
        return True

    def wide_ids(self) -> set[int]:
        return set(self._narrow)

    def compensation_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.compensation.values())

    def extra_bytes(self) -> int:
        """Bytes beyond the masters' bf16 ``hi``: the compensation terms, and while WIDE each widened master's
        fp32 copy (a load made it; the next step drops it)."""
        return self.compensation_bytes() + sum(hi.numel() * 4 for hi in self._narrow.values())

    def _widen_master(self, m: torch.Tensor) -> None:
        if id(m) in self._narrow:
            return
        hi = m.detach()
        self._narrow[id(m)] = hi
        m.data = hi.float().add_(self.compensation[id(m)].float())

    def _narrow_master(self, m: torch.Tensor) -> None:
        hi = self._narrow.pop(id(m), None)
        if hi is None:
            return
        x = m.detach()
        hi.copy_(x)  # round to nearest
        self.compensation[id(m)].copy_(residual(x, hi))
        m.data = hi

    def make_resident(self, masters: Iterable[torch.Tensor]) -> None:
        """Masters as fp32 (exactly ``hi + lo``) until the next step: what checkpoints save and loads write."""
        if self.masters:
            for m in masters:
                self._widen_master(m)
            self.form = MasterForm.WIDE

    def narrow_all(self, masters: Iterable[torch.Tensor]) -> None:
        """Every WIDE master back to ``hi`` + ``lo`` (a step starts with this; a streaming store binds bf16)."""
        if self.form is MasterForm.WIDE:
            for m in masters:
                self._narrow_master(m)
            self.form = MasterForm.NARROW

    # -- the step of one bucket ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def widened(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]) -> Iterator[None]:
        """fp32 masters and moments of ``masters`` for the step inside; narrowed again after it."""
        if not self.active:
            yield
            return
        kept: dict[tuple[int, str], torch.Tensor] = {}  # the bf16 moment tensors, refilled in place
        mine = [m for m in masters if id(m) not in self._narrow] if self.masters else []  # not WIDE already
        for m in mine:
            self._widen_master(m)
        if self.moments:
            for m in masters:
                st = optimizer.state.get(m)
                for key, v in (st or {}).items():
                    if _per_element(v, m) and v.dtype == BF16:
                        kept[(id(m), key)] = v
                        st[key] = v.float()
        try:
            yield
        finally:
            if self.moments:
                for m in masters:
                    st = optimizer.state.get(m)
                    for key, v in list((st or {}).items()):
                        if not _per_element(v, m) or v.dtype != torch.float32:
                            continue
                        low = kept.get((id(m), key))
                        if low is None:  # created by this step: bf16 from now on
                            st[key] = v.to(BF16)
                        else:
                            low.copy_(v)
                            st[key] = low
            for m in mine:
                self._narrow_master(m)

    def narrow_state(self, optimizer: torch.optim.Optimizer, masters: Iterable[torch.Tensor]) -> None:
        """Moments a load filled in fp32 (a checkpoint of fp32 states) kept in bf16 from now on."""
        if self.moments:
            for m in masters:
                st = optimizer.state.get(m)
                for key, v in list((st or {}).items()):
                    if _per_element(v, m) and v.dtype == torch.float32:
                        st[key] = v.to(BF16)


def check_low_precision(config, compute_dtype: Optional[torch.dtype], optimizers: list, kinds: list) -> None:
    """One clear error, before anything is sharded, where the knobs cannot hold."""
    knobs = [f"{k}='bf16'" for k in ("optimizer_state_dtype", "master_dtype") if getattr(config, k) == "bf16"]
    if not knobs:
        return
    for opt, kind in zip(optimizers, kinds):
        if kind.kind is not Kind.ELEMENTWISE:
            name = type(opt).__name__
            raise ValueError(
                f"{' and '.join(knobs)} widen and round an optimizer's state one bucket of flat shards at a time; "
                f"{name} is a {kind.kind.value} optimizer (it steps whole tensors or exchanges its own state). "
                f"Allowed: an elementwise optimizer (SGD, Adam, AdamW, Adagrad, ...) with {', '.join(knobs)}, or "
                f"{name} with optimizer_state_dtype='fp32' and master_dtype='fp32'.")
    if config.master_dtype == "bf16":
        if compute_dtype is not torch.bfloat16:
            have = "fp32" if compute_dtype in (None, torch.float32) else str(compute_dtype).replace("torch.", "")
            raise ValueError(
                f"master_dtype='bf16' keeps the master in the bf16 parameter (plus a compensation term); this "
                f"engine computes in {have}. Allowed: master_dtype='bf16' with bf16 compute (precision='bf16-mixed' "
                f"or 'bf16-true', compute_dtype=torch.bfloat16); in fp32 training the fp32 parameter is its own "
                f"master already (optimizer_state_dtype='bf16' still halves the moments).")
        why = check_grad_dtype_supported()
        if why is not None:
            raise ValueError(f"master_dtype='bf16' needs an fp32 gradient on a bf16 master: {why}. Allowed: "
                             f"master_dtype='fp32', or a torch with Tensor.grad_dtype.")


def check_grad_dtype_supported() -> Optional[str]:
    """Why bf16 masters cannot run on this torch (an fp32 ``.grad`` on a bf16 tensor needs ``grad_dtype``)."""
    probe = torch.zeros(1, dtype=BF16)
    try:
        probe.grad_dtype = torch.float32
    except (AttributeError, TypeError, RuntimeError):
        return f"torch {torch.__version__} has no Tensor.grad_dtype (an fp32 gradient on a bf16 master)"
    return None
