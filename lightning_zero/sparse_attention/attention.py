"""``SparseSelfAttention``: a layout config, its cached gather plan per length, and padding to the block."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_zero.sparse_attention.block_sparse import RelativeBias, SparsePlan, block_sparse_attention, make_plan
from lightning_zero.sparse_attention.layout_checks import check_flag
from lightning_zero.sparse_attention.layouts import SparsityConfig


class SparseSelfAttention(torch.nn.Module):
    """Block-sparse scaled dot-product attention over ``sparsity_config``'s layout (DeepSpeed's class name).

    No parameters and no buffers: swapping it into a model leaves the state dict as it was.

    ``causal=None`` follows the layout (``attention='unidirectional'`` -> causal). A length that is not a
    multiple of ``block`` is padded up to one with masked keys and the output cut back
    (``pad_to_block=True``, the default), or refused naming the lengths that work (``pad_to_block=False``).
    """

    def __init__(self, sparsity_config: SparsityConfig, causal: bool | None = None, pad_to_block: bool = True):
        super().__init__()
        if not isinstance(sparsity_config, SparsityConfig):
            raise TypeError(f"sparsity_config must be a SparsityConfig (Fixed, BigBird, BSLongformer, Variable, "
                            f"Dense, ...), got {type(sparsity_config).__name__}.")
        self.sparsity_config = sparsity_config
        self.causal = getattr(sparsity_config, "attention", "bidirectional") == "unidirectional" \
            if causal is None else check_flag("causal", causal)
        self.pad_to_block = check_flag("pad_to_block", pad_to_block)
        self._plans: dict[tuple, SparsePlan] = {}
        self._layouts: dict[int, torch.Tensor] = {}

    @property
    def block(self) -> int:
        return self.sparsity_config.block

    def padded_length(self, n: int) -> int:
        b = self.block
        if n % b and not self.pad_to_block:
            lo, hi = n // b * b, -(-n // b) * b
            raise ValueError(f"sequence length {n} is not a multiple of the sparse block size {b}: set the "
                             f"length (data.max_source_len) to a multiple of {b} such as {hi}"
                             f"{f' or {lo}' if lo else ''}, or pad_to_block=True.")
        return -(-n // b) * b

    def plan(self, n: int, device: torch.device | str = "cpu") -> SparsePlan:
        """The gather plan of a padded length ``n`` on ``device`` (made once per length and device, checked for
        empty rows when made)."""
        key = (n, torch.device(device))
        if key not in self._plans:
            cpu = (n, torch.device("cpu"))
            if cpu not in self._plans:
                # the (heads, blocks, blocks) layout is O(n^2) bools: made for the plan and dropped, not cached
                layout = self._layouts.get(n)
                if layout is None:
                    layout = self.sparsity_config.make_layout(self.padded_length(n))
                self._plans[cpu] = make_plan(layout, self.block, self.causal)
            self._plans[key] = self._plans[cpu].to(key[1])
        return self._plans[key]

    def layout(self, n: int) -> torch.Tensor:
        """The block layout (heads, blocks, blocks) of length ``n`` padded to the block, made once per length."""
        m = self.padded_length(n)
        if m not in self._layouts:
            self._layouts[m] = self.sparsity_config.make_layout(m)
        return self._layouts[m]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                bias: torch.Tensor | RelativeBias | None = None, key_padding_mask: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, scale: float | None = None,
                dropout_p: float = 0.0) -> torch.Tensor:
        """``query/key/value``: (batch, heads, n, head_dim); see ``block_sparse_attention`` for the rest."""
        B, H, n, _ = query.shape
        if key.shape[-2] != n:
            raise ValueError(f"self-attention only: {n} queries but {key.shape[-2]} keys.")
        if H != self.sparsity_config.num_heads:
            raise ValueError(f"the sparsity config was made for num_heads={self.sparsity_config.num_heads}, "
                             f"the attention has {H} heads.")
        m = self.padded_length(n)
        pad = m - n
        if pad:
            query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
            real = torch.arange(m, device=query.device) < n
            key_padding_mask = real.expand(B, m) if key_padding_mask is None else \
                F.pad(key_padding_mask.to(torch.bool), (0, pad), value=False)
            if isinstance(bias, torch.Tensor):
                bias = _pad_square(bias, n, pad)
            if attn_mask is not None:
                attn_mask = _pad_square(attn_mask.to(torch.bool), n, pad)
        out = block_sparse_attention(query, key, value, self.plan(m, query.device), bias=bias,
                                     key_padding_mask=key_padding_mask, attn_mask=attn_mask, causal=self.causal,
                                     scale=scale, dropout_p=dropout_p if self.training else 0.0)
        return out[:, :, :n] if pad else out


def _pad_square(t: torch.Tensor, n: int, pad: int) -> torch.Tensor:
    """Pad the (query, key) dimensions of a bias / mask that is broadcastable to (..., n, n)."""
    q, k = t.shape[-2], t.shape[-1]
    return F.pad(t, (0, pad if k == n else 0, 0, pad if q == n else 0))
