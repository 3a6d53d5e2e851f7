"""Long sequences: Ulysses sequence parallelism (arXiv 2309.14509) for HF GPT-2, Llama and T5, composed with ZeRO,
and tiled MLP / LM loss over the sequence (ALST, arXiv 2506.13996).

Each sequence-parallel group of S ranks splits every sequence along its length: a rank embeds, projects and
runs the MLPs of its s / S positions; attention runs head-sharded on the whole sequence after an
all-to-all and returns sequence-sharded; every rank ends with the whole sequence's loss. Parameters,
gradients and optimizer state are the engine's as for data parallelism (docs/sequence_parallel.md). Tiling
computes a rank's MLPs and its logits + loss a tile of positions at a time, each tile recomputed in backward,
so the (B, s, 4h) intermediates and the (B, s, V) logits are never whole (docs/tiled_compute.md).

A layer beside the engine: imports no Lightning, no tools, no checkpoint format; the engine's collectives
only, and transformers only inside functions.
"""
from lightning_zero.sequence_parallel.all_to_all import heads_to_seq, seq_to_heads
from lightning_zero.sequence_parallel.apply import apply_sequence_parallel, check_sequence_parallel
from lightning_zero.sequence_parallel.batch import SequenceSharding
from lightning_zero.sequence_parallel.gather_reduce import all_gather_along, all_reduce_sum
from lightning_zero.sequence_parallel.group_ref import SequenceGroup
from lightning_zero.sequence_parallel.loss import whole_sequence_loss
from lightning_zero.sequence_parallel.tiled import TiledMLPForward, is_tiled, tile_mlp
from lightning_zero.sequence_parallel.tiled_loss import (TiledCausalLMLoss, TiledLogits, TiledLossForward, tile_lm_loss,
                                                        tiled_causal_lm_loss)

__all__ = ["apply_sequence_parallel", "check_sequence_parallel", "SequenceSharding", "SequenceGroup", "whole_sequence_loss", "seq_to_heads",
           "heads_to_seq", "all_reduce_sum", "all_gather_along", "tile_mlp", "tile_lm_loss", "tiled_causal_lm_loss",
           "is_tiled", "TiledMLPForward", "TiledLossForward", "TiledCausalLMLoss", "TiledLogits"]
