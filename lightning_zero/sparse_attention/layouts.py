"""DeepSpeed's block-sparse layouts (``deepspeed/ops/sparse_attention/sparsity_config.py``, v0.14), in torch.

Same class names, constructor parameters, defaults and meaning, so a DeepSpeed ``sparse_attention`` section
maps one to one. Two differences, both for reproducibility across ranks: random blocks come from a
``torch.Generator`` seeded with ``seed`` (DeepSpeed used Python's global ``random``, so every rank drew its
own layout), and ``make_layout`` returns a bool tensor (DeepSpeed: int64 0/1).

A layout is ``(num_heads, num_blocks, num_blocks)``: entry ``[h, i, j]`` says the queries of block ``i`` in
head ``h`` see the keys of block ``j``. Blocks only; the causal mask inside a diagonal block is the
attention's ``causal`` flag (DeepSpeed applied it through ``attn_mask``).

Every knob is checked when the config is built (``layout_checks.py``): DeepSpeed took a negative count, a
string flag or a negative index as given.

[Note: counts past a short sequence] A sliding window, a random-block count or BigBird's global count larger
than the blocks of the sequence covers the whole sequence here; DeepSpeed raised, which with dynamic padding
(a batch as long as its longest input, the recipe's) stopped a run mid-epoch at the first short batch. At
every length where DeepSpeed made a layout the layouts are the same.
"""
from __future__ import annotations

import torch

from lightning_zero.sparse_attention.layout_checks import (check_attention, check_flag, check_global_ranges,
                                                           check_horizontal, check_int, check_int_list)


class SparsityConfig:
    """Shared part of every layout: the head count, the block size and whether heads differ."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False, seed: int = 0):
        self.num_heads = check_int("num_heads", num_heads, 1)
        self.block = check_int("block", block, 1)
        self.different_layout_per_head = check_flag("different_layout_per_head", different_layout_per_head)
        self.num_layout_heads = self.num_heads if different_layout_per_head else 1
        self.seed = check_int("seed", seed, 0)

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        if seq_len % self.block != 0:
            raise ValueError(f"sequence length {seq_len} is not a multiple of the block size {self.block}: "
                             f"pad it to {-(-seq_len // self.block) * self.block} (SparseSelfAttention does with "
                             "pad_to_block=True) or choose a block that divides it.")
        nb = seq_len // self.block
        return torch.zeros((self.num_heads, nb, nb), dtype=torch.bool)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """DeepSpeed's recipe: each layout head filled by :meth:`head_layout` (random blocks from one seeded
        generator, in head order), then head 0's layout copied to all heads unless they differ."""
        layout = self.setup_layout(seq_len)
        gen = self._generator()
        for h in range(self.num_layout_heads):
            self.head_layout(h, layout, gen)
        return self.check_and_propagate_first_head_layout(layout)

    def head_layout(self, h: int, layout: torch.Tensor, gen: torch.Generator) -> None:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> str:
        """One line for a run's summary: the layout's name, its block and every option it was built with."""
        name = next((k for k, cls in LAYOUTS.items() if type(self) is cls), type(self).__name__)
        opts = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                         if k not in ("num_heads", "block", "num_layout_heads"))
        return f"{name} layout, block {self.block}" + (f" ({opts})" if opts else "")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "num_layout_heads")
        return f"{type(self).__name__}({fields})"


