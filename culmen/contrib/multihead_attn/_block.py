"""Self-attention as one autograd node: input projection, attention and output projection together.

The chain ``linear -> attention -> linear`` costs the eager host three autograd nodes plus the view
nodes between them, and every per-call view, select and transpose goes through the dispatcher again in
the backward. ``SelfAttnBlock`` does the same work inside a single ``autograd.Function`` whose
backward is written out (two GEMMs and a column sum per projection, the attention kernels in the
middle), with everything derived from the call signature kept in a cached ``BlockPlan``: the attention
plan, the sizes and strides of the q / k / v views inside the packed projection, and the index tensors
the key-padding path needs. Device work is the chain's: the same GEMMs and kernels, one copy of the
context into sequence-first rows for the output projection, one stacking of the three head gradients
into the packed layout of the input projection's gradient.

Key padding without a host sync: every key gets a sort key (its batch row, or ``B`` when padded) and a
stable sort of the batch-major keys puts the kept keys first, batch by batch, padding last; the
boundaries of the runs (``searchsorted`` of ``0..B``) are ``cu_seqlens_k``, and the sorted keys equal to
``B`` flag the packed rows that belong to no sequence (their gradients are set to 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.ops.attention.launch import AttnPlan
from culmen.ops.common.function import raw_apply
from culmen.ops.common.plans import PlanCache

BLOCKS = PlanCache("multihead_attn_block")


class BlockPlan:
    """What a self-attention call derives from its signature: sizes, the views' geometry, the attention
    plan and (key padding) the cached index tensors. ``padded``: key-padding mask; else dense (``causal``
    or not)."""

    __slots__ = ("s", "b", "e", "h", "d", "sb", "padded", "attn", "q_size", "qkv_st", "row_st", "kv_size",
                 "kv_st", "ctx_size", "ctx_st", "q_st", "batch_ids", "rowmap", "bounds", "cu_q")

    def __init__(self, x: Tensor, heads: int, padded: bool, causal: bool, dropout_p: float) -> None:
        s, b, e = x.shape
        h, d = heads, e // heads
        self.s, self.b, self.e, self.h, self.d, self.sb, self.padded = s, b, e, h, d, s * b, padded
        dev, dt = x.device, x.dtype
        # q / k / v of the packed (seq * batch, 3E) projection, per head (q, k, v) triples, as (B, s, h, d).
        self.q_size = (b, s, h, d)
        self.qkv_st = (3 * e, b * 3 * e, 3 * d, 1)
        self.ctx_size = (s, b, e)
        self.ctx_st = (e, s * e, 1)  # a (B, s, E) batch-major tensor read as (s, B, E)
        self.q_st = (e, b * e, d, 1)  # a seq-major (s * B, E) tensor read as (B, s, h, d)
        scale = d ** -0.5
        qkv = torch.empty(self.sb, 3 * e, dtype=dt, device=dev)
        if not padded:
            q, k, v = self.views(qkv)
            self.attn = AttnPlan("dense", q, k, v, None, dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                                 return_lse=True)
            return
        # The (key, value) parts of each packed row, gathered by row: (seq * batch, h, 2, d).
        self.kv_size, self.kv_st = (self.sb, h, 2, d), (3 * e, 3 * d, d, 1)
        flat = torch.arange(self.sb, device=dev)
        self.batch_ids = (flat // s).to(torch.int32)  # batch row of each batch-major key
        self.rowmap = (flat % s) * b + flat // s  # batch-major key -> its row in the seq-major projection
        self.bounds = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
        q = qkv.new_empty(self.sb, h, d)
        kv = qkv.new_empty(self.sb, h, 2, d)
        self.attn = AttnPlan("varlen", q, kv[:, :, 0], kv[:, :, 1], None, self.cu_q, self.cu_q, s, s,
                             dropout_p=dropout_p, softmax_scale=scale, causal=False, return_lse=True)

    def views(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``(B, s, h, d)`` inside the packed projection ``(s * B, 3E)`` (storage offset 0)."""
        size, st, d = self.q_size, self.qkv_st, self.d
        return (qkv.as_strided(size, st, 0), qkv.as_strided(size, st, d), qkv.as_strided(size, st, 2 * d))

    def key_order(self, pad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(src, sorted_keys, cu_k)`` of a boolean padding mask ``(B, s)`` (True = padded): ``src`` the
        projection row of each packed key (kept keys first, batch by batch), ``cu_k`` int32 ``(B + 1,)``."""
        keys = torch.where(pad.reshape(-1), self.b, self.batch_ids)
        skeys, order = torch.sort(keys, stable=True)
        return self.rowmap.index_select(0, order), skeys, torch.searchsorted(skeys, self.bounds, out_int32=True)


def block_plan(x: Tensor, heads: int, padded: bool, causal: bool, dropout_p: float) -> BlockPlan:
    """The cached ``BlockPlan`` of a call signature (the caller has validated the arguments)."""
    key = (x.shape, x.dtype, x.device, heads, padded, causal, dropout_p)
    bp = BLOCKS.get(key)
    if bp is None:
        bp = BLOCKS.put(key, BlockPlan(x, heads, padded, causal, dropout_p))
    return bp


def block_forward(bp: BlockPlan, rng: Tensor | None, x: Tensor, in_w: Tensor, in_b: Tensor | None, out_w: Tensor,
                  out_b: Tensor | None, residual: Tensor | None, src: Tensor | None, cu_k: Tensor | None,
                  store_lse: bool) -> tuple[Tensor, tuple]:
    """The block's forward without autograd: ``(y (s, B, E), tensors the backward needs)``; the
    attention's log-sum-exp is only written when ``store_lse`` (inference skips it)."""
    x2 = x.reshape(bp.sb, bp.e)
    qkv = F.linear(x2, in_w, in_b)
    if bp.padded:
        q = qkv.as_strided(bp.q_size, bp.qkv_st, 0).reshape(bp.sb, bp.h, bp.d)  # batch-major rows
        k, v = qkv.as_strided(bp.kv_size, bp.kv_st, bp.d).index_select(0, src).unbind(2)
        o, lse, _ = bp.attn.forward(q, k, v, None, rng, bp.cu_q, cu_k, store_lse)
    else:
        q, k, v = bp.views(qkv)
        o, lse, _ = bp.attn.forward(q, k, v, None, rng, None, None, store_lse)
    att = o.as_strided(bp.ctx_size, bp.ctx_st).contiguous().view(bp.sb, bp.e)
    y = F.linear(att, out_w, out_b).view(x.shape)
    if residual is not None:
        y += residual
    return y, (x2, in_w, out_w, att, o, lse, rng, q, k, v, src, cu_k)


class _SelfAttnBlock(torch.autograd.Function):
    """``residual + linear(attention(linear(x, in_w, in_b)), out_w, out_b)`` of ``x (s, B, E)``
    (``residual`` optional, ``(s, B, E)``). Key padding: ``src``, ``skeys``, ``cu_k`` from
    ``BlockPlan.key_order``."""

    @staticmethod
    def forward(ctx, bp, rng, x, in_w, in_b, out_w, out_b, residual, src, skeys, cu_k):
        y, saved = block_forward(bp, rng, x, in_w, in_b, out_w, out_b, residual, src, cu_k, True)
        ctx.save_for_backward(*saved, skeys)
        ctx.bp = bp
        return y

    @staticmethod
    def backward(ctx, dy):
        bp = ctx.bp
        need = ctx.needs_input_grad
        x2, in_w, out_w, att, o, lse, rng, *rest = ctx.saved_tensors
        dy2 = dy.reshape(bp.sb, out_w.shape[0])
        d_out_w = dy2.t().mm(att) if need[5] else None
        d_out_b = dy2.sum(0) if need[6] else None
        d_att = dy2.mm(out_w)
        q, k, v, src, cu_k, skeys = rest
        if bp.padded:
            dout = d_att.as_strided(bp.q_size, bp.q_st).reshape(bp.sb, bp.h, bp.d)  # batch-major rows
            dq, dk, dv = bp.attn.backward(dout, q, k, v, o, lse, None, rng, bp.cu_q, cu_k)
            g = torch.empty(bp.sb, 3 * bp.e, dtype=dq.dtype, device=dq.device)
            g.as_strided(bp.q_size, bp.qkv_st, 0).copy_(dq.view(bp.q_size))
            # Packed rows past the last kept key belong to no sequence: their gradients are unspecified,
            # and they are the padded keys, whose gradient is zero.
            dkv = torch.stack((dk, dv), 2).masked_fill_(skeys.ge(bp.b).view(-1, 1, 1, 1), 0.0)
            g.as_strided(bp.kv_size, bp.kv_st, bp.d).index_copy_(0, src, dkv)
        else:
            dout = d_att.as_strided(bp.q_size, bp.q_st)
            dq, dk, dv = bp.attn.backward(dout, q, k, v, o, lse, None, rng)
            # (s, B, h, 3, d): the per-head (q, k, v) layout of the projection, seq-major rows.
            g = torch.stack((dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)), 3).view(bp.sb, 3 * bp.e)
        dx = g.mm(in_w).view(ctx.bp.ctx_size) if need[2] else None
        d_in_w = g.t().mm(x2) if need[3] else None
        d_in_b = g.sum(0) if need[4] else None
        return (None, None, dx, d_in_w, d_in_b, d_out_w, d_out_b, dy if need[7] else None, None, None, None)


self_attn_block = raw_apply(_SelfAttnBlock)
"""``self_attn_block(bp, rng, x, in_w, in_b, out_w, out_b, residual, src, skeys, cu_k)`` -> ``(s, B, E)``."""
