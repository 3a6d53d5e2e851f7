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
    groups: tuple
    inverse: torch.Tensor  # position of flat row r in the concatenated group outputs

    def to(self, device: torch.device) -> "SparsePlan":
        if self.inverse.device == device:
            return self
        return SparsePlan(self.num_heads, self.num_blocks, self.block,
                          tuple(_Group(*(t.to(device) for t in (g.rows, g.heads, g.qblock, g.cols, g.valid)))
                                for g in self.groups), self.inverse.to(device))

    def blocks_per_row(self) -> float:
        return float(sum(g.valid.sum() for g in self.groups)) / (self.num_heads * self.num_blocks)


def check_layout(layout: torch.Tensor, causal: bool = False) -> None:
    """Refuse a layout under which some query sees no key (its softmax would have nothing to normalise)."""
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"layout of shape {tuple(layout.shape)}: expected (heads, blocks, blocks).")
    layout = layout.bool()
    if causal:
        # the first query of block i sees keys <= its own position: blocks 0..i only
        layout = layout & torch.ones_like(layout[0]).tril()
    empty = (~layout.any(-1)).nonzero()
    if len(empty):
        h, i = (int(x) for x in empty[0])
        why = " at or before the diagonal (causal)" if causal else ""
        raise ValueError(f"the layout leaves {len(empty)} query block row(s) empty, first head {h} block {i}: "
                         f"every row needs at least one key block{why}; add a local window "
                         "(num_local_blocks / num_sliding_window_blocks) or global blocks.")


