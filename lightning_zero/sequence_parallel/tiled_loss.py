"""Tiled LM loss: a causal LM's logits computed and consumed tile by tile, never whole.

[Note: tiled logits] (ALST's tiled logits and loss, arXiv 2506.13996.) At long sequences the (B, s, V)
logits -- and the fp32 copy HF's loss upcasts them to, and their gradient -- are the largest tensors of a
step (V = 50257 for GPT-2: 200 KB per token in fp32). The loss is a sum over positions, so with labels the
patched forward runs the base model to the final hidden states (B, s, h), cuts them into sequence tiles of
``tile_tokens`` positions and, per tile under non-reentrant ``torch.utils.checkpoint``, calls the
``lm_head`` module (the module, not its weight: stage 3's hooks gather it like in the untiled forward),
upcasts to fp32 and takes the summed cross entropy; only the tile's hidden states (views) are saved and
each tile's logits are recomputed when backward reaches it, so one tile's logits exist at a time. The
tiles' sums added up and divided as HF's ``ForCausalLMLoss`` divides are its loss: by
``num_items_in_batch`` when given (sum / N), else by the number of labels that are not ``ignore_index``
(the mean); labels are shifted on the whole sequence first, or taken as already shifted from
``shift_labels``. The output's ``logits`` is ``None`` then (they never existed); without labels, or with
``logits_to_keep`` other than 0, the forward is HF's own (the logits whole).

[Note: the loss chain] The patched forward still hands its loss to the model's ``loss_function``, with
HF's arguments, only with a :class:`TiledLogits` (the head and the hidden states) where the logits would be.
:func:`tile_lm_loss` puts :class:`TiledCausalLMLoss` (``ForCausalLMLoss``'s signature; it reads tiled logits
tile by tile and real ones with HF's function) where ``ForCausalLMLoss`` was: as the ``loss_function``, or
as the ``inner`` of a wrapper around it -- sequence parallelism's whole-sequence loss wraps the model's loss
function that way and all-reduces what its inner one returns, so tiling composes with it in either order.
A model whose innermost loss is not ``ForCausalLMLoss`` is refused.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.sequence_parallel.tiled import check_tile_tokens, sequence_tiles

log = logging.getLogger(__name__)

LM_CLASSES = ("GPT2LMHeadModel", "LlamaForCausalLM")


def _tile_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = head(hidden.contiguous()).float()  # HF's ForCausalLMLoss upcasts the logits before the cross entropy
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
                           reduction="sum")


def tiled_causal_lm_loss(head: nn.Module, hidden: torch.Tensor, labels: Optional[torch.Tensor], tile_tokens: int,
                         num_items_in_batch: Any = None, ignore_index: int = -100,
                         shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """HF's ``ForCausalLMLoss(head(hidden), labels, ...)`` with the logits made and used one sequence tile at a
    time ([Note: tiled logits]); ``hidden`` is (..., s, h)."""
    if shift_labels is None:
        # shifted on the whole sequence, as HF does: a tile's last position predicts the next tile's first label
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if shift_labels.shape != hidden.shape[:-1]:
        raise ValueError(f"tiled LM loss: labels of shape {tuple(shift_labels.shape)} for hidden states of shape "
                         f"{tuple(hidden.shape)}; the labels must be (batch, sequence), one per position.")
    seq = hidden.dim() - 2
    recompute = torch.is_grad_enabled()
    total = None
    for h, lab in zip(sequence_tiles(hidden, tile_tokens, seq), sequence_tiles(shift_labels, tile_tokens, seq)):
        part = (checkpoint(_tile_loss_sum, head, h, lab, ignore_index, use_reentrant=False) if recompute
                else _tile_loss_sum(head, h, lab, ignore_index))
        total = part if total is None else total + part
    if num_items_in_batch is None:
        return total / (shift_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _keeps_every_position(logits_to_keep: Any) -> bool:
    return not torch.is_tensor(logits_to_keep) and logits_to_keep == 0


@dataclasses.dataclass
class TiledLogits:
    """The logits ``head(hidden)`` of a tiled forward, not computed: what it hands the model's loss function in
    their place. Only :class:`TiledCausalLMLoss` reads them (tile by tile)."""

    head: nn.Module
    hidden: torch.Tensor
    tile_tokens: int


class TiledCausalLMLoss:
    """HF's ``ForCausalLMLoss`` (same signature) that takes :class:`TiledLogits` too: the loss function
    :func:`tile_lm_loss` installs at the bottom of the model's loss chain ([Note: the loss chain])."""

    def __call__(self, logits: Any, labels: Optional[torch.Tensor], vocab_size: int,
                 num_items_in_batch: Any = None, ignore_index: int = -100,
                 shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if not isinstance(logits, TiledLogits):  # real logits (a forward HF ran itself): HF's own loss
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                   ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        return tiled_causal_lm_loss(logits.head, logits.hidden, labels, logits.tile_tokens,
                                    num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                    shift_labels=shift_labels)

    def __repr__(self) -> str:
        return "TiledCausalLMLoss()"


def _loss_chain(lm: nn.Module) -> tuple[Any, Any]:
    """(the innermost loss function of ``lm``'s chain, the wrapper holding it as ``inner`` or None)."""
    holder, fn = None, lm.loss_function
    while hasattr(fn, "inner"):
        holder, fn = fn, fn.inner
    return fn, holder


class TiledLossForward:
    """The ``forward`` of one causal LM whose loss is tiled ([Note: tiled logits])."""

    def __init__(self, model: nn.Module, tile_tokens: int) -> None:
        self.model = model
        self.tile_tokens = tile_tokens

    def _arguments(self, args: tuple, kwargs: dict) -> tuple[dict, list[str]]:
        """Every argument by name, and the names the signature declares (the rest is HF's ``**kwargs``)."""
        params = list(inspect.signature(type(self.model).forward).parameters.values())[1:]  # without self
        declared = [p.name for p in params if p.kind is not p.VAR_KEYWORD]
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(args) > len(positional):
            raise TypeError(f"{type(self.model).__name__}.forward takes at most {len(positional)} positional "
                            f"arguments ({len(args)} given)")
        named = dict(zip(positional, args))
        twice = sorted(set(named) & set(kwargs))
        if twice:
            raise TypeError(f"{type(self.model).__name__}.forward got multiple values for {twice}")
        named.update(kwargs)
        return named, declared

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lm = self.model
        named, declared = self._arguments(args, kwargs)
        if named.get("labels") is None or not _keeps_every_position(named.get("logits_to_keep", 0)):
            return type(lm).forward(lm, *args, **kwargs)
        if not isinstance(_loss_chain(lm)[0], TiledCausalLMLoss):
            raise RuntimeError(f"{type(lm).__name__}'s loss_function was replaced after tile_lm_loss "
                               f"({lm.loss_function!r}): call tile_lm_loss(model, tile_tokens) again after "
                               "replacing it, so the tiled logits reach a loss that reads them.")
        labels = named.pop("labels")
        named.pop("logits_to_keep", None)
        return_dict = named.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(lm.config, "return_dict", True)
        # the rest goes to the base model as HF's forward sends it (its **kwargs too: num_items_in_batch, ...)
        outputs = lm.base_model(**named, return_dict=True)
        extra = {k: v for k, v in named.items() if k not in declared}  # what HF hands its loss function
        loss = lm.loss_function(TiledLogits(lm.lm_head, outputs.last_hidden_state, self.tile_tokens), labels,
                                vocab_size=lm.config.vocab_size, **extra)
        cls = _output_class(outputs)
        out = cls(loss=loss, logits=None, **{f.name: getattr(outputs, f.name, None)
                                             for f in dataclasses.fields(cls) if f.name not in ("loss", "logits")})
        return out if return_dict else out.to_tuple()

    def __repr__(self) -> str:
        return f"TiledLossForward({type(self.model).__name__}, tile_tokens={self.tile_tokens})"


def _output_class(base_outputs: Any) -> type:
    """HF's output class of the LM whose base returned ``base_outputs`` (GPT-2's carries cross-attentions)."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(type(base_outputs))}
    return CausalLMOutputWithCrossAttentions if "cross_attentions" in fields else CausalLMOutputWithPast


def _causal_lms(model: nn.Module) -> list[nn.Module]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    return [m for m in model.modules() if isinstance(m, (GPT2LMHeadModel, LlamaForCausalLM))]


def tile_lm_loss(model: nn.Module, tile_tokens: int) -> list[nn.Module]:
    """Patch every GPT-2 LM head / Llama causal LM in ``model`` (itself, or held by a LightningModule) so that,
    when labels are given, its logits are computed and consumed tile by tile and never whole
    ([Note: tiled logits]); the loss is HF's ``ForCausalLMLoss`` (its ``num_items_in_batch``, ``shift_labels``
    and ``ignore_index`` kwargs too), the output's ``logits`` ``None``. Changes the model in place, returns the
    patched LMs; calling it again sets the new tile size."""
    tile_tokens = check_tile_tokens(tile_tokens, "tile_lm_loss")
    from transformers.loss.loss_utils import ForCausalLMLoss

    lms = _causal_lms(model)
    if not lms:
        raise ValueError(f"tile_lm_loss: {type(model).__name__} holds no causal LM whose loss it can tile; it "
                         f"patches {', '.join(LM_CLASSES)} (found by class).")
    for lm in lms:
        inner, holder = _loss_chain(lm)
        if inner is not ForCausalLMLoss and not isinstance(inner, TiledCausalLMLoss):
            raise ValueError(f"tile_lm_loss: {type(lm).__name__}'s loss is {inner!r}, not HF's ForCausalLMLoss; "
                             f"only that loss is tiled (unset the model's loss_function / loss_type, or leave "
                             f"its loss untiled).")
    for lm in lms:
        inner, holder = _loss_chain(lm)
        if inner is ForCausalLMLoss:  # [Note: the loss chain]
            if holder is None:
                lm.loss_function = TiledCausalLMLoss()
            else:
                holder.inner = TiledCausalLMLoss()
        current = lm.__dict__.get("forward")
        if isinstance(current, TiledLossForward):
            current.tile_tokens = tile_tokens
        else:
            lm.forward = TiledLossForward(lm, tile_tokens)
    log.info("tile_lm_loss: %d causal LM(s) compute their loss over %d-token tiles; with labels their output "
             "carries the loss and no logits", len(lms), tile_tokens)
    return lms
