"""Activations of any model for ``estimate``: one measured probe step, scaled linearly in the batch size.

Design note
-----------
T5 has a closed formula (``t5_dims.py``); other models get a measurement: the model is built once, for real,
on the CPU (in the compute dtype of ``precision``, as the engine's true fp16/bf16 module), and one forward of
its training step at a probe micro-batch P runs under :class:`~lightning_zero.engine.memory.activations.SavedBytes`
(the saved-tensors hook the tuner and the finder count with: each storage once, parameters excluded). Then

    activation bytes at micro-batch B = B x (saved bytes at P) / P

Linear because every saved activation of a training step carries the batch dimension; what does not (a
causal mask, a position table) is small, and is scaled too -- a slight overestimate that shrinks as P grows
(measured on an HF GPT-2 and an MLP, fp32 and bf16: from P=2 the rule is within +0.1 % at B=1 ... 16;
tests/test_batch_size_finder.py keeps it within 1 %). The probe
batch comes from what the model trains on: a LightningModule's (or its datamodule's) ``train_dataloader``
with its batch size set to P, or, for a Hugging Face model, P rows of random token ids (``seq_len``) with
themselves as labels. Not counted, as in the tuner's CPU rule: the transient peak inside an op, allocator slack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..engine.memory.activations import SavedBytes

_DTYPES = {"32-true": None, "32": None, "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16,
           "16-mixed": torch.float16, "16": torch.float16}


@dataclass
class ActivationProbe:
    probe_batch: int
    probe_bytes: int
    source: str  # what gave the probe batch

    def at(self, batch_size: int) -> float:
        return self.probe_bytes * batch_size / self.probe_batch


def _set_batch_size(module: nn.Module, datamodule: Any, size: int, name: str) -> None:
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

    if datamodule is not None and hasattr(datamodule, name):
        setattr(datamodule, name, size)
    elif lightning_hasattr(module, name):
        lightning_setattr(module, name, size)
    else:
        raise ValueError(f"The activation probe sets {name!r} to the probe batch size, and {type(module).__name__} "
                         "has none (nor its hparams / datamodule). Allowed: a batch_size attribute, or "
                         "batch_arg_name naming the one it has.")


def _cast(batch: Any, dtype: Optional[torch.dtype]) -> Any:
    from lightning.fabric.utilities.apply_func import apply_to_collection

    if dtype is None:
        return batch
    return apply_to_collection(batch, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def probe_activations(model: nn.Module, datamodule: Any = None, probe_batch: int = 2, precision: str = "32-true",
                      seq_len: int = 512, batch_arg_name: str = "batch_size") -> ActivationProbe:
    """Saved-tensor bytes of one training forward of ``model`` at micro-batch ``probe_batch`` (see above)."""
    from lightning.pytorch import LightningModule

    if precision not in _DTYPES:
        raise ValueError(f"Unknown precision {precision!r}. Allowed: 32-true, bf16-mixed, 16-mixed.")
    if not isinstance(probe_batch, int) or probe_batch < 1:
        raise ValueError(f"probe_batch={probe_batch!r}: allowed a positive int.")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("The activation probe runs the model: build it for real (not on the meta device).")
    dtype = _DTYPES[precision]
    if dtype is not None:
        model.to(dtype)
    model.train()
    if isinstance(model, LightningModule):
        _set_batch_size(model, datamodule, probe_batch, batch_arg_name)
        loader = (datamodule or model).train_dataloader()
        batch = _cast(next(iter(loader)), dtype)
        source = f"{type(datamodule or model).__name__}.train_dataloader()"

        def step():
            return model.training_step(batch, 0)
    elif getattr(getattr(model, "config", None), "vocab_size", None):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (probe_batch, seq_len), generator=g)
        source = f"{probe_batch} x {seq_len} random token ids"

        def step():
            return model(input_ids=ids, labels=ids).loss
    else:
        raise ValueError(f"The activation probe needs a batch: {type(model).__name__} is neither a LightningModule "
                         "(its train_dataloader gives one) nor a Hugging Face model (random token ids). Allowed: a "
                         "factory returning one of those, or a T5 preset (the formula).")
    saved = SavedBytes(model.parameters())
    with torch.enable_grad(), saved.hooks():
        step()
    return ActivationProbe(probe_batch, saved.bytes, source)