def make_plan(layout: torch.Tensor, block: int, causal: bool = False) -> SparsePlan:
    check_layout(layout, causal)
    layout = layout.bool().cpu()
    H, nb, _ = layout.shape
    flat = layout.reshape(H * nb, nb)
    counts = flat.sum(-1)
    width = torch.ceil(torch.log2(counts.double())).long()
    groups, order = [], []
    for w in torch.unique(width).tolist():
        rows = (width == w).nonzero().flatten()
        kmax = int(counts[rows].max())
        # stable sort puts each row's allowed blocks first, in column order
        cols = torch.sort((~flat[rows]).to(torch.int8), dim=-1, stable=True).indices[:, :kmax]
        valid = torch.arange(kmax)[None, :] < counts[rows][:, None]
        groups.append(_Group(rows, rows // nb, rows % nb, torch.where(valid, cols, 0), valid))
        order.append(rows)
    inverse = torch.empty(H * nb, dtype=torch.long)
    inverse[torch.cat(order)] = torch.arange(H * nb)
    return SparsePlan(H, nb, block, tuple(groups), inverse)


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


class _GroupAttention(torch.autograd.Function):
    """One group's gather + scores + softmax + weighted sum, saving q, k, v and the probabilities only.

    [Note: backward re-gathers] Autograd would save the gathered key and value blocks, each key block copied
    once per row that sees it (blocks per row x the size of k and v); this backward gathers them again from the
    saved k and v, so what stays alive for backward is q, k, v, the probabilities and the mask. Forward and
    backward walk the rows in chunks of ``GATHER_CHUNK_BYTES`` of gathered blocks, which bounds the transient
    working set too.

    [Note: the working set] What one chunk holds at a time is measured, not only what autograd saves
    (bench/sparse_attention.py, docs/sparse_attention.md): the gathered key blocks and the gathered value
    blocks are each four times the scores at head dim 64 and block 16, so at most one of them is alive at a
    time (keys freed before the values are gathered; in backward the value gradient is reduced before the
    values are gathered and the key gradient after the keys are freed); the score-sized steps (scale, bias,
    mask, the softmax gradient) run in place; probabilities and outputs are written into one preallocated
    tensor each rather than concatenated; a ``RelativeBias`` is read per chunk (``_RelIndex``), so neither its
    index nor its gathered values exist for the whole group or are saved.
    """

    @staticmethod
    def forward(ctx, qf, kf, vf, rows, key_rows, bias_g, table, rel, allowed, scale, dropout_p):
        B, _, b, d = qf.shape
        R, width = rows.numel(), key_rows.numel() // rows.numel() * b
        bias_dim = None if bias_g is None else bias_g.dim() - 3
        out = qf.new_empty(B, R, b, d)
        probs = qf.new_empty(B, R, b, width)
        drop = torch.empty(B, R, b, width, dtype=torch.bool, device=qf.device) if dropout_p > 0.0 else None
        soft_dtype = torch.promote_types(qf.dtype, torch.float32)  # half precision: the softmax in fp32
        for sl, r, kr in _row_chunks(qf, rows, key_rows):
            qg = qf.index_select(1, r)
            kg = _gather_blocks(kf, kr, r.numel())
            scores = torch.matmul(qg, kg.transpose(-1, -2))  # (B, rows, b, kmax * b)
            del qg, kg
            if scale != 1.0:
                scores.mul_(scale)
            if bias_g is not None:
                scores.add_(_rows_of(bias_g, sl, bias_dim).to(scores.dtype))
            if rel is not None:
                idx = rel.chunk(sl, table)
                scores.add_(table.reshape(-1).index_select(0, idx.flatten()).view(idx.shape).to(scores.dtype))
                del idx
            scores.masked_fill_(~allowed[:, sl], torch.finfo(scores.dtype).min)
            p = torch.softmax(scores, dim=-1, dtype=soft_dtype)
            del scores
            probs[:, sl] = p
            if drop is not None:
                keep = torch.rand(p.shape, device=p.device) >= dropout_p
                drop[:, sl] = keep
                p = p.to(vf.dtype).mul_(keep).div_(1.0 - dropout_p)
                del keep
            vg = _gather_blocks(vf, kr, r.numel())
            out[:, sl] = torch.matmul(p.to(vf.dtype), vg)  # (B, rows, b, d)
            del p, vg
        ctx.save_for_backward(qf, kf, vf, rows, key_rows, allowed, probs, drop, table)
        ctx.scale, ctx.dropout_p, ctx.rel = scale, dropout_p, rel
        ctx.bias_meta = None if bias_g is None else (bias_g.shape, bias_g.dtype, bias_dim)
        return out

    @staticmethod
    def backward(ctx, dout):
        qf, kf, vf, rows, key_rows, allowed, probs, drop, table = ctx.saved_tensors
        B, _, b, d = qf.shape
        want_bias = ctx.bias_meta is not None and ctx.needs_input_grad[5]
        want_table = ctx.rel is not None and ctx.needs_input_grad[6]
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        dtable = torch.zeros_like(table) if want_table else None
        dbias = []
        for sl, r, kr in _row_chunks(qf, rows, key_rows):
            R = r.numel()
            p, do, keep = probs[:, sl], dout[:, sl], _rows_of(drop, sl, 1)
            used = p if keep is None else p * keep / (1.0 - ctx.dropout_p)
            dv.index_add_(1, kr, torch.matmul(used.transpose(-1, -2), do).reshape(B, -1, b, d))
            del used
            vg = _gather_blocks(vf, kr, R)
            dp = torch.matmul(do, vg.transpose(-1, -2))  # (B, rows, b, kmax * b)
            del vg
            if keep is not None:
                dp.mul_(keep).div_(1.0 - ctx.dropout_p)
            acc = torch.promote_types(p.dtype, torch.float32)
            p32, dp = p.to(acc), dp.to(acc)
            # softmax's gradient p * (dp - sum(dp * p)), the row sums as a matmul (no score-sized product)
            row = torch.matmul(dp.unsqueeze(-2), p32.unsqueeze(-1)).squeeze(-1)
            ds = dp.sub_(row).mul_(p32).masked_fill_(~allowed[:, sl], 0.0)
            del row, p32
            if want_bias:
                shape, dtype, row_dim = ctx.bias_meta
                chunk_shape = list(shape)
                chunk_shape[row_dim] = R
                db = _sum_to(ds, torch.Size(chunk_shape)).to(dtype)
                dbias.append(db.clone() if db.data_ptr() == ds.data_ptr() else db)  # ds is scaled in place below
            if want_table:
                idx = ctx.rel.chunk(sl, table)
                dtable.view(-1).index_add_(0, idx.flatten(), ds.sum(0).flatten().to(table.dtype))
                del idx
            ds = ds.to(qf.dtype)
            if ctx.scale != 1.0:
                ds.mul_(ctx.scale)
            kg = _gather_blocks(kf, kr, R)
            dq.index_add_(1, r, torch.matmul(ds, kg))
            del kg
            qg = qf.index_select(1, r)
            dk.index_add_(1, kr, torch.matmul(ds.transpose(-1, -2), qg).reshape(B, -1, b, d))
            del qg, ds
        db = None
        if want_bias:
            db = torch.cat(dbias, dim=ctx.bias_meta[2]) if len(dbias) > 1 else dbias[0]
        return dq, dk, dv, None, None, db, dtable, None, None, None, None


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
    outs = []
    for g in plan.groups:
        R, kmax = g.cols.shape
        key_rows = (g.heads[:, None] * nb + g.cols).flatten()  # flat key block ids, kmax per row
        qpos = g.qblock[:, None] * b + pos  # (R, b)
        kpos = (g.cols[:, :, None] * b + pos).reshape(R, kmax * b)  # (R, kmax * b)
        bias_g, table, rel = None, None, None
        if isinstance(bias, RelativeBias):
            table = bias.table.contiguous()  # small (H, 2n - 1); read flat per chunk
            rel = _RelIndex(qpos, kpos, g.heads * table.shape[1] if table.shape[0] > 1 else None, bias.offset)
        elif bias is not None:
            bias_g = _gather_dense(bias, g, nb, b)
        allowed = g.valid.repeat_interleave(b, dim=1)[:, None, :]  # (R, 1, kmax * b)
        if causal:
            allowed = allowed & (kpos[:, None, :] <= qpos[:, :, None])
        allowed = allowed.unsqueeze(0)  # (1, R, b | 1, kmax * b)
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, g.cols].reshape(B, R, 1, kmax * b)
        if attn_mask is not None:
            allowed = allowed & _gather_dense(attn_mask, g, nb, b)
        outs.append(_GroupAttention.apply(qf, kf, vf, g.rows, key_rows, bias_g, table, rel, allowed, scale,
                                          dropout_p))
    out = torch.cat(outs, dim=1).index_select(1, plan.inverse)
    return out.reshape(B, H, n, d)
