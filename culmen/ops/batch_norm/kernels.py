"""Triton kernels of (synchronized) batch normalization.

Two layouts, both with unit stride along the innermost dim:

* NCHW: the input viewed as ``(N, C, L)`` (``L`` = product of the spatial dims). Channel ``c``'s
  data is ``N`` contiguous runs of ``L`` elements. The reductions run on a ``(C, S)`` grid, each
  program over a block of rows ``n`` and a block of the ``L`` dim of one channel; the elementwise
  kernels walk ``(BLOCK_R, BLOCK_L)`` tiles of the ``(N*C, L)`` matrix, one division per row.
* channel-last: the input viewed as ``(M, C)`` (``M`` = everything but the channels). The reductions
  run on a ``(C / BLOCK_C, S)`` grid over row ranges; the elementwise kernels on ``(BLOCK_M, BLOCK_C)``
  tiles.

Statistics. Each reduction program keeps per-lane fp32 sums of ``x - K`` and ``(x - K)^2``, where
``K`` is the mean of the program's first tile (a shift that removes the cancellation of the naive
sum-of-squares formula), and writes the ``(mean, M2)`` of its block, ``M2`` being the sum of squared
deviations. The combine kernel merges any number of such ``(mean, M2, count)`` partials with the
exact group formula ``mean = sum n_i mean_i / n``, ``M2 = sum M2_i + n_i (mean_i - mean)^2``; the
same kernel merges the splits of one rank and the per-rank statistics all-gathered across ranks,
whatever their (unequal, possibly zero) counts.

Packed statistics: one fp32 row of ``2C + 2`` values, ``[mean (C) | M2 (C) | count]``, the count an
int64 stored in the last two fp32 slots (bit-exact through an all-gather; kernels reinterpret the pointer
with ``_count_ptr``). The final statistics have the same layout, ``[mean (C) | invstd (C) | count]``.

Workspaces: every buffer of small results (partial rows, the final statistics, the backward's partial
sums) is a region of one fp32 workspace, passed as its base pointer plus an element offset (no views on
the host). Integer arguments that follow the batch size are not specialized (``do_not_specialize``).

All arithmetic in fp32; element offsets in int64.
"""

import triton
import triton.language as tl


@triton.jit
def _count_ptr(P):
    """The int64 view of an fp32 pointer (the count slot of a packed row)."""
    return P.to(tl.pointer_type(tl.int64), bitcast=True)


