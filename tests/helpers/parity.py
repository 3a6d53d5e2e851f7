"""One DDP reference runner and one comparison, with the tolerances the parity tests share.

Like torch's ``check_sharded_parity`` (torch/testing/_internal/common_fsdp.py): a ZeRO run and its reference
train the same model from the same seed on the same data, and every loss, pre-clip norm and final weight is
compared at one named tolerance. The tolerances are named, not repeated, so a looser one is a visible choice:

- ``FP32``: the default (rtol 1e-5, atol 1e-6), for fp32 runs against DDP.
- ``FP32_TIGHT``: atol 1e-7, where a run's weights are small enough that 1e-6 would hide a defect.
- ``TP_FP32``: atol 1e-5, on purpose. The reference runs the whole model; TP sums each matmul in two halves,
  so fp32 differs by an ulp and AdamW (which divides by sqrt(v)) carries that into the weights: on AMD EPYC
  the same element of the same weight differs by 2.4e-6 at *every* stage, zero0 included. A ZeRO defect
  moves weights by ~lr (2e-2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine
from tests.helpers.dist_utils import clip_and_step
from tests.helpers.models import batch, loss_fn, make_model, make_optimizer


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


FP32 = Tolerance(rtol=1e-5, atol=1e-6)
FP32_TIGHT = Tolerance(rtol=1e-5, atol=1e-7)
TP_FP32 = Tolerance(rtol=1e-5, atol=1e-5)
# sequence parallelism: each parameter's gradient is summed from the S ranks' partial contributions (attention's
# exchanges, the loss's all-reduce) in another order than one process's. GPT-2's key bias has an analytically zero
# gradient (softmax ignores a per-query shift): Adam turns two orders of its float noise into ~1e-6 (lr 1e-3) apart
SP_FP32 = Tolerance(rtol=1e-5, atol=1e-5)


def close(got: Any, ref: Any, what: str = "", tol: Tolerance = FP32) -> None:
    """Assert ``got`` equals ``ref`` within ``tol``: tensors, numbers, lists of them, or state dicts (same keys,
    each entry compared and named in the message)."""
    if isinstance(ref, dict):
        assert isinstance(got, dict) and got.keys() == ref.keys(), f"{what}: keys {sorted(got)} != {sorted(ref)}"
        for k in ref:
            close(got[k], ref[k], f"{what}[{k}]" if what else k, tol)
        return
    torch.testing.assert_close(_as_tensor(got), _as_tensor(ref), rtol=tol.rtol, atol=tol.atol,
                               msg=(lambda m: f"{what}: {m}") if what else None)


def _as_tensor(x: Any) -> Any:
    """Numbers and lists of numbers (losses, norms) as one tensor; what is no tensor (a list of tensors,
    None) as it is, for torch.testing to compare element by element."""
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        return x


def is_close(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance = FP32) -> bool:
    """The predicate form of ``close``, for tests that list every mismatching name before failing."""
    return torch.allclose(got, ref, rtol=tol.rtol, atol=tol.atol)


def check_parity(got: tuple, ref: tuple, what: str = "", tol: Tolerance = FP32) -> None:
    """A run's ``(losses, norms, state)`` against its reference's: every loss, norm and final weight."""
    (gl, gn, gs), (rl, rn, rs) = got, ref
    close(gl, rl, f"{what} losses", tol)
    close(gn, rn, f"{what} norms", tol)
    close(gs, rs, f"{what} state", tol)


# -- the ParityNet run (tests/helpers/models.py): ZeroEngine or torch DDP -----------------------------------
STEPS = 5
UNITS = ["fc1", "fc2", "frozen", "unused"]  # 'sometimes' (rank-dependent use) stays in the root


def use_sometimes(rank: int, step: int, mode: str = "rank") -> bool:
    """Whether ``ParityNet.sometimes`` runs: on rank 0 at even steps (``"rank"``) or on every rank (``"step"``)."""
    return rank == 0 and step % 2 == 0 if mode == "rank" else step % 2 == 0


def train_parity_net(rank: int, opt_kind: str, accum: int, clip: Optional[float], zero: bool, use_mode: str = "rank",
                     cfg: Optional[ZeroConfig] = None):
    """``STEPS`` optimizer steps of ParityNet with a LambdaLR schedule, under ZeroEngine (``zero``; ``cfg`` or
    stage 3 over ``UNITS``) or under torch DDP (``find_unused_parameters=True``): losses, pre-clip norms and the
    final fp32 state dict."""
    model = make_model()
    opt = make_optimizer(model, opt_kind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    if zero:
        engine = ZeroEngine(model, opt, cfg or ZeroConfig(stage=3, unit_classes=UNITS, persist_numel=0))
        runner = model
    else:
        runner = DDP(model, find_unused_parameters=True)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(accum):
            boundary = micro == accum - 1
            ctx = torch.enable_grad()
            if not boundary:
                ctx = engine.no_sync() if zero else runner.no_sync()
            with ctx:
                loss = loss_fn(runner, batch(step, rank, micro), use_sometimes(rank, step, use_mode)) / accum
                loss.backward()
            losses.append(loss.item())
        clip_and_step(engine if zero else None, model, opt, clip, norms)
        sched.step()
    if zero:
        engine.restore_fp32_module()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_reference(rank: int, opt_kind: str, accum: int, clip: Optional[float], use_mode: str = "rank"):
    """The torch DDP run every ParityNet engine test compares with."""
    return train_parity_net(rank, opt_kind, accum, clip, False, use_mode)
