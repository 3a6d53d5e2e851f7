"""The recipe's attention choice (``model.attention``, ``model.sparse``): checked before any process starts, and
what the run's start line and summary say about it.

Nothing here imports transformers or Lightning: ``check_attention`` runs first in the app.
"""
from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from t5_config import ConfigError

ATTENTIONS = ("dense", "sparse")


def check_attention(cfg: Any) -> None:
    """``model.attention`` and, when sparse, every ``model.sparse`` knob, checked by building the sparsity config
    here, before any process starts (the ranks build it again from the same values)."""
    m = cfg.model
    if m.attention not in ATTENTIONS:
        raise ConfigError(f"model.attention={m.attention!r}: allowed {', '.join(ATTENTIONS)}.")
    if m.attention != "sparse":
        return
    from lightning_zero.sparse_attention import make_sparsity_config

    sp = OmegaConf.to_container(m.sparse, resolve=True)
    try:
        # the head count is the model's; 1 here checks every option that does not depend on it
        config = make_sparsity_config(sp["layout"], 1, sp["block"], **(sp["options"] or {}))
    except ValueError as e:
        raise ConfigError(f"model.sparse (layout={sp['layout']!r}, block={sp['block']!r}, "
                          f"options={sp['options']}): {e}") from e
    blocks = -(-cfg.data.max_source_len // config.block)
    late = [i for i in getattr(config, "global_block_indices", []) if i >= blocks]
    if late:
        raise ConfigError(f"model.sparse.options.global_block_indices={config.global_block_indices}: {late} start "
                          f"past data.max_source_len={cfg.data.max_source_len} ({blocks} blocks of "
                          f"{config.block}) and would never apply; allowed 0 .. {blocks - 1}.")


def describe_attention(model: Any) -> str:
    """``dense (HF T5)``, or the sparse layers and their layout (``lightning_zero.sparse_attention``)."""
    from lightning_zero.sparse_attention import describe_sparse

    return describe_sparse(model) or "dense (HF T5's own)"
