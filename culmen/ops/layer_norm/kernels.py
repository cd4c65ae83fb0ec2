"""Triton kernels of the fused add + LayerNorm / RMSNorm op.

Two algorithms, chosen by the launcher from the hidden size N:

* row-resident: a program holds ``BLOCK_M`` whole rows in registers (``BLOCK_N >= N``). The input is
  read once and the output written once. The backward is persistent: each program walks a range of
  rows and keeps its dW/dB partial sums in registers, writing one fp32 row of partials at the end.
* chunked: for N too large for registers, rows are walked in ``BLOCK_N`` chunks. The forward makes
  one pass for the statistics (Chan's parallel Welford combine, exact in fp32) and one to normalize
  (the second read mostly hits L2: one row is at most a few hundred KB). The backward makes two
  passes per row for dX, and a column-parallel kernel computes dW/dB.

Conventions: all arithmetic in fp32; row offsets in int64 (tensors may exceed 2^31 elements); the
dropout keep-mask of element (row, col) is Philox with key ``seed + row`` (``seed + M + row`` for
``x1``) and counter ``col``, so the backward regenerates it instead of saving it.
"""

import triton
import triton.language as tl


@triton.jit
def _rstd_ptr(STATS, M, IS_RMS: tl.constexpr):
    """The statistics live in one fp32 buffer: ``[mean (M), rstd (M)]``, or ``[rstd (M)]`` for RMSNorm."""
    if IS_RMS:
        return STATS
    return STATS + M


