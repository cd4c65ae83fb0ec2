"""Triton kernels of the softmax cross-entropy op.

Per row ``r`` with label ``t`` the op works on ``z = softcap(logit_scale * x)`` (``softcap(u) = c *
tanh(u / c)``, off when ``c == 0``) and computes, in fp32,

    lse  = log(sum_j exp(z_j))
    loss = lse - (1 - s) * z_t - s * sum_j(z_j) / total_classes + lse_square_scale * lse^2

(``s`` is the label smoothing; the last term is the z-loss). Ignored rows get 0. The gradient is

    dz_j = dloss * ((1 + 2 * lse_square_scale * lse) * softmax(z)_j - (1 - s) * [j == t] - s / total_classes)

times ``logit_scale`` and the softcap's derivative ``1 - (z / c)^2``.

Kernels:

* ``_cross_entropy_fwd_kernel``: an online softmax over a column range in ``BLOCK_V`` chunks (one
  read of the logits). With ``SPLIT`` a row's vocab is cut into ranges handled by different
  programs, which write partial ``(max, sum exp, sum z)``; ``_cross_entropy_combine_kernel`` merges
  them (few rows, large vocab: otherwise a handful of programs would stream the whole tensor). With
  ``WRITE_GRAD`` (the fused linear + cross-entropy path) the program then walks its rows again and
  overwrites the logits with their gradient, scaled by a device scalar.
* ``_cross_entropy_bwd_kernel``: the gradient from the saved LSE, one tile per program (2-D grid),
  optionally in place.

Vocab-parallel use (``vocab_start`` / ``total_classes``): a rank holds columns ``[vocab_start,
vocab_start + V)`` of ``total_classes``; a label outside its range contributes no target logit here.
With ``ADD_LSE`` off the forward writes the partial loss ``-(1 - s) z_t - s sum(z) / total`` and the
caller adds the global LSE after the all-reduces.

A label outside ``[0, total_classes)`` that is not ``ignore_index`` makes that row's loss and gradient
NaN: a bad label is never silently turned into a finite number (the host checks labels it can see
without a device sync; see ``op.py``). Row offsets are int64.
"""

import triton
import triton.language as tl


@triton.jit
def _softcap(u, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # tanh(v) = 1 - 2 / (exp(2v) + 1): exact limits at +-inf and no libdevice call (the CPU
        # interpreter has none). Near 0 the absolute error is ~1e-7 * softcap, far below bf16 input noise.
        u = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (u / softcap)) + 1.0))
    return u


