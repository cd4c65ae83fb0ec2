"""Self-attention as one autograd node: input projection, attention and output projection together.

The chain ``linear -> attention -> linear`` costs the eager host three autograd nodes plus the view
nodes between them, and every per-call view, select and transpose goes through the dispatcher again in
the backward. ``SelfAttnBlock`` does the same work inside a single ``autograd.Function`` whose
backward is written out (two GEMMs and a column sum per projection, the attention kernels in the
middle), with everything derived from the call signature kept in a cached ``BlockPlan``: the attention
plan, the sizes and strides of the q / k / v views inside the packed projection, and the index tensors
the key-padding path needs. Device work is the chain's: the same GEMMs and kernels, one copy of the
context into sequence-first rows for the output projection; the attention backward writes the three head
gradients straight into the packed layout of the input projection's gradient.

Key padding without a host sync or a sort (``_pack``): one kernel ranks the kept keys of every batch row
(``cu_seqlens_k`` and each key's packed row, ``-1`` when padded), one copies the projection's rows into a
packed buffer of the same ``(h, 3, d)`` layout (q rows batch-major, k / v rows the kept keys batch by
batch) that q, k and v are strided views of, and the backward's one kernel writes the whole projection
gradient from ``dq``, ``dk``, ``dv`` (0 for padded keys). A padded call thus costs the host two
allocations and two launches forward, one allocation and one launch backward more than a dense one (plus
the batch-major copy of the context's gradient). Without the Triton kernels (the reference backend) the
same layout is built with torch ops: a stable sort of the sequence-major keys by batch row (``B`` and up
when padded), ``searchsorted`` for ``cu_seqlens_k``, ``index_select`` / ``index_copy_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.contrib.multihead_attn._pack import _key_index_kernel, _pack_rows_kernel, _unpack_grads_kernel
from culmen.ops.attention.launch import AttnPlan
from culmen.ops.common.function import raw_apply
from culmen.ops.common.launch import Launch, cdiv, next_pow2, stream_getter
from culmen.ops.common.plans import PlanCache

BLOCKS = PlanCache("multihead_attn_block")

PACK_KERNELS = True
"""Key padding through ``_pack``'s kernels wherever the attention runs its Triton kernels. ``False`` (read
when a plan is built; clear ``BLOCKS`` after changing it) takes the torch-op path instead (sort,
searchsorted, index_select / index_copy_): kept for ``scripts/sweep_multihead_attn.py`` to compare."""


class BlockPlan:
    """What a self-attention call derives from its signature: sizes, the views' geometry, the attention
    plan and (key padding) the index tensors and the launches of ``_pack``'s kernels. ``padded``:
    key-padding mask (``mask``: an example of it, whose dtype and strides the kernels are bound to);
    else dense (``causal`` or not)."""

    __slots__ = ("s", "b", "e", "h", "d", "sb", "padded", "attn", "q_size", "qkv_st", "pk_size", "pk_st",
                 "ctx_size", "ctx_st", "q_st", "bounds", "cu_q", "batch_sm", "rows", "kernels", "stream",
                 "index", "index_args", "pack", "pack_args", "unpack", "unpack_args", "cu_len")

    def __init__(self, x: Tensor, heads: int, padded: bool, causal: bool, dropout_p: float,
                 mask: Tensor | None = None) -> None:
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
        self.kernels = False
        if not padded:
            q, k, v = self.views(qkv)
            self.attn = AttnPlan("dense", q, k, v, None, dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                                 return_lse=True)
            return
        # The packed buffer keeps the projection's (rows, h, 3, d) layout: q rows batch-major, k / v rows
        # the kept keys batch by batch (``_pack``); q, k, v are (s * B, h, d) views of it.
        self.pk_size, self.pk_st = (self.sb, h, d), (3 * e, 3 * d, 1)
        self.bounds = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
        self.rows = torch.arange(self.sb, device=dev)
        self.batch_sm = self.rows.view(s, b).remainder(b).to(torch.int32)  # batch row of each seq-major key
        q, k, v = self.packed_views(qkv)
        self.attn = AttnPlan("varlen", q, k, v, None, self.cu_q, self.cu_q, s, s, dropout_p=dropout_p,
                             softmax_scale=scale, causal=False, return_lse=True)
        self.kernels = self.attn.use_kernel and PACK_KERNELS
        if self.kernels:
            self._plan_kernels(mask)

    def _plan_kernels(self, mask: Tensor) -> None:
        s, b, e, d, sb = self.s, self.b, self.e, self.d, self.sb
        dev = self.cu_q.device
        self.stream = stream_getter(dev)
        # [cu_k (B + 1) | pad to 16 bytes | pos (s * B)]: cu_k first, so it is 16-byte aligned for the
        # attention kernels' bound launches.
        self.cu_len = cdiv(b + 1, 4) * 4
        self.index = Launch(_key_index_kernel, (b,), dict(BLOCK=min(1024, next_pow2(s))), 4, device=dev)
        self.index_args = (*mask.stride(), s, b, self.cu_len)
        bc = min(1024, next_pow2(3 * e))
        grid = (sb, cdiv(3 * e, bc))
        self.pack = Launch(_pack_rows_kernel, grid, dict(D=d, BLOCK=bc), 4, device=dev)
        self.pack_args = (s, b, 3 * e, self.cu_len)
        self.unpack = Launch(_unpack_grads_kernel, grid, dict(D=d, BLOCK=bc), 4, device=dev)
        self.unpack_args = (s, b, e, 3 * e, self.cu_len)

    def views(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``(B, s, h, d)`` inside the packed projection ``(s * B, 3E)`` (storage offset 0)."""
        size, st, d = self.q_size, self.qkv_st, self.d
        return (qkv.as_strided(size, st, 0), qkv.as_strided(size, st, d), qkv.as_strided(size, st, 2 * d))

    def packed_views(self, pk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``(s * B, h, d)`` rows of the packed buffer ``(s * B, 3E)`` (key padding)."""
        size, st, d = self.pk_size, self.pk_st, self.d
        return (pk.as_strided(size, st, 0), pk.as_strided(size, st, d), pk.as_strided(size, st, 2 * d))

    def key_order(self, pad: Tensor) -> tuple[Tensor, Tensor]:
        """``(idx, cu_k)`` of a padding mask ``(B, s)`` (nonzero = padded); ``cu_k`` int32 ``(B + 1,)``.

        Kernels: ``idx`` int32 ``[cu_k | pos]`` (``_pack``). Otherwise ``idx`` is the projection row of each
        packed key (int64 ``(s * B,)``, kept keys first, batch by batch, padding last): a stable sort of the
        sequence-major keys by batch row (``B`` and up when padded), whose run boundaries are ``cu_k``."""
        if self.kernels:
            idx = torch.empty(self.cu_len + self.sb, dtype=torch.int32, device=pad.device)
            self.index(self.stream(), pad.data_ptr() & 15 == 0, pad, idx, *self.index_args)
            return idx, idx.as_strided((self.b + 1,), (1,), 0)
        keys = torch.add(self.batch_sm, pad.t(), alpha=self.b)
        skeys, src = torch.sort(keys.view(-1), stable=True)
        return src, torch.searchsorted(skeys, self.bounds, out_int32=True)

    def pack_rows(self, qkv: Tensor, idx: Tensor) -> Tensor:
        """The packed buffer ``(s * B, 3E)`` of the projection ``qkv (s * B, 3E)`` (see ``packed_views``)."""
        pk = torch.empty_like(qkv)
        if self.kernels:
            self.pack(self.stream(), True, qkv, idx, pk, *self.pack_args)
            return pk
        s, b, h, d = self.s, self.b, self.h, self.d
        pk4 = pk.view(self.sb, h, 3, d)
        pk4.view(b, s, h, 3, d)[:, :, :, 0].copy_(qkv.as_strided(self.q_size, self.qkv_st, 0))
        pk4[:, :, 1:].copy_(qkv.view(self.sb, h, 3, d).index_select(0, idx)[:, :, 1:])
        return pk

    def unpack_grads(self, dq: Tensor, dk: Tensor, dv: Tensor, idx: Tensor, cu_k: Tensor) -> Tensor:
        """The projection's gradient ``(s * B, 3E)`` from the packed rows' ``dq``, ``dk``, ``dv`` ``(s * B, h, d)``;
        padded keys get 0 (the packed rows past ``cu_k[-1]`` belong to no sequence: left unwritten by the
        varlen kernels)."""
        g = torch.empty(self.sb, 3 * self.e, dtype=dq.dtype, device=dq.device)
        if self.kernels:
            self.unpack(self.stream(), True, dq, dk, dv, idx, g, *self.unpack_args)
            return g
        s, b, h, d = self.s, self.b, self.h, self.d
        g4 = g.view(self.sb, h, 3, d)
        g4.view(s, b, h, 3, d)[:, :, :, 0].copy_(dq.view(b, s, h, d).transpose(0, 1))
        dkv = torch.stack((dk, dv), 2).masked_fill_(self.rows.ge(cu_k[b]).view(-1, 1, 1, 1), 0.0)
        g4[:, :, 1:].index_copy_(0, idx, dkv)
        return g


def block_plan(x: Tensor, heads: int, padded: bool, causal: bool, dropout_p: float,
               mask: Tensor | None = None) -> BlockPlan:
    """The cached ``BlockPlan`` of a call signature (the caller has validated the arguments); ``mask``:
    the key-padding mask when ``padded``."""
    key = (x.shape, x.dtype, x.device, heads, padded, causal, dropout_p)
    if padded:
        key += (mask.dtype, mask.stride())
    bp = BLOCKS.get(key)
    if bp is None:
        bp = BLOCKS.put(key, BlockPlan(x, heads, padded, causal, dropout_p, mask))
    return bp


def block_forward(bp: BlockPlan, rng: Tensor | None, x: Tensor, in_w: Tensor, in_b: Tensor | None, out_w: Tensor,
                  out_b: Tensor | None, residual: Tensor | None, idx: Tensor | None, cu_k: Tensor | None,
                  store_lse: bool) -> tuple[Tensor, tuple]:
    """The block's forward without autograd: ``(y (s, B, E), tensors the backward needs)``; the
    attention's log-sum-exp is only written when ``store_lse`` (inference skips it)."""
    x2 = x.reshape(bp.sb, bp.e)
    qkv = F.linear(x2, in_w, in_b)
    if bp.padded:
        q, k, v = bp.packed_views(bp.pack_rows(qkv, idx))
        o, lse, _ = bp.attn.forward(q, k, v, None, rng, bp.cu_q, cu_k, store_lse)
    else:
        q, k, v = bp.views(qkv)
        o, lse, _ = bp.attn.forward(q, k, v, None, rng, None, None, store_lse)
    att = o.as_strided(bp.ctx_size, bp.ctx_st).contiguous().view(bp.sb, bp.e)
    y = F.linear(att, out_w, out_b).view(x.shape)
    if residual is not None:
        y += residual
    return y, (x2, in_w, out_w, att, o, lse, rng, q, k, v, idx, cu_k)


class _SelfAttnBlock(torch.autograd.Function):
    """``residual + linear(attention(linear(x, in_w, in_b)), out_w, out_b)`` of ``x (s, B, E)``
    (``residual`` optional, ``(s, B, E)``). Key padding: ``idx``, ``cu_k`` from ``BlockPlan.key_order``."""

    @staticmethod
    def forward(ctx, bp, rng, x, in_w, in_b, out_w, out_b, residual, idx, cu_k):
        y, saved = block_forward(bp, rng, x, in_w, in_b, out_w, out_b, residual, idx, cu_k, True)
        ctx.save_for_backward(*saved)
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
        q, k, v, idx, cu_k = rest
        if bp.padded:
            dout = d_att.as_strided(bp.q_size, bp.q_st).reshape(bp.sb, bp.h, bp.d)  # batch-major rows
            dq, dk, dv = bp.attn.backward(dout, q, k, v, o, lse, None, rng, bp.cu_q, cu_k)
            g = bp.unpack_grads(dq, dk, dv, idx, cu_k)
        else:
            dout = d_att.as_strided(bp.q_size, bp.q_st)
            # The kernels write dq, dk, dv straight into the projection's gradient (its per-head (q, k, v)
            # layout, seq-major rows), the views q, k, v are of the projection: no stacking copy (0.2 ms of a
            # 1.5 ms BERT-large step at B32 on the H200).
            g = torch.empty(bp.sb, 3 * bp.e, dtype=dy.dtype, device=dy.device)
            bp.attn.backward(dout, q, k, v, o, lse, None, rng, grads=bp.views(g))
        dx = g.mm(in_w).view(ctx.bp.ctx_size) if need[2] else None
        d_in_w = g.t().mm(x2) if need[3] else None
        d_in_b = g.sum(0) if need[4] else None
        return (None, None, dx, d_in_w, d_in_b, d_out_w, d_out_b, dy if need[7] else None, None, None)


self_attn_block = raw_apply(_SelfAttnBlock)
"""``self_attn_block(bp, rng, x, in_w, in_b, out_w, out_b, residual, idx, cu_k)`` -> ``(s, B, E)``."""