class DenseSparsityConfig(SparsityConfig):
    """Every block: dense attention computed block-wise (the reference layout)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = True
        return layout


class FixedSparsityConfig(SparsityConfig):
    """Child et al. 2019's "fixed" pattern: local windows of ``num_local_blocks``, the last
    ``num_global_blocks`` of each window seen by all (and, horizontally, seeing all)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1,
                 seed: int = 0):
        super().__init__(num_heads, block, different_layout_per_head, seed)
        check_int("num_local_blocks", num_local_blocks, 1)
        check_int("num_global_blocks", num_global_blocks, 1)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"num_local_blocks={num_local_blocks} must be a multiple of "
                             f"num_global_blocks={num_global_blocks}.")
        check_attention(attention)
        check_horizontal(horizontal_global_attention, attention)
        check_int("num_different_global_patterns", num_different_global_patterns, 1)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(f"num_different_global_patterns={num_different_global_patterns} needs "
                             "different_layout_per_head=True (one layout is shared by all heads otherwise).")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns={num_different_global_patterns} cannot exceed "
                             f"num_local_blocks // num_global_blocks = {num_local_blocks // num_global_blocks}.")
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        for i in range(0, nb, self.num_local_blocks):
            end = min(i + self.num_local_blocks, nb)
            for row in range(i, end):
                layout[h, row, i:(row + 1 if self.attention == "unidirectional" else end)] = True
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        first = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        end = nb - (nb % self.num_local_blocks)
        for i in range(first, end, self.num_local_blocks):
            first_row = 0 if self.attention == "bidirectional" else i
            layout[h, first_row:, i:i + self.num_global_blocks] = True
            if self.horizontal_global_attention:
                layout[h, i:i + self.num_global_blocks, :] = True
        if end < nb:  # a short last window still gets its global blocks
            start = max(0, min(end + first, nb - self.num_global_blocks))  # a sequence shorter than them: 0
            stop = start + self.num_global_blocks
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:stop] = True
            if self.horizontal_global_attention:
                layout[h, start:stop, :] = True
        return layout

    def head_layout(self, h: int, layout: torch.Tensor, gen: torch.Generator) -> None:
        self.set_local_layout(h, layout)
        self.set_global_layout(h, layout)


