"""Triton kernels of the convolution epilogue: ``y = act((c * scale + bias + r * rscale) * mask)``.

``c`` is a convolution's output in channels-last memory, viewed as ``(M, C)`` rows (``M = N*H*W``), unit
stride along the channels. ``scale``/``bias``/``rscale`` are per-channel vectors, ``r`` a residual and
``mask`` a multiplier, both laid out like ``c``. Every piece is optional (a constexpr flag each); ``act`` is
ReLU or the identity.

Forward: one elementwise pass over ``(BLOCK_M, BLOCK_C)`` tiles.

Backward: ``g = dy * [y > 0] * mask``; it writes ``dc = g * scale`` (the gradient of the convolution output),
``dr = g * rscale`` (of the residual) and per-split channel sums of ``g`` (the bias gradient, finished by
a sum over the splits on the host side), all from one read of ``dy``, ``y`` and ``mask``. Grid
``(C / BLOCK_C, S)``: program ``(cb, s)`` walks the rows of split ``s`` for its channel block, so the sums
are ordered (bitwise reproducible) without atomics.

All arithmetic in fp32; element offsets in int64. Row counts are not specialized (``do_not_specialize``).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _conv_epilogue_fwd_kernel(X, SCALE, BIAS, RES, RSCALE, MASK, Y, M, C,
                              HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                              HAS_RSCALE: tl.constexpr, HAS_MASK: tl.constexpr, RELU: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tile ``(pid_m, pid_c)`` of ``y = act((x * scale + bias + res * rscale) * mask)``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    ok = (rows < M)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    v = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(SCALE + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        v = v + tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        r = tl.load(RES + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_RSCALE:
            r = r * tl.load(RSCALE + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        v = v + r
    if HAS_MASK:
        v = v * tl.load(MASK + offs, mask=ok, other=0).to(tl.float32)
    if RELU:
        v = tl.maximum(v, 0.0)
    tl.store(Y + offs, v.to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def _conv_epilogue_bwd_kernel(DY, Y, MASK, SCALE, RSCALE, DC, DR, PART, M, C, rows_per_split,
                              RELU: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SCALE: tl.constexpr,
                              HAS_RSCALE: tl.constexpr, STORE_DC: tl.constexpr, STORE_DR: tl.constexpr,
                              SUM_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program ``(cb, s)``: ``dc``/``dr`` of channel block ``cb`` over the rows of split ``s``, and the split's
    channel sums of ``g`` into ``PART[s, :]`` (fp32)."""
    pid_c = tl.program_id(0)
    s = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    if HAS_SCALE:
        sc = tl.load(SCALE + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_RSCALE:
        rsc = tl.load(RSCALE + cols, mask=col_ok, other=0.0).to(tl.float32)
    r0 = s * rows_per_split
    r1 = tl.minimum(r0 + rows_per_split, M)
    rr = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for r in range(r0, r1, BLOCK_M):
        rows = r + rr
        ok = (rows < r1)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        g = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        if RELU:
            y = tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
            g = tl.where(y > 0.0, g, 0.0)
        if HAS_MASK:
            g = g * tl.load(MASK + offs, mask=ok, other=0).to(tl.float32)
        if SUM_G:
            acc += g
        if STORE_DC:
            dc = g
            if HAS_SCALE:
                dc = g * sc[None, :]
            tl.store(DC + offs, dc.to(DC.dtype.element_ty), mask=ok)
        if STORE_DR:
            dr = g
            if HAS_RSCALE:
                dr = g * rsc[None, :]
            tl.store(DR + offs, dr.to(DR.dtype.element_ty), mask=ok)
    if SUM_G:
        tl.store(PART + s.to(tl.int64) * C + cols, tl.sum(acc, axis=0), mask=col_ok)