@triton.jit
def _z_tile(LOGITS, row_off, cols, mask, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """fp32 ``softcap(logit_scale * x)`` of a ``(BLOCK_M, BLOCK_V)`` tile (masked lanes hold garbage)."""
    x = tl.load(LOGITS + row_off[:, None] + cols, mask=mask, other=0.0).to(tl.float32)
    return _softcap(x * logit_scale, softcap, HAS_SOFTCAP)


@triton.jit
def _row_labels(LABELS, rows_c, row_ok, V, vocab_start, total_classes, ignore_index):
    """Per row: counted (not ignored), label column in this shard, label in this shard, label invalid."""
    label = tl.load(LABELS + rows_c).to(tl.int64)
    valid = (label != ignore_index) & row_ok
    local = label - vocab_start
    in_shard = valid & (local >= 0) & (local < V)
    bad = valid & ((label < 0) | (label >= total_classes))
    return valid, local, in_shard, bad


@triton.jit
def _grad_tile(z, cols, lse, zfac, coef, local, bad, label_smoothing, total_classes, softcap,
               HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """d loss / d x of a tile. ``zfac = 1 + 2 c lse``; ``coef = dloss * logit_scale`` (0 for ignored rows)."""
    p = tl.exp(z - lse[:, None]) * zfac[:, None]
    hit = cols == local[:, None]
    if HAS_SMOOTHING:
        g = tl.where(hit, p - (1.0 - label_smoothing), p) - label_smoothing / total_classes
    else:
        g = tl.where(hit, p - 1.0, p)
    g = g * coef[:, None]
    if HAS_SOFTCAP:
        t = z / softcap
        g = g * (1.0 - t * t)
    return tl.where(bad[:, None], float("nan"), g)


@triton.jit
def _finish_rows(LOGITS, LABELS, LOSS, ZLOSS, LSE, rows, rows_c, row_ok, row_off, stride_v, lse, sum_z,
                 V, vocab_start, total_classes, ignore_index, label_smoothing, logit_scale, lse_square_scale,
                 softcap, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ADD_LSE: tl.constexpr,
                 STORE_LSE: tl.constexpr):
    """Loss (and z-loss, LSE) of a block of rows from their LSE and sum of z; returns the label info.
    ``row_off``: each row's offset in ``LOGITS``, ``stride_v`` the class stride (1 row-major)."""
    valid, local, in_shard, bad = _row_labels(LABELS, rows_c, row_ok, V, vocab_start, total_classes, ignore_index)
    # One scalar load per row for the target logit instead of a compare in every tile of the sweep.
    x_t = tl.load(LOGITS + row_off + tl.where(in_shard, local, 0) * stride_v, mask=in_shard, other=0.0).to(tl.float32)
    z_t = tl.where(in_shard, _softcap(x_t * logit_scale, softcap, HAS_SOFTCAP), 0.0)
    if HAS_SMOOTHING:
        loss = -(1.0 - label_smoothing) * z_t - label_smoothing * (sum_z / total_classes)
    else:
        loss = -z_t
    if ADD_LSE:
        zl = lse_square_scale * lse * lse
        loss = loss + lse + zl
        tl.store(ZLOSS + rows, tl.where(valid, zl, 0.0), mask=row_ok)
    loss = tl.where(valid, loss, 0.0)
    loss = tl.where(bad, float("nan"), loss)
    tl.store(LOSS + rows, loss, mask=row_ok)
    if STORE_LSE:
        tl.store(LSE + rows, lse, mask=row_ok)
    return valid, local, bad


@triton.jit
def _cross_entropy_fwd_kernel(
    LOGITS, LABELS, LSE_IN, GRAD_SCALE, LOSS, ZLOSS, LSE, PART,
    stride_row, N, V, cols_per_split, vocab_start, total_classes, ignore_index,
    label_smoothing, logit_scale, lse_square_scale, softcap,
    HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECOMPUTED_LSE: tl.constexpr,
    ADD_LSE: tl.constexpr, SPLIT: tl.constexpr, WRITE_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program ``(m, s)``: rows ``[m*BLOCK_M, (m+1)*BLOCK_M)``, columns of split ``s``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    # Rows past the end re-read the last row (always in bounds) and store nothing.
    rows_c = tl.minimum(rows, N - 1)
    row_off = rows_c * stride_row
    sum_z = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PRECOMPUTED_LSE:
        lse = tl.load(LSE_IN + rows_c).to(tl.float32)
    else:
        pid_s = tl.program_id(1)
        c_start = pid_s * cols_per_split
        c_end = tl.minimum(c_start + cols_per_split, V)
        # Online softmax: the running max is per row (one cross-warp reduction per chunk), the sums stay
        # per lane and are reduced once after the sweep (rescaling by one exp per row and chunk).
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        acc_l = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        sum_l = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        for c0 in range(c_start, c_end, BLOCK_V):
            cols = c0 + tl.arange(0, BLOCK_V)[None, :]
            mask = cols < c_end
            z = tl.where(mask, _z_tile(LOGITS, row_off, cols, mask, logit_scale, softcap, HAS_SOFTCAP), float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            acc_l = acc_l * tl.exp(m - m_new)[:, None] + tl.exp(z - m_new[:, None])
            m = m_new
            if HAS_SMOOTHING:
                sum_l += tl.where(mask, z, 0.0)
        acc = tl.sum(acc_l, axis=1)
        if HAS_SMOOTHING:
            sum_z = tl.sum(sum_l, axis=1)
        if SPLIT:
            plane = tl.num_programs(1).to(tl.int64) * N
            part = PART + pid_s.to(tl.int64) * N + rows
            tl.store(part, m, mask=row_ok)
            tl.store(part + plane, acc, mask=row_ok)
            tl.store(part + 2 * plane, sum_z, mask=row_ok)
        lse = m + tl.log(acc)
    if not SPLIT:
        valid, local, bad = _finish_rows(
            LOGITS, LABELS, LOSS, ZLOSS, LSE, rows, rows_c, row_ok, row_off, 1, lse, sum_z, V, vocab_start,
            total_classes, ignore_index, label_smoothing, logit_scale, lse_square_scale, softcap,
            HAS_SMOOTHING, HAS_SOFTCAP, ADD_LSE, not PRECOMPUTED_LSE)
        if WRITE_GRAD:
            # Second sweep: overwrite the logits with their gradient (the fused linear path consumes it
            # at once, so nothing else is allocated). The scale is a device scalar (1 / #valid for a mean).
            coef = tl.where(valid, tl.load(GRAD_SCALE).to(tl.float32) * logit_scale, 0.0)
            zfac = 1.0 + 2.0 * lse_square_scale * lse
            for c0 in range(0, V, BLOCK_V):
                cols = c0 + tl.arange(0, BLOCK_V)[None, :]
                mask = (cols < V) & row_ok[:, None]
                z = _z_tile(LOGITS, row_off, cols, mask, logit_scale, softcap, HAS_SOFTCAP)
                g = _grad_tile(z, cols, lse, zfac, coef, local, bad, label_smoothing, total_classes, softcap,
                               HAS_SMOOTHING, HAS_SOFTCAP)
                tl.store(LOGITS + row_off[:, None] + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_combine_kernel(
    LOGITS, LABELS, PART, LOSS, ZLOSS, LSE,
    stride_row, stride_v, N, V, n_splits, vocab_start, total_classes, ignore_index,
    label_smoothing, logit_scale, lse_square_scale, softcap,
    HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ADD_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the per-split ``(max, sum exp, sum z)`` of a block of rows and finish their loss (logits of any
    ``(stride_row, stride_v)``: the vocab-major path of ``vocab_major.py`` shares it)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows_c = tl.minimum(rows, N - 1)
    sp = tl.arange(0, BLOCK_S)[None, :]
    sp_ok = sp < n_splits
    plane = n_splits.to(tl.int64) * N
    off = sp.to(tl.int64) * N + rows_c[:, None]
    m_p = tl.load(PART + off, mask=sp_ok, other=float("-inf"))
    m = tl.max(m_p, axis=1)
    acc = tl.sum(tl.load(PART + plane + off, mask=sp_ok, other=0.0) * tl.exp(m_p - m[:, None]), axis=1)
    lse = m + tl.log(acc)
    sum_z = tl.sum(tl.load(PART + 2 * plane + off, mask=sp_ok, other=0.0), axis=1)
    _finish_rows(LOGITS, LABELS, LOSS, ZLOSS, LSE, rows, rows_c, row_ok, rows_c * stride_row, stride_v, lse, sum_z, V,
                 vocab_start, total_classes, ignore_index, label_smoothing, logit_scale, lse_square_scale, softcap,
                 HAS_SMOOTHING, HAS_SOFTCAP, ADD_LSE, True)


@triton.jit
def _cross_entropy_bwd_kernel(
    DLOGITS, DLOSS, LOGITS, LSE, LABELS,
    stride_row, stride_drow, stride_dloss, N, V, vocab_start, total_classes, ignore_index,
    label_smoothing, logit_scale, lse_square_scale, softcap,
    HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program ``(m, v)`` writes the gradient of rows block ``m``, columns block ``v``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows_c = tl.minimum(rows, N - 1)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    mask = (cols < V) & row_ok[:, None]
    valid, local, _, bad = _row_labels(LABELS, rows_c, row_ok, V, vocab_start, total_classes, ignore_index)
    # stride_dloss may be 0: the gradient of a sum arrives as one broadcast value.
    dloss = tl.load(DLOSS + rows_c * stride_dloss).to(tl.float32)
    coef = tl.where(valid, dloss * logit_scale, 0.0)
    lse = tl.load(LSE + rows_c).to(tl.float32)
    zfac = 1.0 + 2.0 * lse_square_scale * lse
    z = _z_tile(LOGITS, rows_c * stride_row, cols, mask, logit_scale, softcap, HAS_SOFTCAP)
    g = _grad_tile(z, cols, lse, zfac, coef, local, bad, label_smoothing, total_classes, softcap,
                   HAS_SMOOTHING, HAS_SOFTCAP)
    tl.store(DLOGITS + (rows_c * stride_drow)[:, None] + cols, g.to(DLOGITS.dtype.element_ty), mask=mask)
