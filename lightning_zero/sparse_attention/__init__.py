"""Block-sparse attention for long inputs: DeepSpeed's layouts, a plain-PyTorch kernel, HF drop-ins (T5's encoder,
GPT-2 and Llama).

A layer beside the engine: imports no Lightning, and transformers only inside the drop-in functions.
"""
from lightning_zero.sparse_attention.attention import SparseSelfAttention
from lightning_zero.sparse_attention.block_sparse import (RelativeBias, SparsePlan, block_sparse_attention,
                                                           check_layout, make_plan)
from lightning_zero.sparse_attention.hf_causal import sparsify_causal_lm
from lightning_zero.sparse_attention.hf_t5 import (SparseT5Attention, describe_sparse, is_sparse,
                                                   sparsify_t5_encoder)
from lightning_zero.sparse_attention.layouts import (LAYOUTS, BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                                      DenseSparsityConfig, FixedSparsityConfig,
                                                      LocalSlidingWindowSparsityConfig, SparsityConfig,
                                                      VariableSparsityConfig, make_sparsity_config)

__all__ = ["SparseSelfAttention", "RelativeBias", "SparsePlan", "block_sparse_attention", "check_layout",
           "make_plan", "sparsify_causal_lm", "SparseT5Attention", "describe_sparse", "is_sparse",
           "sparsify_t5_encoder", "LAYOUTS",
           "SparsityConfig",
           "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig", "BigBirdSparsityConfig",
           "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig", "make_sparsity_config"]
