"""Triton kernels of the scaled (+ masked / causal) softmax over the last dim, forward and backward.

The input is ``(B, NP, SQ, SK)`` with any strides on the first three dims (unit column stride); a
row is one ``(b, h, q)``. Scores are ``x * scale`` in fp32; a masked element (mask != 0: a bool or
uint8 mask broadcast to the input through its strides, 0 on broadcast dims) scores ``-10000`` as in
Megatron; with ``CAUSAL``
columns ``k > q`` are excluded (probability 0, and never read). A row with no kept element (all
masked) outputs zeros, as Apex's kernels do.

Two algorithms, chosen by the launcher from SK:

* row-resident: ``BLOCK_M`` whole rows in registers; x is read once and y written once.
* chunked (long rows): an online-softmax pass over ``BLOCK_N`` chunks for the max and the sum
  (each chunk's max rescales the running sum), then a pass that writes the probabilities. The
  second read of a row mostly hits L2.

The row count and the query length change from batch to batch and are not specialized on (a new
size never compiles a new kernel).

The backward is ``dx = scale * y * (dy - sum(y * dy))``, resident or in two chunked passes; with
``CAUSAL`` the upper triangle is written as zeros without being read. Rows and offsets are int64.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a global a @jit function reads must be constexpr


@triton.jit
def _row_coords(rows, NP, SQ):
    """``(b, h, q)`` of flat row indices (int64)."""
    q = rows % SQ
    bh = rows // SQ
    return bh // NP, bh % NP, q


@triton.jit
def _scores(X, MASK, b, h, q, cols, valid, stride_xb, stride_xh, stride_xq, stride_mb, stride_mh, stride_mq,
            stride_mk, scale, HAS_MASK: tl.constexpr):
    """fp32 scores of a tile (``-inf`` where not ``valid``) and whether each element is kept."""
    x = tl.load(X + b * stride_xb + h * stride_xh + q * stride_xq + cols, mask=valid, other=0.0)
    z = x.to(tl.float32) * scale
    keep = valid
    if HAS_MASK:
        m = tl.load(MASK + b * stride_mb + h * stride_mh + q * stride_mq + cols * stride_mk, mask=valid, other=0)
        masked = m != 0
        z = tl.where(masked, -10000.0, z)
        keep = valid & (m == 0)
    return tl.where(valid, z, float("-inf")), keep


@triton.jit(do_not_specialize=["n_rows", "SQ"])
def _softmax_fwd_kernel(
    X, MASK, Y,
    n_rows, SK, NP, SQ,
    stride_xb, stride_xh, stride_xq, stride_mb, stride_mh, stride_mq, stride_mk,
    scale,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row-resident forward: program ``pid`` computes rows ``[pid*BLOCK_M, (pid+1)*BLOCK_M)``."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    scale = tl.cast(scale, tl.float32)
    rows1 = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rows1[:, None]
    b, h, q = _row_coords(rows, NP, SQ)
    cols = tl.arange(0, BLOCK_N)[None, :]
    in_row = (rows < n_rows) & (cols < SK)
    valid = in_row
    if CAUSAL:
        valid = valid & (cols <= q)
    z, keep = _scores(X, MASK, b, h, q, cols, valid, stride_xb, stride_xh, stride_xq, stride_mb, stride_mh,
                      stride_mq, stride_mk, scale, HAS_MASK)
    mx = tl.max(z, axis=1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # a row with no valid column: avoid inf - inf
    e = tl.exp2((z - mx[:, None]) * LOG2E)
    total = tl.sum(e, axis=1)
    any_keep = tl.max(keep.to(tl.int32), axis=1) > 0
    inv = tl.where(any_keep, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
    tl.store(Y + rows * SK + cols, (e * inv[:, None]).to(Y.dtype.element_ty), mask=in_row)


@triton.jit(do_not_specialize=["n_rows", "SQ"])
def _softmax_fwd_chunked_kernel(
    X, MASK, Y,
    n_rows, SK, NP, SQ,
    stride_xb, stride_xh, stride_xq, stride_mb, stride_mh, stride_mq, stride_mk,
    scale,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward for rows too long for registers: one program per row, online max/sum, then a write pass."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    scale = tl.cast(scale, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    b, h, q = _row_coords(row, NP, SQ)
    limit = SK
    if CAUSAL:
        limit = tl.minimum(SK, q + 1)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    kept = tl.zeros([1], tl.int32)
    for c0 in range(0, limit, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        valid = cols < limit
        z, keep = _scores(X, MASK, b, h, q, cols, valid, stride_xb, stride_xh, stride_xq, stride_mb, stride_mh,
                          stride_mq, stride_mk, scale, HAS_MASK)
        m_new = tl.maximum(m_i, tl.max(z, axis=0))
        # Every chunk has a valid column, so m_new is finite (the -10000 fill is finite too).
        l_i = l_i * tl.exp2((m_i - m_new) * LOG2E) + tl.sum(tl.exp2((z - m_new) * LOG2E), axis=0)
        m_i = m_new
        kept = tl.maximum(kept, tl.max(keep.to(tl.int32), axis=0))
    m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv = tl.where(kept > 0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    for c0 in range(0, SK, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        # Columns past the causal limit are masked off the load (never read) and score -inf -> 0.
        z, _ = _scores(X, MASK, b, h, q, cols, cols < limit, stride_xb, stride_xh, stride_xq, stride_mb, stride_mh,
                       stride_mq, stride_mk, scale, HAS_MASK)
        y = tl.exp2((z - m_i) * LOG2E) * inv
        tl.store(Y + row * SK + cols, y.to(Y.dtype.element_ty), mask=cols < SK)


@triton.jit(do_not_specialize=["n_rows", "SQ"])
def _softmax_bwd_kernel(
    DY, Y, DX,
    n_rows, SK, NP, SQ,
    stride_db, stride_dh, stride_dq, stride_yb, stride_yh, stride_yq,
    scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row-resident backward: ``dx = scale * y * (dy - sum(y * dy))``."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    scale = tl.cast(scale, tl.float32)
    rows1 = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rows1[:, None]
    b, h, q = _row_coords(rows, NP, SQ)
    cols = tl.arange(0, BLOCK_N)[None, :]
    in_row = (rows < n_rows) & (cols < SK)
    valid = in_row
    if CAUSAL:
        valid = valid & (cols <= q)  # y is 0 above the diagonal: neither y nor dy is read there
    y = tl.load(Y + b * stride_yb + h * stride_yh + q * stride_yq + cols, mask=valid, other=0.0).to(tl.float32)
    dy = tl.load(DY + b * stride_db + h * stride_dh + q * stride_dq + cols, mask=valid, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=1)
    dx = scale * y * (dy - dot[:, None])
    tl.store(DX + rows * SK + cols, dx.to(DX.dtype.element_ty), mask=in_row)


@triton.jit(do_not_specialize=["n_rows", "SQ"])
def _softmax_bwd_chunked_kernel(
    DY, Y, DX,
    n_rows, SK, NP, SQ,
    stride_db, stride_dh, stride_dq, stride_yb, stride_yh, stride_yq,
    scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Backward for long rows: a pass for ``sum(y * dy)``, then a pass writing dx."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    scale = tl.cast(scale, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    b, h, q = _row_coords(row, NP, SQ)
    limit = SK
    if CAUSAL:
        limit = tl.minimum(SK, q + 1)
    y_row = Y + b * stride_yb + h * stride_yh + q * stride_yq
    dy_row = DY + b * stride_db + h * stride_dh + q * stride_dq
    acc = tl.zeros([BLOCK_N], tl.float32)
    for c0 in range(0, limit, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        valid = cols < limit
        y = tl.load(y_row + cols, mask=valid, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=valid, other=0.0).to(tl.float32)
        acc += y * dy
    dot = tl.sum(acc, axis=0)
    for c0 in range(0, SK, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        valid = cols < limit
        y = tl.load(y_row + cols, mask=valid, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=valid, other=0.0).to(tl.float32)
        tl.store(DX + row * SK + cols, (scale * y * (dy - dot)).to(DX.dtype.element_ty), mask=cols < SK)
