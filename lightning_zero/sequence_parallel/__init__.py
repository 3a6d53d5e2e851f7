"""Long sequences: tiled MLP and tiled LM loss over the sequence (ALST, arXiv 2506.13996).

A layer beside the engine: imports no Lightning, and transformers only inside functions.
"""
from lightning_zero.sequence_parallel.tiled import TiledMLPForward, is_tiled, tile_mlp
from lightning_zero.sequence_parallel.tiled_loss import (TiledCausalLMLoss, TiledLogits, TiledLossForward, tile_lm_loss,
                                                        tiled_causal_lm_loss)

__all__ = ["tile_mlp", "tile_lm_loss", "tiled_causal_lm_loss", "is_tiled", "TiledMLPForward", "TiledLossForward",
           "TiledCausalLMLoss", "TiledLogits"]
