"""Several pipeline chunks per rank under the Trainer (the interleaved schedule): one optimizer per chunk.

Design note
-----------
Each chunk needs its own engine (torch's interleaved schedule reports the last backward per chunk, and an
engine's end-of-backward flushes all of its buckets), and an engine shards the optimizer it is given over
exactly its own parameters. Lightning, under automatic optimization, takes one optimizer. So the user's
optimizer (over ``self.parameters()``, any param groups, any LR scheduler) stays what Lightning and its
schedulers see -- the *template*: it holds no state and is never stepped -- and each chunk gets an optimizer
of the same class over its own share of every param group, with that group's hyperparameters. Before each
optimizer step, :func:`sync_hyperparameters` copies the template's current group settings (the LR the
scheduler set, ...) into the chunk optimizers, so they follow the schedule exactly.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch import nn

_SOURCE = "_lightning_zero_template_groups"  # chunk optimizer attribute: its groups' indices in the template


def chunk_optimizers(template: torch.optim.Optimizer, chunks: Sequence[nn.Module]) -> list[torch.optim.Optimizer]:
    """One optimizer of ``type(template)`` per chunk, over the chunk's parameters of each template group."""
    owner = {id(p): k for k, c in enumerate(chunks) for p in c.parameters()}
    groups: list[list[tuple[int, list]]] = [[] for _ in chunks]
    for gi, group in enumerate(template.param_groups):
        split: list[list] = [[] for _ in chunks]
        for p in group["params"]:
            if id(p) not in owner:
                raise ValueError("configure_optimizers returned an optimizer over a parameter outside the module's "
                                 "pipeline_stages. Allowed with several chunks per rank: one optimizer over the "
                                 "chunks' parameters (self.parameters()).")
            split[owner[id(p)]].append(p)
        for k, params in enumerate(split):
            if params:
                groups[k].append((gi, params))
    out = []
    for k, rows in enumerate(groups):
        if not rows:
            raise ValueError(f"pipeline chunk {k} of this rank has no parameter in the optimizer. Allowed: one "
                             f"optimizer over every chunk's trainable parameters.")
        settings = [{**{key: v for key, v in template.param_groups[gi].items() if key != "params"}, "params": ps}
                    for gi, ps in rows]
        try:  # every group carries all hyperparameters; the defaults only fill what a constructor takes
            accepted = inspect.signature(type(template).__init__).parameters
            opt = type(template)(settings, **{k: v for k, v in template.defaults.items() if k in accepted})
        except TypeError as err:
            raise TypeError(f"{type(template).__name__} cannot be rebuilt per pipeline chunk from its defaults "
                            f"({err}). Allowed with several chunks per rank: an optimizer whose constructor takes "
                            f"(param_groups, **optimizer.defaults), as torch.optim's do.") from None
        setattr(opt, _SOURCE, [gi for gi, _ in rows])
        out.append(opt)
    return out


def sync_hyperparameters(template: torch.optim.Optimizer, chunk_opts: Sequence[Any]) -> None:
    """The template's current group settings (LR, weight decay, betas, ...) into every chunk optimizer."""
    for opt in chunk_opts:
        for group, gi in zip(opt.param_groups, getattr(opt, _SOURCE)):
            group.update({key: v for key, v in template.param_groups[gi].items() if key != "params"})