class VariableSparsityConfig(SparsityConfig):
    """Fixed with random blocks, a list of local window sizes and explicit global block indices."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks=(4,), global_block_indices=(0,),
                 global_block_end_indices=None, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, seed: int = 0):
        super().__init__(num_heads, block, different_layout_per_head, seed)
        self.num_random_blocks = check_int("num_random_blocks", num_random_blocks, 0)
        self.local_window_blocks = check_int_list("local_window_blocks", local_window_blocks, 1, empty=False)
        self.global_block_indices = check_int_list("global_block_indices", global_block_indices, 0, empty=True)
        self.global_block_end_indices = check_global_ranges(self.global_block_indices, global_block_end_indices)
        self.attention = check_attention(attention)
        self.horizontal_global_attention = check_horizontal(horizontal_global_attention, attention)

    def set_random_layout(self, h: int, layout: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        nb = layout.shape[1]
        if self.num_random_blocks:  # more than the row has: the whole row ([Note: counts past a short sequence])
            for row in range(nb):
                layout[h, row, torch.randperm(nb, generator=gen)[:self.num_random_blocks]] = True
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        start = end = 0
        uni = self.attention == "unidirectional"
        for size in self.local_window_blocks:
            end = min(end + size, nb)
            for row in range(start, end):
                layout[h, row, start:(row + 1 if uni else end)] = True
            start += size
        size = self.local_window_blocks[-1]  # the last size repeats over the rest of the sequence
        for i in range(start, nb, size):
            end = min(i + size, nb)
            for row in range(i, end):
                layout[h, row, i:(row + 1 if uni else end)] = True
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for s, e in zip(self.global_block_indices, ends):
            if s < nb:
                e = min(e, nb)
                if self.horizontal_global_attention:
                    layout[h, s:e, :] = True
                layout[h, (0 if self.attention == "bidirectional" else s):, s:e] = True
        return layout

    def head_layout(self, h: int, layout: torch.Tensor, gen: torch.Generator) -> None:
        self.set_random_layout(h, layout, gen)
        self.set_local_layout(h, layout)
        self.set_global_layout(h, layout)


def _sliding_window(layout: torch.Tensor, h: int, window: int, causal: bool = False) -> torch.Tensor:
    # a window wider than the sequence covers all of it ([Note: counts past a short sequence]); an even window
    # reaches window // 2 blocks each side, as DeepSpeed's (window 4 covers 5 blocks)
    nb = layout.shape[1]
    w = window // 2
    for row in range(nb):
        layout[h, row, max(0, row - w):(row + 1 if causal else min(row + w + 1, nb))] = True
    return layout


class BigBirdSparsityConfig(SparsityConfig):
    """Zaheer et al. 2020: random blocks, a sliding window and the first ``num_global_blocks`` global."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional", seed: int = 0):
        super().__init__(num_heads, block, different_layout_per_head, seed)
        self.num_random_blocks = check_int("num_random_blocks", num_random_blocks, 0)
        self.num_sliding_window_blocks = check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.num_global_blocks = check_int("num_global_blocks", num_global_blocks, 1)
        self.attention = check_attention(attention)

    def set_random_layout(self, h: int, layout: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        nb = layout.shape[1]
        for row in range(nb):  # more than a row has: the whole row ([Note: counts past a short sequence])
            span = nb if self.attention == "bidirectional" else row + 1
            layout[h, row, torch.randperm(span, generator=gen)[:self.num_random_blocks]] = True
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        return _sliding_window(layout, h, self.num_sliding_window_blocks)

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        layout[h, :self.num_global_blocks, :] = True  # past a short sequence: all of it
        layout[h, :, :self.num_global_blocks] = True
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def head_layout(self, h: int, layout: torch.Tensor, gen: torch.Generator) -> None:
        self.set_random_layout(h, layout, gen)
        self.set_sliding_window_layout(h, layout)
        self.set_global_layout_itc(h, layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Beltagy et al. 2020, block-wise: a sliding window plus global blocks that see and are seen by all."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices=(0,), global_block_end_indices=None,
                 attention: str = "bidirectional", seed: int = 0):
        super().__init__(num_heads, block, different_layout_per_head, seed)
        self.num_sliding_window_blocks = check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.global_block_indices = check_int_list("global_block_indices", global_block_indices, 0, empty=True)
        self.global_block_end_indices = check_global_ranges(self.global_block_indices, global_block_end_indices)
        self.attention = check_attention(attention)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        return _sliding_window(layout, h, self.num_sliding_window_blocks)

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for s, e in zip(self.global_block_indices, ends):
            if s < nb:
                layout[h, s:min(e, nb), :] = True
                layout[h, :, s:min(e, nb)] = True
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def head_layout(self, h: int, layout: torch.Tensor, gen: torch.Generator) -> None:
        self.set_sliding_window_layout(h, layout)
        self.set_global_layout(h, layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window only (causal by default, as DeepSpeed's)."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional", seed: int = 0):
        super().__init__(num_heads, block, False, seed)
        self.num_sliding_window_blocks = check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.attention = check_attention(attention)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        _sliding_window(layout, 0, self.num_sliding_window_blocks, causal=self.attention == "unidirectional")
        return self.check_and_propagate_first_head_layout(layout)


LAYOUTS = {"dense": DenseSparsityConfig, "fixed": FixedSparsityConfig, "variable": VariableSparsityConfig,
           "bigbird": BigBirdSparsityConfig, "bslongformer": BSLongformerSparsityConfig,
           "local": LocalSlidingWindowSparsityConfig}


def make_sparsity_config(layout: str, num_heads: int, block: int = 16, **options) -> SparsityConfig:
    """A layout by name (``model.sparse.layout`` in the recipe); unknown names and options are refused."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"sparse layout {layout!r}: allowed {', '.join(LAYOUTS)}.")
    cls = LAYOUTS[layout]
    try:
        return cls(num_heads=num_heads, block=block, **options)
    except TypeError as e:
        import inspect

        allowed = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "num_heads", "block")]
        raise ValueError(f"sparse layout {layout!r} options {sorted(options)}: {e}; allowed options: "
                         f"{', '.join(allowed)}.") from e
