"""Key padding of the self-attention block in three small Triton kernels (one launch each, no sort).

The varlen attention kernels want the queries of each batch row contiguous (batch-major rows) and the
kept keys packed batch by batch with ``cu_seqlens_k`` delimiting them; the projection's output is
sequence-major ``(s * B, 3E)`` with a per-head ``(h, 3, d)`` layout. Three kernels do the conversion:

* ``_key_index_kernel`` (one program per batch row ``b``): counts the kept keys of the rows before ``b``
  (its packed offset) and ranks row ``b``'s kept keys with a prefix sum; writes ``pos`` (int32 ``(s * B,)``:
  the packed row of each projection row's key, ``-1`` when padded) and ``cu_k[b + 1]``. Both live in one
  int32 buffer ``[cu_k | pad to 16 bytes | pos]`` (one allocation; ``P`` is the offset of ``pos``).
* ``_pack_rows_kernel`` (one program per projection row and column block): copies the row's q part to
  its batch-major row ``b * s + j`` and, when the key is kept, its k and v parts to packed row ``pos``, in
  a ``(s * B, 3E)`` buffer of the projection's layout. Both orders are bijections, so every row's q part
  and the first ``cu_k[-1]`` rows' k / v parts are written exactly once; the rest is never read.
* ``_unpack_grads_kernel`` (the backward, same grid): writes every element of the projection's gradient
  ``(s * B, 3E)`` once, ``dq`` from the batch-major row, ``dk`` / ``dv`` from packed row ``pos`` or 0 for a
  padded key (no zero fill, no stack, no masked fill).

The mask is read as it is (bool, uint8 or float; nonzero = padding) through its strides.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _key_index_kernel(mask_ptr, idx_ptr, smb, smj, S, B, P, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for r in range(0, b):
        for j0 in range(0, S, BLOCK):
            j = j0 + offs
            m = tl.load(mask_ptr + r * smb + j * smj, mask=j < S, other=1)
            acc += (m == 0).to(tl.int32)
    base = tl.sum(acc, 0)
    for j0 in range(0, S, BLOCK):
        j = j0 + offs
        inb = j < S
        m = tl.load(mask_ptr + b * smb + j * smj, mask=inb, other=1)
        kept = (m == 0).to(tl.int32)
        rank = tl.cumsum(kept, 0)
        tl.store(idx_ptr + P + j * B + b, tl.where(kept != 0, base + rank - 1, -1), mask=inb)
        base += tl.sum(kept, 0)
    tl.store(idx_ptr + 1 + b, base)
    if b == 0:
        tl.store(idx_ptr, 0)


@triton.jit
def _pack_rows_kernel(qkv_ptr, idx_ptr, out_ptr, S, B, E3, P, D: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = r // B
    qrow = (r - j * B) * S + j
    pos = tl.load(idx_ptr + P + r)
    inb = c < E3
    x = tl.load(qkv_ptr + r.to(tl.int64) * E3 + c, mask=inb)
    is_q = (c // D) % 3 == 0
    dst = tl.where(is_q, qrow, pos).to(tl.int64)
    tl.store(out_ptr + dst * E3 + c, x, mask=inb & (is_q | (dst >= 0)))


@triton.jit
def _unpack_grads_kernel(dq_ptr, dk_ptr, dv_ptr, idx_ptr, g_ptr, S, B, E, E3, P, D: tl.constexpr,
                         BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = r // B
    qrow = ((r - j * B) * S + j).to(tl.int64)
    pos = tl.load(idx_ptr + P + r)
    krow = tl.maximum(pos, 0).to(tl.int64)
    inb = c < E3
    part = (c // D) % 3
    col = (c // (3 * D)) * D + c % D
    kept = (tl.zeros([BLOCK], dtype=tl.int32) + pos) >= 0
    gq = tl.load(dq_ptr + qrow * E + col, mask=inb & (part == 0), other=0.0)
    gk = tl.load(dk_ptr + krow * E + col, mask=inb & (part == 1) & kept, other=0.0)
    gv = tl.load(dv_ptr + krow * E + col, mask=inb & (part == 2) & kept, other=0.0)
    g = tl.where(part == 0, gq, tl.where(part == 1, gk, gv))
    tl.store(g_ptr + r.to(tl.int64) * E3 + c, g, mask=inb)
