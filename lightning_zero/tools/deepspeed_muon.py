"""DeepSpeed's ``"optimizer": {"type": "Muon", ...}`` as torch's Muon on the hidden matrices + AdamW on the rest.

[Note: DeepSpeed's Muon]
DeepSpeed builds one ``MuonWithAuxAdam`` over two param groups: ``deepspeed.initialize`` tags every parameter
``use_muon`` (``ndim >= 2`` and neither "embed" nor "lm_head" in its name); the Muon group takes the config's
``lr`` (``muon_lr`` overrides it), ``momentum``, ``weight_decay`` and ``ns_method``, the Adam group ``lr``
(``adam_lr`` overrides it), ``betas``, ``eps`` and ``weight_decay``; what a group is not given is
``MuonWithAuxAdam``'s default (Muon: lr 0.02, momentum 0.95, weight decay 0, ``ns_method="gram"``; Adam: lr 3e-4,
betas (0.9, 0.95), eps 1e-10, weight decay 0), and other keys are dropped. Its Muon step is Keller Jordan's:
Nesterov momentum, 5 quintic Newton-Schulz steps (3.4445, -4.7750, 2.0315) in bf16, the update scaled by
``max(1, rows / cols) ** 0.5``, decoupled weight decay -- which is ``torch.optim.Muon`` with its defaults
(``nesterov=True``, ``ns_steps=5``, ``adjust_lr_fn=None``).

Here that is two torch optimizers, classes unchanged, each stepped on its parameters' owner ranks or shards
([Note: owner-rank step]): ``torch.optim.Muon`` over ``lightning_zero.muon_split``'s hidden matrices and
``torch.optim.AdamW`` over the rest, with DeepSpeed's values and defaults written out. Two things cannot be
honoured, and ``DeepSpeedTranslation.differs`` names them:

* which parameters get Muon: ``muon_split`` reads the module's structure (every ``nn.Embedding``, the output
  embeddings an HF model declares, and only 2-D tensors), not names: an embedding whose name lacks "embed"
  (T5's ``shared``, its ``relative_attention_bias``) is AdamW's here and Muon's in DeepSpeed, and a conv
  kernel (4-D) AdamW's here (torch's Muon takes matrices only);
* ``ns_method="gram"`` (DeepSpeed's default), a Gram-matrix Newton-Schulz iteration, has no torch counterpart:
  torch's Muon runs the standard quintic iteration (DeepSpeed's ``ns_method="standard"``), an approximation of
  the same orthogonalization.

``zero_optimization.save_muon_momentum_buffer_in_memory`` keeps Muon's momentum off NVMe in DeepSpeed; here a
whole-tensor optimizer never has NVMe state (the run refuses it), so the key has no effect.
"""

from __future__ import annotations

from typing import Any

import torch

from .deepspeed_auto import DeepSpeedConfigError

MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}  # MuonWithAuxAdam's, for the Muon group
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}  # and for the Adam group
MUON_KEYS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "betas", "eps", "ns_method")
NS_METHODS = ("gram", "standard")
SPLIT = ("torch.optim.Muon takes the module's hidden 2-D matrices (lightning_zero.muon_split: by "
         "structure, embeddings and the output head excluded), DeepSpeed every >=2-D parameter whose name lacks "
         "'embed' and 'lm_head'")
GRAM = ("DeepSpeed's default 'gram' has no torch counterpart: torch.optim.Muon runs the standard quintic Newton-Schulz "
        "iteration (DeepSpeed's 'standard'), an approximation of the same orthogonalization")


def translate_muon(params: dict, out: Any) -> tuple[tuple[type, dict], tuple[type, dict]]:
    """``((torch.optim.Muon, kwargs), (torch.optim.AdamW, kwargs))`` of a DeepSpeed Muon block's ``params``
    ("auto" values already resolved); ``out.differs`` records what runs differently ([Note: DeepSpeed's Muon])."""
    unknown = sorted(set(params) - set(MUON_KEYS))
    if unknown:
        raise DeepSpeedConfigError(f"optimizer Muon: unsupported params {unknown}. Allowed: {', '.join(MUON_KEYS)}.")
    ns = params.get("ns_method", "gram")
    if ns not in NS_METHODS:
        raise DeepSpeedConfigError(f"optimizer Muon: params.ns_method={ns!r}. Allowed: {', '.join(NS_METHODS)}.")
    muon = {k: params.get(k, d) for k, d in MUON_DEFAULTS.items()}
    adamw = {k: params.get(k, d) for k, d in ADAM_DEFAULTS.items()}
    muon["lr"] = params.get("muon_lr", muon["lr"])
    adamw["lr"] = params.get("adam_lr", adamw["lr"])
    adamw["betas"] = tuple(adamw["betas"])
    for cls, kw in ((torch.optim.Muon, muon), (torch.optim.AdamW, adamw)):
        try:
            cls([torch.zeros(2, 2, requires_grad=True)], **kw)
        except (TypeError, ValueError) as e:
            raise DeepSpeedConfigError(f"optimizer Muon: params {kw} do not fit {cls.__name__}: {e}") from None
    out.differs["optimizer.params.use_muon"] = SPLIT
    if ns == "gram":
        out.differs["optimizer.params.ns_method"] = GRAM
    return (torch.optim.Muon, muon), (torch.optim.AdamW, adamw)


def split_optimizers(module: Any, muon: tuple[type, dict], adamw: tuple[type, dict]) -> list:
    """[Muon over ``module``'s hidden matrices, AdamW over the rest]: one ``MuonWithAuxAdam`` as two torch
    optimizers (train them with manual optimization in Lightning, or ``fabric.setup(model, *optimizers)``)."""
    from ..engine.optim.muon_split import muon_split

    if not isinstance(module, torch.nn.Module):
        raise DeepSpeedConfigError(
            "optimizer Muon: pass the module, configure_optimizers(self) (not its parameters): Muon's parameters "
            "are found from the module's structure (lightning_zero.muon_split).")
    hidden, rest = muon_split(module)
    return [muon[0](hidden, **muon[1])] + ([adamw[0](rest, **adamw[1])] if rest else [])


def recipe_muon(muon: dict, adamw: dict) -> tuple[dict, list[str]]:
    """The T5 recipe's ``optim.*`` for a translated Muon, and what it cannot take."""
    o = {"optim.name": "muon", "optim.lr": adamw["lr"], "optim.weight_decay": adamw["weight_decay"]}
    notes = [f"optimizer Muon: the recipe's optim.name=muon takes one optim.lr={adamw['lr']} (AdamW's) for both "
             "optimizers, Muon's update scaled to AdamW's RMS (adjust_lr_fn='match_rms_adamw'), and torch's "
             f"momentum / betas / eps; DeepSpeed's Muon {muon}, AdamW {adamw}: "
             "DeepSpeedTranslation.configure_optimizers(module) builds exactly these from Python"]
    return o, notes
