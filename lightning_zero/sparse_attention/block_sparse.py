"""Block-sparse attention in plain PyTorch: each query block gathers its key blocks into one batched matmul.

[Note: rows grouped by width] A layout row (one query block of one head) sees ``c`` key blocks; padding
every row to the widest would make a Longformer's global row (it sees all ``n / block`` blocks) cost every
row O(n). Rows are therefore grouped by ``ceil(log2(c))``: each group is one gather + matmul + softmax +
matmul with at most twice the blocks it needs, at most ``log2(n / block) + 1`` groups, so the scores and
everything autograd saves are O(n * blocks per row * block) per head (the global rows add O(globals * n)).
The gathered slots past a row's ``c`` are masked.

Masked scores are filled with the dtype's most negative finite value (what HF's eager attention adds), not
-inf: a query that sees nothing (a padded query in a padded block) then averages its slots instead of
producing NaN, whose gradient would poison every parameter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RelativeBias:
    """An attention bias that depends only on ``key position - query position`` (T5's relative bias).

    ``table[h, offset + (k - q)]`` is head ``h``'s bias; ``(H, 2 n - 1)`` values instead of ``(H, n, n)``,
    gathered per block like the keys.
    """

    table: torch.Tensor  # (H, L)
    offset: int


@dataclass(frozen=True)
class _Group:
    rows: torch.Tensor  # (R,) flat row ids h * nb + i
    heads: torch.Tensor  # (R,)
    qblock: torch.Tensor  # (R,)
    cols: torch.Tensor  # (R, kmax) key block per slot (0 where padded)
    valid: torch.Tensor  # (R, kmax)


@dataclass(frozen=True)
class SparsePlan:
    """The gather indices of one layout (cached per sequence length by ``SparseSelfAttention``)."""

    num_heads: int
    num_blocks: int
    block: int
    groups: tuple  # every flat row h * nb + i in exactly one group

    def to(self, device: torch.device) -> "SparsePlan":
        if self.groups[0].rows.device == device:
            return self
        return SparsePlan(self.num_heads, self.num_blocks, self.block,
                          tuple(_Group(*(t.to(device) for t in (g.rows, g.heads, g.qblock, g.cols, g.valid)))
                                for g in self.groups))

    def blocks_per_row(self) -> float:
        return float(sum(g.valid.sum() for g in self.groups)) / (self.num_heads * self.num_blocks)


def _row_columns(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's allowed key blocks, in column order: (counts per row, all columns row after row). Read a slice
    of rows at a time: the layout is (rows, blocks) bools, the columns O(allowed blocks) -- a sort or a copy of
    the whole layout would be O(n^2) and, past 100k tokens, larger than the step itself."""
    step = max(1, (16 << 20) // max(1, flat.shape[1]))
    counts, cols = [], []
    for lo in range(0, flat.shape[0], step):
        nz = flat[lo:lo + step].nonzero()  # (allowed, 2), row-major: each row's columns in order
        counts.append(torch.bincount(nz[:, 0], minlength=min(step, flat.shape[0] - lo)))  # (a bool sum is int64)
        cols.append(nz[:, 1])
    return torch.cat(counts), torch.cat(cols)


def check_layout(layout: torch.Tensor, causal: bool = False) -> None:
    """Refuse a layout under which some query sees no key (its softmax would have nothing to normalise)."""
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"layout of shape {tuple(layout.shape)}: expected (heads, blocks, blocks).")
    H, nb, _ = layout.shape
    _check_rows(*_row_columns(layout.bool().reshape(H * nb, nb)), nb, causal)


def _check_rows(counts: torch.Tensor, cols: torch.Tensor, nb: int, causal: bool) -> None:
    empty = counts == 0
    if causal:
        # the first query of block i sees keys <= its own position: blocks 0..i only, so the row's first
        # allowed block must be at or before i
        starts = torch.cumsum(counts, 0) - counts
        first = cols[starts.clamp(max=max(len(cols) - 1, 0))] if len(cols) else torch.zeros_like(counts)
        empty |= first > torch.arange(len(counts)) % nb
    rows = empty.nonzero().flatten()
    if len(rows):
        h, i = divmod(int(rows[0]), nb)
        why = " at or before the diagonal (causal)" if causal else ""
        raise ValueError(f"the layout leaves {len(rows)} query block row(s) empty, first head {h} block {i}: "
                         f"every row needs at least one key block{why}; add a local window "
                         "(num_local_blocks / num_sliding_window_blocks) or global blocks.")


def make_plan(layout: torch.Tensor, block: int, causal: bool = False) -> SparsePlan:
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"layout of shape {tuple(layout.shape)}: expected (heads, blocks, blocks).")
    H, nb, _ = layout.shape
    counts, cols_all = _row_columns(layout.bool().cpu().reshape(H * nb, nb))
    _check_rows(counts, cols_all, nb, causal)
    starts = torch.cumsum(counts, 0) - counts
    width = torch.ceil(torch.log2(counts.double())).long()
    groups = []
    for w in torch.unique(width).tolist():
        rows = (width == w).nonzero().flatten()
        kmax = int(counts[rows].max())
        valid = torch.arange(kmax)[None, :] < counts[rows][:, None]
        at = (starts[rows][:, None] + torch.arange(kmax)[None, :]).clamp(max=len(cols_all) - 1)
        groups.append(_Group(rows, rows // nb, rows % nb, torch.where(valid, cols_all[at], 0), valid))
    return SparsePlan(H, nb, block, tuple(groups))


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    lead = t.dim() - len(shape)
    if lead:
        t = t.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t


# The gathered key/value blocks of this many bytes at most exist at a time: a group's rows are computed in
# chunks, so one layer's working set stays bounded however long the sequence ([Note: backward re-gathers]).
# 16 MiB: measured against 256 and 64 MiB at 4k-64k tokens of T5-small's shape, a lower peak and no slower
# (the smaller matmuls stay in cache); docs/sparse_attention.md.
GATHER_CHUNK_BYTES = 16 << 20


def _row_chunks(qf: torch.Tensor, rows: torch.Tensor, key_rows: torch.Tensor):
    B, _, b, d = qf.shape
    R = rows.numel()
    per_row = 2 * B * (key_rows.numel() // R) * b * d * qf.element_size()  # k and v blocks of one row
    step = max(1, GATHER_CHUNK_BYTES // per_row)
    kr = key_rows.view(R, -1)
    for lo in range(0, R, step):
        yield slice(lo, min(lo + step, R)), rows[lo:lo + step], kr[lo:lo + step].flatten()


def _rows_of(t: torch.Tensor | None, sl: slice, row_dim: int):
    return None if t is None else t[(slice(None),) * row_dim + (sl,)]


@dataclass(frozen=True)
class _RelIndex:
    """Where a group's scores read a ``RelativeBias`` table: rebuilt per chunk in forward and in backward
    instead of a (rows, b, kmax * b) index and bias kept for the whole group ([Note: the working set])."""

    qpos: torch.Tensor  # (R, b) query positions
    kpos: torch.Tensor  # (R, kmax * b) key positions
    base: torch.Tensor | None  # (R,) the row's head times the table's width; None: one table row for all heads
    offset: int

    def chunk(self, sl: slice, table: torch.Tensor) -> torch.Tensor:
        dtype = torch.int32 if table.numel() < 2 ** 31 else torch.int64
        idx = self.kpos[sl, None, :].to(dtype) - self.qpos[sl, :, None].to(dtype)
        idx += self.offset
        if self.base is not None:
            idx += self.base[sl, None, None].to(dtype)
        return idx  # (r, b, kmax * b)


@dataclass(frozen=True)
class _Part:
    """One group of the plan as the kernel walks it: its rows, their key blocks, what each row may see, where
    its scores read a ``RelativeBias`` (None without one) and the row dim of its dense bias (None without)."""

    rows: torch.Tensor  # (R,) flat row ids
    key_rows: torch.Tensor  # (R * kmax,) flat key block ids
    allowed: torch.Tensor  # (1 | B, R, b | 1, kmax * b) bool
    rel: _RelIndex | None
    bias_dim: int | None


class _BlockSparseAttention(torch.autograd.Function):
    """Every group's gather + scores + softmax + weighted sum in one function, saving q, k, v, the probabilities
    and the masks only.

    [Note: backward re-gathers] Autograd would save the gathered key and value blocks, each key block copied
    once per row that sees it (blocks per row x the size of k and v); this backward gathers them again from the
    saved k and v, so what stays alive for backward is q, k, v, the probabilities and the mask. Forward and
    backward walk the rows in chunks of ``GATHER_CHUNK_BYTES`` of gathered blocks, which bounds the transient
    working set too.

    [Note: the working set] What a step holds at a time is measured, not only what autograd saves
    (bench/sparse_attention.py, docs/sparse_attention.md). One function for all groups: q, k and v get one
    gradient each (one function per group gave each group its own, summed by autograd: three extra copies of
    q, k and v per group) and the rows' outputs are written in place into one output in row order (no
    concatenation and re-ordering copies). Within a chunk, the gathered key blocks and the gathered value
    blocks (each four times the scores at head dim 64 and block 16) are never alive together: keys freed
    before values are gathered; in backward the value gradient is reduced before the values are gathered and
    the key gradient after the keys are freed. The score-sized steps (scale, bias, mask, the softmax gradient)
    run in place, and a ``RelativeBias`` is read per chunk (``_RelIndex``): neither its index nor its
    gathered values exist for a whole group, or are saved.
    """

    @staticmethod
    def forward(ctx, qf, kf, vf, table, parts, scale, dropout_p, *bias_gs):
        B, rows_total, b, d = qf.shape
        out = qf.new_empty(B, rows_total, b, d)
        soft_dtype = torch.promote_types(qf.dtype, torch.float32)  # half precision: the softmax in fp32
        all_probs, all_drops = [], []
        for i, part in enumerate(parts):
            bias_g = bias_gs[i] if bias_gs else None
            R = part.rows.numel()
            width = part.key_rows.numel() // R * b
            probs = qf.new_empty(B, R, b, width)
            drop = torch.empty(B, R, b, width, dtype=torch.bool, device=qf.device) if dropout_p > 0.0 else None
            for sl, r, kr in _row_chunks(qf, part.rows, part.key_rows):
                kg = _gather_blocks(kf, kr, r.numel())
                scores = torch.matmul(qf.index_select(1, r), kg.transpose(-1, -2))  # (B, rows, b, kmax * b)
                del kg
                if scale != 1.0:
                    scores.mul_(scale)
                if bias_g is not None:
                    scores.add_(_rows_of(bias_g, sl, part.bias_dim).to(scores.dtype))
                if part.rel is not None:
                    idx = part.rel.chunk(sl, table)
                    scores.add_(table.reshape(-1).index_select(0, idx.flatten()).view(idx.shape).to(scores.dtype))
                    del idx
                scores.masked_fill_(~part.allowed[:, sl], torch.finfo(scores.dtype).min)
                p = torch.softmax(scores, dim=-1, dtype=soft_dtype)
                del scores
                probs[:, sl] = p
                if drop is not None:
                    keep = torch.rand(p.shape, device=p.device) >= dropout_p
                    drop[:, sl] = keep
                    p = p.to(vf.dtype).mul_(keep).div_(1.0 - dropout_p)
                    del keep
                vg = _gather_blocks(vf, kr, r.numel())
                out.index_copy_(1, r, torch.matmul(p.to(vf.dtype), vg))  # (B, rows, b, d)
                del p, vg
            all_probs.append(probs)
            all_drops.append(drop)
        masks = [t for part in parts for t in (part.rows, part.key_rows, part.allowed)]
        ctx.save_for_backward(qf, kf, vf, table, *masks, *all_probs, *all_drops)
        ctx.scale, ctx.dropout_p = scale, dropout_p
        ctx.parts = [(part.rel, part.bias_dim) for part in parts]  # the tensors are in saved_tensors
        ctx.bias_meta = [(g.shape, g.dtype) for g in bias_gs]
        return out

    @staticmethod
    def backward(ctx, dout):
        qf, kf, vf, table, *rest = ctx.saved_tensors
        n_parts = len(ctx.parts)
        masks, probs_all, drops_all = rest[:3 * n_parts], rest[3 * n_parts:4 * n_parts], rest[4 * n_parts:]
        B, _, b, d = qf.shape
        want_bias = bool(ctx.bias_meta) and any(ctx.needs_input_grad[7:])
        want_table = table is not None and ctx.needs_input_grad[3]
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        dtable = torch.zeros(table.shape, dtype=table.dtype, device=table.device) if want_table else None
        dbias_all = []
        for i, (rel, bias_dim) in enumerate(ctx.parts):
            rows, key_rows, allowed = masks[3 * i:3 * i + 3]
            probs, drop = probs_all[i], drops_all[i]
            dbias = []
            for sl, r, kr in _row_chunks(qf, rows, key_rows):
                R = r.numel()
                p, do, keep = probs[:, sl], dout.index_select(1, r), _rows_of(drop, sl, 1)
                used = p if keep is None else p * keep / (1.0 - ctx.dropout_p)
                dv.index_add_(1, kr, torch.matmul(used.transpose(-1, -2), do).reshape(B, -1, b, d))
                del used
                vg = _gather_blocks(vf, kr, R)
                dp = torch.matmul(do, vg.transpose(-1, -2))  # (B, rows, b, kmax * b)
                del vg, do
                if keep is not None:
                    dp.mul_(keep).div_(1.0 - ctx.dropout_p)
                acc = torch.promote_types(p.dtype, torch.float32)
                p32, dp = p.to(acc), dp.to(acc)
                # softmax's gradient p * (dp - sum(dp * p)), the row sums as a matmul (no score-sized product)
                row = torch.matmul(dp.unsqueeze(-2), p32.unsqueeze(-1)).squeeze(-1)
                ds = dp.sub_(row).mul_(p32).masked_fill_(~allowed[:, sl], 0.0)
                del row, p32
                if want_bias:
                    shape, dtype = ctx.bias_meta[i]
                    chunk_shape = list(shape)
                    chunk_shape[bias_dim] = R
                    db = _sum_to(ds, torch.Size(chunk_shape)).to(dtype)
                    dbias.append(db.clone() if db.data_ptr() == ds.data_ptr() else db)  # ds is scaled in place
                if want_table:
                    idx = rel.chunk(sl, table)
                    dtable.view(-1).index_add_(0, idx.flatten(), ds.sum(0).flatten().to(table.dtype))
                    del idx
                ds = ds.to(qf.dtype)
                if ctx.scale != 1.0:
                    ds.mul_(ctx.scale)
                kg = _gather_blocks(kf, kr, R)
                dq.index_add_(1, r, torch.matmul(ds, kg))
                del kg
                dk.index_add_(1, kr, torch.matmul(ds.transpose(-1, -2), qf.index_select(1, r)).reshape(B, -1, b, d))
                del ds
            if want_bias:
                dbias_all.append(torch.cat(dbias, dim=bias_dim) if len(dbias) > 1 else dbias[0])
        return (dq, dk, dv, dtable, None, None, None, *(dbias_all if want_bias else [None] * len(ctx.bias_meta)))


def _gather_blocks(t: torch.Tensor, key_rows: torch.Tensor, rows: int) -> torch.Tensor:
    """The chunk's rows' key (or value) blocks, (B, rows, kmax * b, d) (index_select: its backward would be
    index_add_, linear, where advanced indexing's is a sorted index_put_)."""
    B, _, b, d = t.shape
    return t.index_select(1, key_rows).reshape(B, rows, -1, d)


def _as_4d(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t[(None,) * (4 - t.dim())] if t.dim() < 4 else t
    return t.expand(*t.shape[:2], n, n)


def _gather_dense(t: torch.Tensor, g: _Group, nb: int, b: int) -> torch.Tensor:
    """(Bt, H or 1, n, n) -> (Bt, R, b, kmax * b): the bias / mask entries of the group's blocks."""
    Bt, Ht = t.shape[:2]
    blocks = t.reshape(Bt, Ht, nb, b, nb, b).permute(0, 1, 2, 4, 3, 5)  # (Bt, Ht, i, j, b, b)
    heads = g.heads if Ht > 1 else torch.zeros_like(g.heads)
    out = blocks[:, heads[:, None], g.qblock[:, None], g.cols]  # (Bt, R, kmax, b, b)
    return out.permute(0, 1, 3, 2, 4).reshape(Bt, len(g.rows), b, -1)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SparsePlan, *,
                           bias: torch.Tensor | RelativeBias | None = None,
                           key_padding_mask: torch.Tensor | None = None,
                           attn_mask: torch.Tensor | None = None, causal: bool = False,
                           scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of ``q, k, v`` (batch, heads, n, head_dim) over the blocks ``plan`` allows.

    ``bias``: added to the scores -- a tensor broadcastable to (batch, heads, n, n) or a ``RelativeBias``;
    ``key_padding_mask``: (batch, n) bool, True where the key is a real token; ``attn_mask``: bool,
    broadcastable to (batch, heads, n, n), True where attention is allowed; ``causal``: keys after the
    query are masked. ``n`` must be ``plan.num_blocks * plan.block`` (``SparseSelfAttention`` pads).
    """
    B, H, n, d = q.shape
    nb, b = plan.num_blocks, plan.block
    if n != nb * b or H != plan.num_heads:
        raise ValueError(f"q has {H} heads x {n} tokens but the plan was made for {plan.num_heads} heads x "
                         f"{nb * b} tokens ({nb} blocks of {b}).")
    plan = plan.to(q.device)
    scale = d ** -0.5 if scale is None else scale
    qf = q.reshape(B, H * nb, b, d)
    kf = k.reshape(B, H * nb, b, d)
    vf = v.reshape(B, H * nb, b, d)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool).reshape(B, nb, b)
    if bias is not None and not isinstance(bias, RelativeBias):
        bias = _as_4d(bias, n)
    if attn_mask is not None:
        attn_mask = _as_4d(attn_mask.to(torch.bool), n)
    pos = torch.arange(b, device=q.device)
    table = bias.table.contiguous() if isinstance(bias, RelativeBias) else None  # (H, 2n - 1): read flat per chunk
    parts, bias_gs = [], []
    for g in plan.groups:
        R, kmax = g.cols.shape
        key_rows = (g.heads[:, None] * nb + g.cols).flatten()  # flat key block ids, kmax per row
        qpos = g.qblock[:, None] * b + pos  # (R, b)
        kpos = (g.cols[:, :, None] * b + pos).reshape(R, kmax * b)  # (R, kmax * b)
        rel, bias_dim = None, None
        if table is not None:
            rel = _RelIndex(qpos, kpos, g.heads * table.shape[1] if table.shape[0] > 1 else None, bias.offset)
        elif bias is not None:
            bias_gs.append(_gather_dense(bias, g, nb, b))
            bias_dim = bias_gs[-1].dim() - 3
        allowed = g.valid.repeat_interleave(b, dim=1)[:, None, :]  # (R, 1, kmax * b)
        if causal:
            allowed = allowed & (kpos[:, None, :] <= qpos[:, :, None])
        allowed = allowed.unsqueeze(0)  # (1, R, b | 1, kmax * b)
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, g.cols].reshape(B, R, 1, kmax * b)
        if attn_mask is not None:
            allowed = allowed & _gather_dense(attn_mask, g, nb, b)
        parts.append(_Part(g.rows, key_rows, allowed, rel, bias_dim))
    out = _BlockSparseAttention.apply(qf, kf, vf, table, parts, scale, dropout_p, *bias_gs)
    return out.reshape(B, H, n, d)
