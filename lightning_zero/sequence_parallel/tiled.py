"""Tiled MLP: a transformer's MLP computed over tiles of the sequence, each tile recomputed in backward.

[Note: tiled MLP] (ALST's TiledMLP, arXiv 2506.13996.) A token's MLP output depends on that token alone, so
the MLP of a (B, s, h) input is the concatenation of its MLP over sequence tiles of ``tile_tokens``
positions: the same numbers, computed in pieces. Each tile runs under non-reentrant
``torch.utils.checkpoint``, which keeps only the tile's input (a view of the whole input, so no new
bytes) and recomputes the tile's forward when backward reaches it, so the (B, t, 4h) intermediates of one
tile exist at a time, in forward and in backward, instead of the whole (B, s, 4h) ones. The input is cut
with one ``split`` (its backward concatenates the tiles' gradients once) and the outputs joined with one
``cat``. Dropout inside the MLP draws its mask per tile (the same distribution, other bits than the untiled
module's); the checkpoint restores the RNG state, so a tile's recompute draws the same mask as its forward.

The module's ``forward`` becomes a :class:`TiledMLPForward` instance attribute (module-level class:
the model still pickles and deep-copies); it calls the class's own ``forward`` on each tile, so tiling
twice only changes the tile size, and hooks on the module (stage 3's gathers, when the module or a block
around it is a unit) run once around the whole call as before. Composes with the engine's activation
checkpointing (a checkpointed block recomputes its tiles, each again under its own checkpoint: nested
non-reentrant checkpoints) and activation offload (only the tiles' inputs are saved).

A stage-3 unit inside a tile (``unit_classes=["Linear"]``) is gathered for every tile and again by each
tile's recompute in backward: the recorded unit order holds those repeats, the same every step, and is
verified as usual (the default policies' units, the transformer blocks, hold the tiles instead).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MLP_CLASSES = ("GPT2MLP", "LlamaMLP", "T5LayerFF's DenseReluDense")


def check_tile_tokens(tile_tokens: Any, what: str) -> int:
    """``tile_tokens`` as a positive int, or one error naming what is allowed."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"{what}: tile_tokens must be a positive int (sequence positions per tile), "
                         f"got {tile_tokens!r}.")
    return tile_tokens


def sequence_tiles(x: torch.Tensor, tile_tokens: int, dim: int) -> tuple[torch.Tensor, ...]:
    """``x`` cut along ``dim`` into tiles of ``tile_tokens`` positions (the last one shorter): views, one
    ``split`` node in the graph."""
    return x.split(tile_tokens, dim=dim)


def _tile_forward(module: nn.Module, tile: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    # a tile of a batch-first (B, s, h) tensor is strided; HF's Conv1D views it flat. Made contiguous inside the
    # checkpoint: the copy is recomputed rather than saved (the saved input stays a view of the whole input)
    return type(module).forward(module, tile.contiguous(), *args, **kwargs)


class TiledMLPForward:
    """The ``forward`` of one tiled MLP module ([Note: tiled MLP])."""

    def __init__(self, module: nn.Module, tile_tokens: int) -> None:
        self.module = module
        self.tile_tokens = tile_tokens

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        m = self.module
        if hidden_states.dim() < 2:  # no sequence dimension to tile
            return type(m).forward(m, hidden_states, *args, **kwargs)
        seq = hidden_states.dim() - 2  # (..., s, h): HF's batch-first layout
        recompute = torch.is_grad_enabled() and (hidden_states.requires_grad
                                                 or any(p.requires_grad for p in m.parameters()))
        outs = []
        for tile in sequence_tiles(hidden_states, self.tile_tokens, seq):
            if recompute:
                outs.append(checkpoint(_tile_forward, m, tile, *args, use_reentrant=False, **kwargs))
            else:  # evaluation: nothing is saved, the tiles only bound the intermediates
                outs.append(_tile_forward(m, tile, *args, **kwargs))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=seq)

    def __repr__(self) -> str:
        return f"TiledMLPForward({type(self.module).__name__}, tile_tokens={self.tile_tokens})"


def _mlp_modules(model: nn.Module) -> list[nn.Module]:
    """Every transformer MLP of ``model`` by class: GPT-2's ``GPT2MLP``, Llama's ``LlamaMLP`` and the dense part
    of T5's ``T5LayerFF`` (its layer norm and residual are outside the tiles: they are per-token too, but cheap)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.t5.modeling_t5 import T5LayerFF

    found = []
    for m in model.modules():
        if isinstance(m, (GPT2MLP, LlamaMLP)):
            found.append(m)
        elif isinstance(m, T5LayerFF):
            found.append(m.DenseReluDense)
    return found


def is_tiled(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs over sequence tiles (:func:`tile_mlp`)."""
    return isinstance(module.__dict__.get("forward"), TiledMLPForward)


def tile_mlp(model: nn.Module, tile_tokens: int) -> list[nn.Module]:
    """Compute every transformer MLP of ``model`` over sequence tiles of ``tile_tokens`` positions with per-tile
    recomputation ([Note: tiled MLP]); the model is changed in place and the tiled modules returned. Calling it
    again sets the new tile size. The MLPs' outputs are the untiled ones (fp32: equal to rounding)."""
    tile_tokens = check_tile_tokens(tile_tokens, "tile_mlp")
    mlps = _mlp_modules(model)
    if not mlps:
        raise ValueError(f"tile_mlp: {type(model).__name__} has no transformer MLP to tile; it tiles "
                         f"{', '.join(MLP_CLASSES)} (found by class).")
    for m in mlps:
        if is_tiled(m):
            m.__dict__["forward"].tile_tokens = tile_tokens
        else:
            m.forward = TiledMLPForward(m, tile_tokens)
    return mlps