@triton.jit
def _keep_mask(seed, rows, cols, M, dropout_p, SECOND: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    key = seed + rows
    if SECOND:
        key += M
    key = tl.broadcast_to(key, [BLOCK_M, BLOCK_N])
    offs = tl.broadcast_to(cols, [BLOCK_M, BLOCK_N])
    # 7 Philox rounds pass the usual statistical batteries and cost fewer registers than 10.
    return tl.rand(key, offs, n_rounds=7) > dropout_p


@triton.jit
def _load_prenorm(X, RES, X1, ROWSCALE, MASK, MASK1, RES_OUT, seed, rows, cols, tile, M, N,
                  stride_x, stride_res, stride_x1, stride_res_out, dropout_p,
                  HAS_RES: tl.constexpr, HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
                  HAS_DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr, STORE_RES_OUT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 tile of ``dropout(x * rowscale) + dropout(x1) + residual``; stores masks / residual_out."""
    h = tl.load(X + rows * stride_x + cols, mask=tile, other=0.0).to(tl.float32)
    if HAS_ROWSCALE:
        h = h * tl.load(ROWSCALE + rows, mask=rows < M, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        scale = 1.0 / (1.0 - dropout_p)
        keep = _keep_mask(seed, rows, cols, M, dropout_p, False, BLOCK_M, BLOCK_N)
        h = tl.where(keep, h * scale, 0.0)
        if STORE_MASK:
            tl.store(MASK + rows * N + cols, keep, mask=tile)
    if HAS_X1:
        h1 = tl.load(X1 + rows * stride_x1 + cols, mask=tile, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep1 = _keep_mask(seed, rows, cols, M, dropout_p, True, BLOCK_M, BLOCK_N)
            h1 = tl.where(keep1, h1 * scale, 0.0)
            if STORE_MASK:
                tl.store(MASK1 + rows * N + cols, keep1, mask=tile)
        h += h1
    if HAS_RES:
        h += tl.load(RES + rows * stride_res + cols, mask=tile, other=0.0).to(tl.float32)
    if STORE_RES_OUT:
        r = h.to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + rows * stride_res_out + cols, r, mask=tile)
        # Normalize the stored (rounded) sum, so forward and backward see the same values.
        h = r.to(tl.float32)
    return h


@triton.jit
def _affine_store(Y, W, B, xhat, rows, cols, tile, col_ok, stride_y,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    y = xhat
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w += 1.0
        y = y * w
    if HAS_B:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows * stride_y + cols, y.to(Y.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["M"])
def _layer_norm_fwd_kernel(
    X, W, B, RES, X1, W1, B1, ROWSCALE, SEED,
    Y, Y1, RES_OUT, MASK, MASK1, STATS,
    stride_x, stride_res, stride_x1, stride_y, stride_y1, stride_res_out,
    M, N, eps, dropout_p,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_X1: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr, STORE_RES_OUT: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, STORE_STATS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row-resident forward: program ``pid`` normalizes rows ``[pid*BLOCK_M, (pid+1)*BLOCK_M)``."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    dropout_p = tl.cast(dropout_p, tl.float32)
    eps = tl.cast(eps, tl.float32)
    rows1 = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rows1[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_ok = cols < N
    tile = (rows < M) & col_ok
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    h = _load_prenorm(X, RES, X1, ROWSCALE, MASK, MASK1, RES_OUT, seed, rows, cols, tile, M, N,
                      stride_x, stride_res, stride_x1, stride_res_out, dropout_p,
                      HAS_RES, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, STORE_MASK, STORE_RES_OUT,
                      BLOCK_M, BLOCK_N)
    if IS_RMS:
        hc = h
    else:
        mean = tl.sum(h, axis=1) / N
        if STORE_STATS:
            tl.store(STATS + rows1, mean, mask=rows1 < M)
        hc = tl.where(tile, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(hc * hc, axis=1) / N + eps)
    if STORE_STATS:
        tl.store(_rstd_ptr(STATS, M, IS_RMS) + rows1, rstd, mask=rows1 < M)
    xhat = hc * rstd[:, None]
    _affine_store(Y, W, B, xhat, rows, cols, tile, col_ok, stride_y, HAS_W, HAS_B, ZERO_CENTERED)
    if HAS_W1:
        _affine_store(Y1, W1, B1, xhat, rows, cols, tile, col_ok, stride_y1, True, HAS_B1, ZERO_CENTERED)


@triton.jit(do_not_specialize=["M"])
def _layer_norm_fwd_chunked_kernel(
    X, W, B, RES, X1, W1, B1, ROWSCALE, SEED,
    Y, Y1, RES_OUT, MASK, MASK1, STATS,
    stride_x, stride_res, stride_x1, stride_y, stride_y1, stride_res_out,
    M, N, eps, dropout_p,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_X1: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr, STORE_RES_OUT: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, STORE_STATS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward for rows too long for registers: a statistics pass, then a normalize pass."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    dropout_p = tl.cast(dropout_p, tl.float32)
    eps = tl.cast(eps, tl.float32)
    rows1 = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rows1[:, None]
    row_ok = rows < M
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    count = 0.0
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)[None, :]
        tile = row_ok & (cols < N)
        h = _load_prenorm(X, RES, X1, ROWSCALE, MASK, MASK1, RES_OUT, seed, rows, cols, tile, M, N,
                          stride_x, stride_res, stride_x1, stride_res_out, dropout_p,
                          HAS_RES, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, STORE_MASK, STORE_RES_OUT,
                          BLOCK_M, BLOCK_N)
        if IS_RMS:
            m2 += tl.sum(h * h, axis=1)
        else:
            # Chan et al.'s pairwise update: exact merging of per-chunk mean and M2.
            n_c = tl.minimum(N - c0, BLOCK_N).to(tl.float32)
            mean_c = tl.sum(h, axis=1) / n_c
            d = tl.where(tile, h - mean_c[:, None], 0.0)
            delta = mean_c - mean
            total = count + n_c
            mean += delta * (n_c / total)
            m2 += tl.sum(d * d, axis=1) + delta * delta * (count * n_c / total)
            count = total
    rstd = 1.0 / tl.sqrt(m2 / N + eps)
    if STORE_STATS:
        tl.store(_rstd_ptr(STATS, M, IS_RMS) + rows1, rstd, mask=rows1 < M)
        if not IS_RMS:
            tl.store(STATS + rows1, mean, mask=rows1 < M)
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)[None, :]
        col_ok = cols < N
        tile = row_ok & col_ok
        # Without residual_out nothing was fused in front of the norm: the pre-norm sum is x.
        if STORE_RES_OUT:
            h = tl.load(RES_OUT + rows * stride_res_out + cols, mask=tile, other=0.0).to(tl.float32)
        else:
            h = tl.load(X + rows * stride_x + cols, mask=tile, other=0.0).to(tl.float32)
        if IS_RMS:
            xhat = h * rstd[:, None]
        else:
            xhat = (h - mean[:, None]) * rstd[:, None]
        _affine_store(Y, W, B, xhat, rows, cols, tile, col_ok, stride_y, HAS_W, HAS_B, ZERO_CENTERED)
        if HAS_W1:
            _affine_store(Y1, W1, B1, xhat, rows, cols, tile, col_ok, stride_y1, True, HAS_B1, ZERO_CENTERED)


@triton.jit
def _load_w(W, cols, col_ok, other, ZERO_CENTERED: tl.constexpr):
    w = tl.load(W + cols, mask=col_ok, other=other).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    return w


@triton.jit
def _xhat(XS, STATS, M, w, b, rows, rows1, cols, tile, stride_xs,
          IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, RECOMPUTE_FROM_Y: tl.constexpr):
    """Normalized input of a tile, from the saved pre-norm sum or (memory-efficient) from y."""
    xs = tl.load(XS + rows * stride_xs + cols, mask=tile, other=0.0).to(tl.float32)
    if RECOMPUTE_FROM_Y:
        xhat = xs
        if HAS_B:
            xhat = xhat - b
        if HAS_W:
            xhat = xhat / w
    else:
        rstd = tl.load(_rstd_ptr(STATS, M, IS_RMS) + rows1, mask=rows1 >= 0, other=0.0)
        if IS_RMS:
            xhat = xs * rstd[:, None]
        else:
            mean = tl.load(STATS + rows1, mask=rows1 >= 0, other=0.0)
            xhat = (xs - mean[:, None]) * rstd[:, None]
    return tl.where(tile, xhat, 0.0)


@triton.jit
def _store_dx(DX, DX1, DRES, DRES_OUT, ROWSCALE, seed, dh, rows, cols, tile, M, dropout_p,
              stride_dx, stride_dx1, stride_dres, stride_dres_out,
              HAS_DRES_OUT: tl.constexpr, STORE_DRES: tl.constexpr, HAS_X1: tl.constexpr,
              HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """From the gradient of the pre-norm sum, write d(residual), dx and dx1."""
    if HAS_DRES_OUT:
        dh += tl.load(DRES_OUT + rows * stride_dres_out + cols, mask=tile, other=0.0).to(tl.float32)
    if STORE_DRES:
        tl.store(DRES + rows * stride_dres + cols, dh.to(DRES.dtype.element_ty), mask=tile)
    dx = dh
    if HAS_DROPOUT:
        scale = 1.0 / (1.0 - dropout_p)
        keep = _keep_mask(seed, rows, cols, M, dropout_p, False, BLOCK_M, BLOCK_N)
        dx = tl.where(keep, dx * scale, 0.0)
    if HAS_ROWSCALE:
        dx = dx * tl.load(ROWSCALE + rows, mask=(rows >= 0) & (rows < M), other=0.0).to(tl.float32)
    tl.store(DX + rows * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=tile)
    if HAS_X1:
        dx1 = dh
        if HAS_DROPOUT:
            keep1 = _keep_mask(seed, rows, cols, M, dropout_p, True, BLOCK_M, BLOCK_N)
            dx1 = tl.where(keep1, dx1 * scale, 0.0)
        tl.store(DX1 + rows * stride_dx1 + cols, dx1.to(DX1.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _layer_norm_bwd_kernel(
    XS, W, B, W1, DY, DY1, DRES_OUT, ROWSCALE, SEED, STATS,
    DX, DX1, DRES, PART,
    stride_xs, stride_dy, stride_dy1, stride_dres_out, stride_dx, stride_dx1, stride_dres, stride_part,
    M, N, dropout_p, rows_per_program,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_W1: tl.constexpr,
    HAS_B1: tl.constexpr, HAS_DRES_OUT: tl.constexpr, STORE_DRES: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    RECOMPUTE_FROM_Y: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row-resident persistent backward; writes dX and one row of fp32 dW/dB partials per program."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    dropout_p = tl.cast(dropout_p, tl.float32)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_ok = cols < N
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    w = 1.0
    b = 0.0
    w1 = 1.0
    if HAS_W:
        w = _load_w(W, cols, col_ok, 1.0, ZERO_CENTERED)
    if HAS_B & RECOMPUTE_FROM_Y:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_W1:
        w1 = _load_w(W1, cols, col_ok, 0.0, ZERO_CENTERED)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dw1_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db1_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows1 = r0 + tl.arange(0, BLOCK_M)
        rows1 = tl.where(rows1 < row_end, rows1, -1)
        rows = rows1[:, None]
        tile = (rows >= 0) & col_ok
        xhat = _xhat(XS, STATS, M, w, b, rows, rows1, cols, tile, stride_xs,
                     IS_RMS, HAS_W, HAS_B, RECOMPUTE_FROM_Y)
        rstd = tl.load(_rstd_ptr(STATS, M, IS_RMS) + rows1, mask=rows1 >= 0, other=0.0)
        dy = tl.load(DY + rows * stride_dy + cols, mask=tile, other=0.0).to(tl.float32)
        wdy = dy * w
        if HAS_W:
            dw_acc += dy * xhat
        if HAS_B:
            db_acc += dy
        if HAS_W1:
            dy1 = tl.load(DY1 + rows * stride_dy1 + cols, mask=tile, other=0.0).to(tl.float32)
            wdy += dy1 * w1
            dw1_acc += dy1 * xhat
            if HAS_B1:
                db1_acc += dy1
        c1 = tl.sum(xhat * wdy, axis=1) / N
        if IS_RMS:
            dh = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N
            dh = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        _store_dx(DX, DX1, DRES, DRES_OUT, ROWSCALE, seed, dh, rows, cols, tile, M, dropout_p,
                  stride_dx, stride_dx1, stride_dres, stride_dres_out,
                  HAS_DRES_OUT, STORE_DRES, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, BLOCK_M, BLOCK_N)
    cols1 = tl.arange(0, BLOCK_N)
    _store_partials(PART, pid.to(tl.int64) * stride_part + cols1, cols1 < N, N, dw_acc, db_acc, dw1_acc, db1_acc,
                    HAS_W, HAS_B, HAS_W1, HAS_B1)


@triton.jit
def _store_partials(PART, out, ok, N, dw_acc, db_acc, dw1_acc, db1_acc,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr):
    """Column sums of the accumulators into this program's row of ``PART (rows, P, N)``: the present
    parameter grads in the order w, b, w1, b1."""
    k = 0
    if HAS_W:
        tl.store(PART + out, tl.sum(dw_acc, axis=0), mask=ok)
        k += 1
    if HAS_B:
        tl.store(PART + k * N + out, tl.sum(db_acc, axis=0), mask=ok)
        k += 1
    if HAS_W1:
        tl.store(PART + k * N + out, tl.sum(dw1_acc, axis=0), mask=ok)
        k += 1
        if HAS_B1:
            tl.store(PART + k * N + out, tl.sum(db1_acc, axis=0), mask=ok)


@triton.jit
def _grad_terms(XS, W, B, W1, DY, DY1, STATS, M, rows, rows1, cols, col_ok, tile,
                stride_xs, stride_dy, stride_dy1,
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_W1: tl.constexpr,
                ZERO_CENTERED: tl.constexpr, RECOMPUTE_FROM_Y: tl.constexpr):
    """``xhat`` and ``dy * w (+ dy1 * w1)`` of one column chunk (chunked backward)."""
    w = 1.0
    b = 0.0
    if HAS_W:
        w = _load_w(W, cols, col_ok, 1.0, ZERO_CENTERED)
    if HAS_B & RECOMPUTE_FROM_Y:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    xhat = _xhat(XS, STATS, M, w, b, rows, rows1, cols, tile, stride_xs, IS_RMS, HAS_W, HAS_B, RECOMPUTE_FROM_Y)
    wdy = tl.load(DY + rows * stride_dy + cols, mask=tile, other=0.0).to(tl.float32) * w
    if HAS_W1:
        w1 = _load_w(W1, cols, col_ok, 0.0, ZERO_CENTERED)
        wdy += tl.load(DY1 + rows * stride_dy1 + cols, mask=tile, other=0.0).to(tl.float32) * w1
    return xhat, wdy


@triton.jit(do_not_specialize=["M"])
def _layer_norm_bwd_chunked_kernel(
    XS, W, B, W1, DY, DY1, DRES_OUT, ROWSCALE, SEED, STATS,
    DX, DX1, DRES,
    stride_xs, stride_dy, stride_dy1, stride_dres_out, stride_dx, stride_dx1, stride_dres,
    M, N, dropout_p,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_W1: tl.constexpr,
    HAS_DRES_OUT: tl.constexpr, STORE_DRES: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    RECOMPUTE_FROM_Y: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dX for rows too long for registers: one pass for the two row sums, one to write dX."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    dropout_p = tl.cast(dropout_p, tl.float32)
    rows1 = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows1 = tl.where(rows1 < M, rows1, -1)
    rows = rows1[:, None]
    row_ok = rows >= 0
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    rstd = tl.load(_rstd_ptr(STATS, M, IS_RMS) + rows1, mask=rows1 >= 0, other=0.0)
    c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)[None, :]
        col_ok = cols < N
        tile = row_ok & col_ok
        xhat, wdy = _grad_terms(XS, W, B, W1, DY, DY1, STATS, M, rows, rows1, cols, col_ok, tile,
                                stride_xs, stride_dy, stride_dy1, IS_RMS, HAS_W, HAS_B, HAS_W1,
                                ZERO_CENTERED, RECOMPUTE_FROM_Y)
        c1 += tl.sum(xhat * wdy, axis=1)
        c2 += tl.sum(wdy, axis=1)
    c1 = c1 / N
    c2 = c2 / N
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)[None, :]
        col_ok = cols < N
        tile = row_ok & col_ok
        xhat, wdy = _grad_terms(XS, W, B, W1, DY, DY1, STATS, M, rows, rows1, cols, col_ok, tile,
                                stride_xs, stride_dy, stride_dy1, IS_RMS, HAS_W, HAS_B, HAS_W1,
                                ZERO_CENTERED, RECOMPUTE_FROM_Y)
        if IS_RMS:
            dh = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            dh = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        _store_dx(DX, DX1, DRES, DRES_OUT, ROWSCALE, seed, dh, rows, cols, tile, M, dropout_p,
                  stride_dx, stride_dx1, stride_dres, stride_dres_out,
                  HAS_DRES_OUT, STORE_DRES, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def _layer_norm_bwd_dw_kernel(
    XS, W, B, DY, DY1, STATS, PART,
    stride_xs, stride_dy, stride_dy1, stride_part,
    M, N, rows_per_split,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_W1: tl.constexpr,
    HAS_B1: tl.constexpr, ZERO_CENTERED: tl.constexpr, RECOMPUTE_FROM_Y: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Column-parallel dW/dB/dW1/dB1 partials: program (n, s) sums rows of split s for columns n."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols1 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = cols1[None, :]
    col_ok = cols < N
    w = 1.0
    b = 0.0
    if HAS_W:
        w = _load_w(W, cols, col_ok, 1.0, ZERO_CENTERED)
    if HAS_B & RECOMPUTE_FROM_Y:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dw1_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db1_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_start = pid_s.to(tl.int64) * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows1 = r0 + tl.arange(0, BLOCK_M)
        rows1 = tl.where(rows1 < row_end, rows1, -1)
        rows = rows1[:, None]
        tile = (rows >= 0) & col_ok
        xhat = _xhat(XS, STATS, M, w, b, rows, rows1, cols, tile, stride_xs,
                     IS_RMS, HAS_W, HAS_B, RECOMPUTE_FROM_Y)
        dy = tl.load(DY + rows * stride_dy + cols, mask=tile, other=0.0).to(tl.float32)
        dw_acc += dy * xhat
        db_acc += dy
        if HAS_W1:
            dy1 = tl.load(DY1 + rows * stride_dy1 + cols, mask=tile, other=0.0).to(tl.float32)
            dw1_acc += dy1 * xhat
            db1_acc += dy1
    _store_partials(PART, pid_s.to(tl.int64) * stride_part + cols1, cols1 < N, N, dw_acc, db_acc, dw1_acc, db1_acc,
                    HAS_W, HAS_B, HAS_W1, HAS_B1)


@triton.jit(do_not_specialize=["rows"])
def _layer_norm_dw_finish_kernel(
    PART, DW, DB, DW1, DB1, rows, N, stride_row,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Sum the fp32 partials ``(rows, P, N)`` of the P present parameter grads over ``rows`` (a fixed
    order: deterministic) and write each in its parameter's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k = 0
    if HAS_W:
        _finish_one(PART, DW, k, rows, N, stride_row, cols, col_ok, BLOCK_R, BLOCK_N)
        k += 1
    if HAS_B:
        _finish_one(PART, DB, k, rows, N, stride_row, cols, col_ok, BLOCK_R, BLOCK_N)
        k += 1
    if HAS_W1:
        _finish_one(PART, DW1, k, rows, N, stride_row, cols, col_ok, BLOCK_R, BLOCK_N)
        k += 1
    if HAS_B1:
        _finish_one(PART, DB1, k, rows, N, stride_row, cols, col_ok, BLOCK_R, BLOCK_N)


@triton.jit
def _finish_one(PART, OUT, k, rows, N, stride_row, cols, col_ok, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)[:, None]
        acc += tl.load(PART + r.to(tl.int64) * stride_row + k * N + cols[None, :], mask=(r < rows) & col_ok[None, :],
                       other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)
