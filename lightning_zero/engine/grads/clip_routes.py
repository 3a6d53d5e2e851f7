"""torch's ``clip_grad_norm_`` / ``clip_grad_value_`` on parameters an engine trains: the engine's clip, over
every rank's shards ([Note: torch's clipping routed])."""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import torch
import torch.nn.utils as nn_utils
from torch.nn.utils import clip_grad as torch_clip

from . import grad_norm as GN

# [Note: torch's clipping routed]
# A DDP user clips across every optimizer with one line before stepping each -- Muon and AdamW of one model:
# ``torch.nn.utils.clip_grad_norm_(model.parameters(), max)``. Under ZeRO that line reads ``param.grad``,
# which at stages 1-3 is None once backward reduce-scattered the gradients into shards (torch returns a norm
# of 0 and clips nothing), and at stage 0 still carries an fp16 loss scale. No strategy or plugin is asked
# before the call, so while a training engine lives torch's two functions are wrapped (the names
# ``torch.nn.utils.*`` and ``torch.nn.utils.clip_grad.*``): a call whose parameters an engine trains becomes
# that engine's clip over the optimizers holding them -- the global norm from every rank's disjoint shards
# (one all-reduce per optimizer), returned as DDP's call returns it, the coefficient applied at each
# optimizer's next step, fused with unscaling -- and every other call is torch's own. An engine clips whole
# optimizers (one coefficient each), so the parameters must cover each optimizer they touch
# (``model.parameters()``, or one optimizer's); part of one is refused, naming what is allowed. A copy of
# torch's function bound before the wrapping (``from torch.nn.utils import clip_grad_norm_`` at import time)
# still ends in torch's scaling helper, which it looks up when called (``clip_grad._clip_grads_with_norm_``):
# that is wrapped to raise on managed parameters, so a local norm is never returned silently. The functions
# are torch's again once the last engine lets go.
_ENGINES: "weakref.WeakSet[Any]" = weakref.WeakSet()
_TORCH = {"clip_grad_norm_": torch_clip.clip_grad_norm_, "clip_grad_value_": torch_clip.clip_grad_value_,
          "_clip_grads_with_norm_": torch_clip._clip_grads_with_norm_}
_PUBLIC = {"clip_grad_norm_": "clip_grad_norm_", "clip_grad_value_": "clip_grad_value_",
           "_clip_grads_with_norm_": "clip_grads_with_norm_"}  # name in clip_grad -> name in torch.nn.utils
_ALLOWED = ("Allowed: all parameters of the optimizers clipped, e.g. model.parameters() (every optimizer: DDP's "
            "global norm) or one optimizer's parameters; or the strategy's own clipping (Trainer "
            "gradient_clip_val, self.clip_gradients(opt, ...), fabric.clip_gradients(model, opt, ...)).")


def track(engine: Any) -> None:
    """``engine`` trains: torch's clipping on its parameters is routed to it (installed with the first one)."""
    if not _ENGINES:
        for name, public in _PUBLIC.items():
            fn = _WRAPPERS[name]
            setattr(torch_clip, name, fn)
            setattr(nn_utils, public, fn)
    _ENGINES.add(engine)


def untrack(engine: Any) -> None:
    """``engine`` lets go; torch's own functions are back once no engine trains."""
    _ENGINES.discard(engine)
    if not _ENGINES:
        for name, public in _PUBLIC.items():
            setattr(torch_clip, name, _TORCH[name])
            setattr(nn_utils, public, _TORCH[name])


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _route(params: list, what: str) -> Optional[tuple[Any, list]]:
    """(engine, its optimizers covered by ``params``), or None when no engine trains any of ``params``."""
    ids = {id(p) for p in params}
    hits = [(e, s) for e in list(_ENGINES) for s in e.shardeds
            if any(id(p) in ids for b in s.buckets for p in b.params)]
    if not hits:
        return None
    engines = {id(e) for e, _ in hits}
    if len(engines) > 1:
        raise ValueError(f"torch.nn.utils.{what} got parameters of {len(engines)} ZeRO engines (models set up "
                         f"separately); each engine clips its own. Call it once per model. {_ALLOWED}")
    engine = hits[0][0]
    managed = {id(p) for s in engine.shardeds for b in s.buckets for p in b.params}
    strays = [p for p in params if id(p) not in managed and p.grad is not None]
    if strays:
        raise ValueError(f"torch.nn.utils.{what} got {len(strays)} parameter(s) with a gradient that no optimizer "
                         f"of the ZeRO engine holds beside ones it trains. {_ALLOWED}")
    for k, (_, s) in enumerate(hits):
        missing = [p for b in s.buckets for p in b.params if id(p) not in ids]
        if missing:
            raise ValueError(
                f"torch.nn.utils.{what} got part of the parameters of {type(s.optimizer).__name__} (optimizer "
                f"{engine.shardeds.index(s)}; {len(missing)} of its parameters left out): under ZeRO its "
                f"gradient is clipped as one, by one coefficient. {_ALLOWED}")
    return engine, [s.optimizer for _, s in hits]


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """torch's, or on an engine's parameters the engine's global-norm clip ([Note: torch's clipping routed])."""
    params = _as_list(parameters)
    routed = _route(params, "clip_grad_norm_")
    if routed is None:
        return _TORCH["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    if float(norm_type) != 2.0:
        raise ValueError(f"torch.nn.utils.clip_grad_norm_ on parameters ZeRO trains clips by the global 2-norm "
                         f"only; got norm_type={norm_type!r}. Allowed: norm_type=2.0 (torch's default).")
    engine, optimizers = routed
    squares = [sq for opt in optimizers for sq in engine.shard_sq_norms(opt)]  # one all-reduce per optimizer
    total = GN.total_sq_norm(squares).sqrt() / engine.loss_scale
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = GN.clip_coef(total, max_norm)
    for opt in optimizers:
        engine.sharded_for(opt).clip_coef = coef  # applied with unscaling at that optimizer's step
    return total


@torch.no_grad()
def clip_grad_value_(parameters, clip_value: float, foreach: Optional[bool] = None) -> None:
    """torch's, or on an engine's parameters the engine's value clip at each optimizer's step."""
    params = _as_list(parameters)
    routed = _route(params, "clip_grad_value_")
    if routed is None:
        return _TORCH["clip_grad_value_"](params, clip_value, foreach)
    engine, optimizers = routed
    for opt in optimizers:
        engine.clip_grad_value_(clip_value, opt)
    return None


def _clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor,
                           foreach: Optional[bool] = None) -> None:
    """torch's; refused on an engine's parameters: the norm it was given was computed without the shards."""
    params = _as_list(parameters)
    ids = {id(p) for p in params}
    if any(id(p) in ids for e in list(_ENGINES) for p in e.params):
        raise RuntimeError(
            "torch's clip_grad_norm_ ran on parameters a ZeRO engine trains, but as a copy bound before the engine "
            "existed (e.g. `from torch.nn.utils import clip_grad_norm_` at import time): it read this rank's "
            "param.grad, not the reduced gradient shards, so its norm is wrong. Call it as "
            "torch.nn.utils.clip_grad_norm_(...) (routed to the engine's global norm), or use the strategy's "
            f"clipping. {_ALLOWED}")
    return _TORCH["_clip_grads_with_norm_"](params, max_norm, total_norm, foreach)


_WRAPPERS = {"clip_grad_norm_": clip_grad_norm_, "clip_grad_value_": clip_grad_value_,
             "_clip_grads_with_norm_": _clip_grads_with_norm_}