@triton.jit
def _bn_running_stats_kernel(RMEAN, RVAR, WS, o_off, C, eps, BLOCK_C: tl.constexpr):
    """Eval: ``[mean (C) | invstd (C)]`` at ``WS[o_off]`` from the running statistics (any float dtype)."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    eps = tl.cast(eps, tl.float32)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < C
    rm = tl.load(RMEAN + cols, mask=ok, other=0.0).to(tl.float32)
    rv = tl.load(RVAR + cols, mask=ok, other=1.0).to(tl.float32)
    tl.store(WS + o_off + cols, rm, mask=ok)
    tl.store(WS + o_off + C + cols, 1.0 / tl.sqrt(rv + eps), mask=ok)


@triton.jit(do_not_specialize=["N", "rows_per_split"])
def _bn_stats_nchw_kernel(X, WS, p_off, N, C, L, stride_p, rows_per_split, cols_per_split, col_splits,
                          BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``(c, s)``: ``(mean, M2)`` of channel ``c`` over rows ``[r0, r1)`` x cols ``[l0, l1)``, into packed
    row ``s`` at ``WS[p_off]`` (row stride ``stride_p``)."""
    PART = WS + p_off
    c = tl.program_id(0)
    s = tl.program_id(1)
    s_r = s // col_splits
    s_l = s % col_splits
    r0 = s_r * rows_per_split
    r1 = tl.maximum(tl.minimum(r0 + rows_per_split, N), r0)  # a split past the batch is empty
    l0 = s_l * cols_per_split
    l1 = tl.maximum(tl.minimum(l0 + cols_per_split, L), l0)
    rr = tl.arange(0, BLOCK_R)
    ll = tl.arange(0, BLOCK_L)
    base = X + c.to(tl.int64) * L
    row_stride = tl.cast(C, tl.int64) * L
    # The shift K: the mean of the first tile.
    ok0 = ((r0 + rr) < r1)[:, None] & ((l0 + ll) < l1)[None, :]
    x0 = tl.load(base + (r0 + rr).to(tl.int64)[:, None] * row_stride + (l0 + ll)[None, :], mask=ok0,
                 other=0.0).to(tl.float32)
    n0 = tl.maximum(tl.minimum(r1 - r0, BLOCK_R) * tl.minimum(l1 - l0, BLOCK_L), 1)
    k = tl.sum(tl.sum(x0, axis=1), axis=0) / n0.to(tl.float32)
    acc1 = tl.zeros([BLOCK_R, BLOCK_L], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_L], dtype=tl.float32)
    for r in range(r0, r1, BLOCK_R):
        rows = r + rr
        row_off = rows.to(tl.int64) * row_stride
        row_ok = rows < r1
        for c0 in range(l0, l1, BLOCK_L):
            cols = c0 + ll
            ok = row_ok[:, None] & (cols < l1)[None, :]
            x = tl.load(base + row_off[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            d = tl.where(ok, x - k, 0.0)
            acc1 += d
            acc2 += d * d
    cnt = tl.maximum((r1 - r0) * (l1 - l0), 1).to(tl.float32)
    s1 = tl.sum(tl.sum(acc1, axis=1), axis=0)
    s2 = tl.sum(tl.sum(acc2, axis=1), axis=0)
    tl.store(PART + s * stride_p + c, k + s1 / cnt)
    tl.store(PART + s * stride_p + C + c, tl.maximum(s2 - s1 * s1 / cnt, 0.0))
    if c == 0:
        tl.store(_count_ptr(PART + s * stride_p + 2 * C), (r1 - r0).to(tl.int64) * (l1 - l0))


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def _bn_stats_nhwc_kernel(X, WS, p_off, M, C, stride_p, rows_per_split, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program ``(cb, s)``: ``(mean, M2)`` of channels ``cb*BLOCK_C + [0, BLOCK_C)`` over rows of split ``s``."""
    PART = WS + p_off
    pid_c = tl.program_id(0)
    s = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    r0 = s * rows_per_split
    r1 = tl.maximum(tl.minimum(r0 + rows_per_split, M), r0)  # a split past the batch is empty
    rr = tl.arange(0, BLOCK_M)
    ok0 = ((r0 + rr) < r1)[:, None] & col_ok[None, :]
    x0 = tl.load(X + (r0 + rr).to(tl.int64)[:, None] * C + cols[None, :], mask=ok0, other=0.0).to(tl.float32)
    n0 = tl.maximum(tl.minimum(r1 - r0, BLOCK_M), 1).to(tl.float32)
    k = tl.sum(x0, axis=0) / n0
    acc1 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for r in range(r0, r1, BLOCK_M):
        rows = r + rr
        ok = (rows < r1)[:, None] & col_ok[None, :]
        x = tl.load(X + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        d = tl.where(ok, x - k[None, :], 0.0)
        acc1 += d
        acc2 += d * d
    cnt = tl.maximum(r1 - r0, 1).to(tl.float32)
    s1 = tl.sum(acc1, axis=0)
    s2 = tl.sum(acc2, axis=0)
    tl.store(PART + s * stride_p + cols, k + s1 / cnt, mask=col_ok)
    tl.store(PART + s * stride_p + C + cols, tl.maximum(s2 - s1 * s1 / cnt, 0.0), mask=col_ok)
    if pid_c == 0:
        tl.store(_count_ptr(PART + s * stride_p + 2 * C), (r1 - r0).to(tl.int64))


@triton.jit
def _bn_combine_kernel(WS, p_off, R, C, stride_p, o_off, RMEAN, RVAR, momentum, eps,
                       FINAL: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Merge the ``R`` packed ``(mean, M2, count)`` rows at ``WS[p_off]``, for channels ``pid*BLOCK_C + [0, BLOCK_C)``,
    into one row at ``WS[o_off]``.

    ``FINAL=False``: a packed row ``[mean | M2 | count]``. ``FINAL=True``: ``[mean | invstd | count]`` with
    ``invstd = 1/sqrt(M2/n + eps)``, and, with ``UPDATE_RUNNING``, blend the mean and the unbiased variance
    ``M2/(n-1)`` into ``RMEAN``/``RVAR`` (any float dtype) with ``momentum``.
    """
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    eps = tl.cast(eps, tl.float32)
    momentum = tl.cast(momentum, tl.float32)
    PART = WS + p_off
    OUT = WS + o_off
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    rr = tl.arange(0, BLOCK_R)
    # Pass 1: total count and count-weighted mean.
    n_tot = tl.zeros([BLOCK_R], dtype=tl.int64)
    wsum = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r in range(0, R, BLOCK_R):
        rows = r + rr
        row_ok = rows < R
        n = tl.load(_count_ptr(PART + rows.to(tl.int64) * stride_p + 2 * C), mask=row_ok, other=0)
        n_tot += n
        ok = row_ok[:, None] & col_ok[None, :]
        m = tl.load(PART + rows.to(tl.int64)[:, None] * stride_p + cols[None, :], mask=ok, other=0.0)
        m = tl.where((n > 0)[:, None], m, 0.0)
        wsum += tl.sum(m * n.to(tl.float32)[:, None], axis=0)
    total = tl.sum(n_tot, axis=0)
    total_f = total.to(tl.float32)
    mean = wsum / total_f
    # Pass 2: M2 of the union.
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r in range(0, R, BLOCK_R):
        rows = r + rr
        row_ok = rows < R
        n = tl.load(_count_ptr(PART + rows.to(tl.int64) * stride_p + 2 * C), mask=row_ok, other=0)
        ok = (row_ok & (n > 0))[:, None] & col_ok[None, :]
        off = rows.to(tl.int64)[:, None] * stride_p + cols[None, :]
        m = tl.load(PART + off, mask=ok, other=0.0)
        q = tl.load(PART + off + C, mask=ok, other=0.0)
        d = tl.where(ok, m - mean[None, :], 0.0)
        m2 += tl.sum(q + d * d * n.to(tl.float32)[:, None], axis=0)
    tl.store(OUT + cols, mean, mask=col_ok)
    if pid == 0:
        tl.store(_count_ptr(OUT + 2 * C), total)
    if FINAL:
        tl.store(OUT + C + cols, 1.0 / tl.sqrt(m2 / total_f + eps), mask=col_ok)
        if UPDATE_RUNNING:
            rm = tl.load(RMEAN + cols, mask=col_ok, other=0.0).to(tl.float32)
            rv = tl.load(RVAR + cols, mask=col_ok, other=0.0).to(tl.float32)
            unbiased = m2 / (total_f - 1.0)
            rm = rm * (1.0 - momentum) + mean * momentum
            rv = rv * (1.0 - momentum) + unbiased * momentum
            tl.store(RMEAN + cols, rm.to(RMEAN.dtype.element_ty), mask=col_ok)
            tl.store(RVAR + cols, rv.to(RVAR.dtype.element_ty), mask=col_ok)
    else:
        tl.store(OUT + C + cols, m2, mask=col_ok)


@triton.jit
def _scale_shift(STATS, C, W, B, ch, ok, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """Per-channel ``scale = invstd * w`` and ``shift = b - mean * scale`` (fp32), ``STATS = [mean | invstd]``."""
    mean = tl.load(STATS + ch, mask=ok, other=0.0)
    scale = tl.load(STATS + C + ch, mask=ok, other=0.0)
    if HAS_W:
        scale = scale * tl.load(W + ch, mask=ok, other=0.0).to(tl.float32)
    shift = -mean * scale
    if HAS_B:
        shift += tl.load(B + ch, mask=ok, other=0.0).to(tl.float32)
    return scale, shift


@triton.jit(do_not_specialize=["NC"])
def _bn_fwd_nchw_kernel(X, Z, Y, WS, s_off, W, B, NC, C, L,
                        HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_Z: tl.constexpr, RELU: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    """``y = relu?((x - mean) * invstd * w + b + z)`` on a ``(BLOCK_R, BLOCK_L)`` tile of ``(N*C, L)``; the
    statistics ``[mean | invstd]`` at ``WS[s_off]``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < NC
    scale, shift = _scale_shift(WS + s_off, C, W, B, rows % C, row_ok, HAS_W, HAS_B)
    ok = row_ok[:, None] & (cols < L)[None, :]
    off = rows.to(tl.int64)[:, None] * L + cols[None, :]
    y = tl.load(X + off, mask=ok, other=0.0).to(tl.float32) * scale[:, None] + shift[:, None]
    if HAS_Z:
        y += tl.load(Z + off, mask=ok, other=0.0).to(tl.float32)
    if RELU:
        y = tl.maximum(y, 0.0)
    tl.store(Y + off, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _bn_fwd_nhwc_kernel(X, Z, Y, WS, s_off, W, B, M, C,
                        HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_Z: tl.constexpr, RELU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channel-last forward on a ``(BLOCK_M, BLOCK_C)`` tile of ``(M, C)``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    scale, shift = _scale_shift(WS + s_off, C, W, B, cols, col_ok, HAS_W, HAS_B)
    ok = (rows < M)[:, None] & col_ok[None, :]
    off = rows.to(tl.int64)[:, None] * C + cols[None, :]
    y = tl.load(X + off, mask=ok, other=0.0).to(tl.float32) * scale[None, :] + shift[None, :]
    if HAS_Z:
        y += tl.load(Z + off, mask=ok, other=0.0).to(tl.float32)
    if RELU:
        y = tl.maximum(y, 0.0)
    tl.store(Y + off, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _load_dy(DY, Y, DZ, off, ok, RELU: tl.constexpr, STORE_DZ: tl.constexpr):
    """fp32 ``dy`` masked by the ReLU (``y > 0``); stores it as ``dz`` when asked."""
    dy = tl.load(DY + off, mask=ok, other=0.0)
    if RELU:
        y = tl.load(Y + off, mask=ok, other=0.0)
        dy = tl.where(y > 0, dy, 0.0)
    if STORE_DZ:
        tl.store(DZ + off, dy.to(DZ.dtype.element_ty), mask=ok)
    return dy.to(tl.float32)


@triton.jit(do_not_specialize=["N", "rows_per_split"])
def _bn_bwd_reduce_nchw_kernel(DY, X, Y, DZ, STATS, s_off, WS, p_off, N, C, L, rows_per_split, cols_per_split,
                               col_splits, RELU: tl.constexpr, STORE_DZ: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``(c, s)``: partial ``sum dy`` and ``sum dy * (x - mean)`` into ``PART[s] = [(C) | (C)]`` at
    ``WS[p_off]``; the mean at ``STATS[s_off]``."""
    MEAN = STATS + s_off
    PART = WS + p_off
    c = tl.program_id(0)
    s = tl.program_id(1)
    s_r = s // col_splits
    s_l = s % col_splits
    r0 = s_r * rows_per_split
    r1 = tl.minimum(r0 + rows_per_split, N)
    l0 = s_l * cols_per_split
    l1 = tl.minimum(l0 + cols_per_split, L)
    rr = tl.arange(0, BLOCK_R)
    ll = tl.arange(0, BLOCK_L)
    mean = tl.load(MEAN + c)
    base = c.to(tl.int64) * L
    row_stride = tl.cast(C, tl.int64) * L
    acc_dy = tl.zeros([BLOCK_R, BLOCK_L], dtype=tl.float32)
    acc_dyx = tl.zeros([BLOCK_R, BLOCK_L], dtype=tl.float32)
    for r in range(r0, r1, BLOCK_R):
        rows = r + rr
        row_off = base + rows.to(tl.int64) * row_stride
        row_ok = rows < r1
        for c0 in range(l0, l1, BLOCK_L):
            cols = c0 + ll
            ok = row_ok[:, None] & (cols < l1)[None, :]
            off = row_off[:, None] + cols[None, :]
            dy = _load_dy(DY, Y, DZ, off, ok, RELU, STORE_DZ)
            x = tl.load(X + off, mask=ok, other=0.0).to(tl.float32)
            acc_dy += dy
            acc_dyx += dy * tl.where(ok, x - mean, 0.0)
    tl.store(PART + s * 2 * C + c, tl.sum(tl.sum(acc_dy, axis=1), axis=0))
    tl.store(PART + s * 2 * C + C + c, tl.sum(tl.sum(acc_dyx, axis=1), axis=0))


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def _bn_bwd_reduce_nhwc_kernel(DY, X, Y, DZ, STATS, s_off, WS, p_off, M, C, rows_per_split,
                               RELU: tl.constexpr, STORE_DZ: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channel-last partial ``sum dy`` and ``sum dy * (x - mean)`` of split ``s``."""
    MEAN = STATS + s_off
    PART = WS + p_off
    pid_c = tl.program_id(0)
    s = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mean = tl.load(MEAN + cols, mask=col_ok, other=0.0)
    r0 = s * rows_per_split
    r1 = tl.minimum(r0 + rows_per_split, M)
    rr = tl.arange(0, BLOCK_M)
    acc_dy = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    acc_dyx = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for r in range(r0, r1, BLOCK_M):
        rows = r + rr
        ok = (rows < r1)[:, None] & col_ok[None, :]
        off = rows.to(tl.int64)[:, None] * C + cols[None, :]
        dy = _load_dy(DY, Y, DZ, off, ok, RELU, STORE_DZ)
        x = tl.load(X + off, mask=ok, other=0.0).to(tl.float32)
        acc_dy += dy
        acc_dyx += dy * tl.where(ok, x - mean[None, :], 0.0)
    tl.store(PART + s * 2 * C + cols, tl.sum(acc_dy, axis=0), mask=col_ok)
    tl.store(PART + s * 2 * C + C + cols, tl.sum(acc_dyx, axis=0), mask=col_ok)


@triton.jit
def _bn_bwd_finalize_kernel(WS, p_off, S, C, STATS, s_off, u_off, DW, DB, HAS_DW: tl.constexpr,
                            HAS_DB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Sum the ``S`` partial rows at ``WS[p_off]`` into ``SUMS = [sum dy | sum dy (x - mean)]`` at ``WS[u_off]``;
    ``dw = sum dy (x - mean) * invstd`` and ``db = sum dy`` (this rank's share, in the parameters' dtype)."""
    PART = WS + p_off
    SUMS = WS + u_off
    INVSTD = STATS + s_off + C
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    ss = tl.arange(0, BLOCK_S)
    acc_dy = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_dyx = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s in range(0, S, BLOCK_S):
        rows = s + ss
        ok = (rows < S)[:, None] & col_ok[None, :]
        off = rows.to(tl.int64)[:, None] * 2 * C + cols[None, :]
        acc_dy += tl.sum(tl.load(PART + off, mask=ok, other=0.0), axis=0)
        acc_dyx += tl.sum(tl.load(PART + off + C, mask=ok, other=0.0), axis=0)
    tl.store(SUMS + cols, acc_dy, mask=col_ok)
    tl.store(SUMS + C + cols, acc_dyx, mask=col_ok)
    if HAS_DW:
        invstd = tl.load(INVSTD + cols, mask=col_ok, other=0.0)
        tl.store(DW + cols, (acc_dyx * invstd).to(DW.dtype.element_ty), mask=col_ok)
    if HAS_DB:
        tl.store(DB + cols, acc_dy.to(DB.dtype.element_ty), mask=col_ok)


@triton.jit
def _dx_coefs(STATS, W, SUMS, ch, ok, C, HAS_W: tl.constexpr, TRAINING: tl.constexpr):
    """Per-channel ``a, k, b`` with ``dx = a * dy + k * x + b``.

    Training: ``dx = a * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy (x - mean)))``, ``a = invstd * w``,
    the means over all ``count`` elements of the process group. Eval: ``dx = a * dy``. ``STATS = [mean | invstd |
    count]``.
    """
    a = tl.load(STATS + C + ch, mask=ok, other=0.0)
    invstd = a
    if HAS_W:
        a = a * tl.load(W + ch, mask=ok, other=0.0).to(tl.float32)
    if TRAINING:
        inv_n = 1.0 / tl.load(_count_ptr(STATS + 2 * C)).to(tl.float32)
        mean = tl.load(STATS + ch, mask=ok, other=0.0)
        mdy = tl.load(SUMS + ch, mask=ok, other=0.0) * inv_n
        mdyx = tl.load(SUMS + C + ch, mask=ok, other=0.0) * inv_n
        k = -a * invstd * invstd * mdyx
        b = -a * mdy - mean * k
    else:
        k = tl.zeros_like(a)
        b = tl.zeros_like(a)
    return a, k, b


@triton.jit(do_not_specialize=["NC"])
def _bn_bwd_nchw_kernel(DY, X, Y, DX, STATS, s_off, SUMS, u_off, W, NC, C, L,
                        HAS_W: tl.constexpr, RELU: tl.constexpr, TRAINING: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    """``dx`` on a ``(BLOCK_R, BLOCK_L)`` tile of ``(N*C, L)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < NC
    a, k, b = _dx_coefs(STATS + s_off, W, SUMS + u_off, rows % C, row_ok, C, HAS_W, TRAINING)
    ok = row_ok[:, None] & (cols < L)[None, :]
    off = rows.to(tl.int64)[:, None] * L + cols[None, :]
    dy = _load_dy(DY, Y, DY, off, ok, RELU, False)
    dx = dy * a[:, None]
    if TRAINING:
        x = tl.load(X + off, mask=ok, other=0.0).to(tl.float32)
        dx += x * k[:, None] + b[:, None]
    tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _bn_bwd_nhwc_kernel(DY, X, Y, DX, STATS, s_off, SUMS, u_off, W, M, C,
                        HAS_W: tl.constexpr, RELU: tl.constexpr, TRAINING: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channel-last ``dx`` on a ``(BLOCK_M, BLOCK_C)`` tile of ``(M, C)``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    a, k, b = _dx_coefs(STATS + s_off, W, SUMS + u_off, cols, col_ok, C, HAS_W, TRAINING)
    ok = (rows < M)[:, None] & col_ok[None, :]
    off = rows.to(tl.int64)[:, None] * C + cols[None, :]
    dy = _load_dy(DY, Y, DY, off, ok, RELU, False)
    dx = dy * a[None, :]
    if TRAINING:
        x = tl.load(X + off, mask=ok, other=0.0).to(tl.float32)
        dx += x * k[None, :] + b[None, :]
    tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=ok)
