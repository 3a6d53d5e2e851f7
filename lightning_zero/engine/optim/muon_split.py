"""The split Muon users write: Muon on the hidden 2-D matrices, an elementwise optimizer (AdamW) on the rest.

Muon orthogonalizes the update of a weight *matrix* that maps hidden features to hidden features; its authors
(Keller Jordan; Moonlight) keep embeddings, the output head, biases and norm gains on AdamW: an embedding's
rows are looked up one token at a time, and a head's update is shaped by the vocabulary, not by a hidden
space. Found from the module's structure, not from names: every ``nn.Embedding`` parameter, the output
embeddings an HF model declares (``get_output_embeddings()``; a tied head is the embedding itself), and every
parameter that is not 2-D.
"""

from __future__ import annotations

from torch import nn


def muon_split(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(parameters for Muon, parameters for AdamW) of ``module``'s trainable parameters, each listed once
    (tied ones under their first name), in ``named_parameters`` order."""
    outer: set[int] = set()
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            outer.update(id(p) for p in m.parameters())
    head = getattr(module, "get_output_embeddings", None)
    head = head() if callable(head) else None
    if isinstance(head, nn.Module):
        outer.update(id(p) for p in head.parameters())
    hidden, rest = [], []
    for p in module.parameters():  # each parameter once, tied ones included once
        if p.requires_grad:
            (hidden if p.ndim == 2 and id(p) not in outer else rest).append(p)
    return hidden, rest
