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
# (256 MiB: at 16k tokens of T5-small one chunk; smaller chunks cost ~16% time at 64 MiB, measured)
GATHER_CHUNK_BYTES = 256 << 20


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


class _GroupAttention(torch.autograd.Function):
    """One group's gather + scores + softmax + weighted sum, saving q, k, v and the probabilities only.

    [Note: backward re-gathers] Autograd would save the gathered key and value blocks, each key block copied
    once per row that sees it (blocks per row x the size of k and v); this backward gathers them again from the
    saved k and v, so what stays alive for backward is q, k, v, the probabilities and the mask. Forward and
    backward walk the rows in chunks of ``GATHER_CHUNK_BYTES`` of gathered blocks, which bounds the transient
    working set too.
    """

    @staticmethod
    def forward(ctx, qf, kf, vf, rows, key_rows, bias_g, allowed, scale, dropout_p):
        bias_dim = None if bias_g is None else bias_g.dim() - 3
        outs, all_probs, drops = [], [], []
        for sl, r, kr in _row_chunks(qf, rows, key_rows):
            qg, kg, vg = _gather(qf, kf, vf, r, kr)
            scores = torch.matmul(qg, kg.transpose(-1, -2))  # (B, rows, b, kmax * b)
            if scale != 1.0:
                scores = scores * scale
            if bias_g is not None:
                scores = scores + _rows_of(bias_g, sl, bias_dim).to(scores.dtype)
            scores = scores.masked_fill(~allowed[:, sl], torch.finfo(scores.dtype).min)
            # half precision: the softmax in fp32 (float64 stays float64)
            probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
            probs = probs.to(vf.dtype)
            del scores
            used = probs
            if dropout_p > 0.0:
                drop = torch.rand(probs.shape, device=probs.device) >= dropout_p
                used = probs * drop / (1.0 - dropout_p)
                drops.append(drop)
            outs.append(torch.matmul(used, vg))  # (B, rows, b, d)
            all_probs.append(probs)
        probs = torch.cat(all_probs, dim=1) if len(all_probs) > 1 else all_probs[0]
        drop = (torch.cat(drops, dim=1) if len(drops) > 1 else drops[0]) if drops else None
        ctx.save_for_backward(qf, kf, vf, rows, key_rows, allowed, probs, drop)
        ctx.scale, ctx.dropout_p = scale, dropout_p
        ctx.bias_meta = None if bias_g is None else (bias_g.shape, bias_g.dtype, bias_dim)
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, dout):
        qf, kf, vf, rows, key_rows, allowed, probs, drop = ctx.saved_tensors
        B, _, b, d = qf.shape
        want_bias = ctx.bias_meta is not None and ctx.needs_input_grad[5]
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        dbias = []
        for sl, r, kr in _row_chunks(qf, rows, key_rows):
            qg, kg, vg = _gather(qf, kf, vf, r, kr)
            p, do, keep = probs[:, sl], dout[:, sl], _rows_of(drop, sl, 1)
            used = p if keep is None else p * keep / (1.0 - ctx.dropout_p)
            dvg = torch.matmul(used.transpose(-1, -2), do)  # (B, rows, kmax * b, d)
            dp = torch.matmul(do, vg.transpose(-1, -2))  # (B, rows, b, kmax * b)
            if keep is not None:
                dp = dp * keep / (1.0 - ctx.dropout_p)
            acc = torch.promote_types(p.dtype, torch.float32)
            p32, dp = p.to(acc), dp.to(acc)
            ds = (p32 * (dp - (dp * p32).sum(-1, keepdim=True))).masked_fill(~allowed[:, sl], 0.0)
            if want_bias:
                shape, dtype, row_dim = ctx.bias_meta
                chunk_shape = list(shape)
                chunk_shape[row_dim] = r.numel()
                dbias.append(_sum_to(ds, torch.Size(chunk_shape)).to(dtype))
            ds = ds.to(qf.dtype)
            if ctx.scale != 1.0:
                ds = ds * ctx.scale
            dq.index_add_(1, r, torch.matmul(ds, kg))
            dk.index_add_(1, kr, torch.matmul(ds.transpose(-1, -2), qg).reshape(B, -1, b, d))
            dv.index_add_(1, kr, dvg.reshape(B, -1, b, d))
        db = None
        if want_bias:
            db = torch.cat(dbias, dim=ctx.bias_meta[2]) if len(dbias) > 1 else dbias[0]
        return dq, dk, dv, None, None, db, None, None, None


def _gather(qf, kf, vf, rows, key_rows):
    """The chunk's query blocks and its rows' key / value blocks (index_select: its backward would be
    index_add_, linear, where advanced indexing's is a sorted index_put_)."""
    B, _, b, d = qf.shape
    R = rows.numel()
    return (qf.index_select(1, rows), kf.index_select(1, key_rows).reshape(B, R, -1, d),
            vf.index_select(1, key_rows).reshape(B, R, -1, d))


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
        bias_g = None
        if isinstance(bias, RelativeBias):
            rel = kpos[:, None, :] - qpos[:, :, None] + bias.offset  # (R, b, kmax * b)
            table = bias.table
            if table.shape[0] > 1:
                rel = rel + g.heads[:, None, None] * table.shape[1]
            # int32: the index is saved for the table's gradient, as large as the scores
            idx = rel.flatten().to(torch.int32 if table.numel() < 2 ** 31 else torch.int64)
            bias_g = table.reshape(-1).index_select(0, idx).view(rel.shape)
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
        outs.append(_GroupAttention.apply(qf, kf, vf, g.rows, key_rows, bias_g, allowed, scale, dropout_p))
    out = torch.cat(outs, dim=1).index_select(1, plan.inverse)
    return out.reshape(B, H, n, d)
