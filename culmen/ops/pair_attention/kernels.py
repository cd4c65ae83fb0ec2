"""Triton kernels of attention with an additive pair bias and a logit mask (OpenFold's MSA row / column
attention and triangle attention), forward and backward including the bias gradient.

Every tensor is addressed in a canonical 5-d layout ``[Z1, Z2, H, rows, cols]`` through its strides, so
OpenFold's ``[B, I, H, N, D]`` projections (often transposed views) are read in place and a bias or
mask broadcast over any of the three leading dims has stride 0 there. Per row ``m`` of one ``(z1, z2,
h)`` slice, in the log2 domain (``LOG2E`` folded into the scale):

    s[m, n] = (q[m] . k[n]) * scale + bias[m, n] + (mask[m, n] != 1 ? (mask[m, n] - 1) * inf : 0)
    o[m]    = sum_n softmax(s[m])[n] v[n]

which is Apex's ``matmul(q * scale, k^T) + (mask - 1) * inf + bias -> softmax -> matmul(., v)`` for any
mask value (the ``!= 1`` test only keeps ``0 * inf`` out for an infinite ``inf``).

Memory is O(rows) per row block: the forward keeps a running max and sum (the flash-attention
recurrence) and saves one fp32 log-sum-exp per row; the backward recomputes the probabilities tile by
tile. Kernels:

* ``_pair_attn_fwd_kernel``: grid ``(Z1*Z2*H, row blocks)``; writes ``O`` and ``LSE`` (log2 units).
* ``_pair_attn_bwd_delta_kernel``: ``DELTA[m] = sum_d O[m, d] dO[m, d]`` (fp32).
* ``_pair_attn_bwd_dkdv_kernel``: grid ``(Z1*Z2*H, column blocks)``, loops over row blocks.
* ``_pair_attn_bwd_dq_kernel``: grid ``(Z1*Z2*H, row blocks)``, loops over column blocks; when the bias
  is broadcast over none of ``(z1, z2, h)`` it also stores ``dS`` (the bias gradient) in place.
* ``_pair_attn_bwd_dbias_kernel``: grid ``(kept slices, row blocks, column blocks)``: the bias gradient
  summed over the dims the bias is broadcast on (triangle attention: over ``I``) in registers, one fp32
  tile per program, no atomics (bitwise reproducible).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``UPCAST`` (CPU interpreter only: its bf16 dot is wrong) multiplies
    the exactly upcast fp32 operands."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _slice(bh, Z2, H):
    """``(z1, z2, h)`` (int64) of the flattened slice index ``bh = (z1 * Z2 + z2) * H + h``."""
    bh = bh.to(tl.int64)
    h = bh % H
    z = bh // H
    return z // Z2, z % Z2, h


@triton.jit
def _load_rows(base, rows, s_r, dd, s_d, R, D):
    """A ``[len(rows), BLOCK_D]`` tile of a ``(rows, D)`` matrix at ``base``, zeros outside."""
    return tl.load(base + rows[:, None] * s_r + dd[None, :] * s_d, mask=(rows[:, None] < R) & (dd[None, :] < D),
                   other=0.0)


@triton.jit
def _scores(q, k, b_base, m_base, rows, cols, sb_m, sb_n, sm_m, sm_n, M, N, scale_log2, inf_log2,
            HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Log2-domain logits ``[BLOCK_M, BLOCK_N]`` of a tile; columns past ``N`` are ``-inf``."""
    s = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_BIAS:
        b = tl.load(b_base + rows[:, None] * sb_m + cols[None, :] * sb_n, mask=inside, other=0.0)
        s += b.to(tl.float32) * LOG2E
    if HAS_MASK:
        mk = tl.load(m_base + rows[:, None] * sm_m + cols[None, :] * sm_n, mask=inside, other=1).to(tl.float32)
        s += tl.where(mk != 1.0, (mk - 1.0) * inf_log2, 0.0)
    return tl.where(cols[None, :] < N, s, float("-inf"))


@triton.jit(do_not_specialize=["Z2", "M", "N"])
def _pair_attn_fwd_kernel(Q, K, V, BIAS, MSK, OUT, LSE,
                          sq1, sq2, sqh, sqm, sqd, sk1, sk2, skh, skn, skd, sv1, sv2, svh, svn, svd,
                          sb1, sb2, sbh, sbm, sbn, sm1, sm2, smh, smm, smn,
                          Z2, H, M, N, D, scale_log2, inf_log2,
                          HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                          UPCAST: tl.constexpr):
    """Program ``(slice, row block)``: ``OUT`` (contiguous ``[slices, M, D]``) and ``LSE`` (``[slices, M]``)."""
    bh = tl.program_id(0)
    z1, z2, h = _slice(bh, Z2, H)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + z1 * sq1 + z2 * sq2 + h * sqh, rows, sqm, dd, sqd, M, D)
    k_base = K + z1 * sk1 + z2 * sk2 + h * skh
    v_base = V + z1 * sv1 + z2 * sv2 + h * svh
    b_base = BIAS + z1 * sb1 + z2 * sb2 + h * sbh
    m_base = MSK + z1 * sm1 + z2 * sm2 + h * smh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, skn, dd, skd, N, D)
        s = _scores(q, k, b_base, m_base, rows, cols, sbm, sbn, smm, smn, M, N, scale_log2, inf_log2,
                    HAS_BIAS, HAS_MASK, DOT_PREC, UPCAST)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, cols, svn, dd, svd, N, D)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, UPCAST)
        m_i = m_new
    acc = acc / l_i[:, None]
    row_ok = rows < M
    o_ptrs = OUT + bh.to(tl.int64) * M * D + rows[:, None] * D + dd[None, :]
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (dd[None, :] < D))
    tl.store(LSE + bh.to(tl.int64) * M + rows, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit(do_not_specialize=["M"])
def _pair_attn_bwd_delta_kernel(OUT, DO, DELTA, M, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``DELTA[slice, m] = sum_d OUT * dO`` in fp32 (both contiguous ``[slices, M, D]``)."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    o = _load_rows(OUT + bh * M * D, rows, D, dd, 1, M, D).to(tl.float32)
    do = _load_rows(DO + bh * M * D, rows, D, dd, 1, M, D).to(tl.float32)
    tl.store(DELTA + bh * M + rows, tl.sum(o * do, 1), mask=rows < M)


@triton.jit(do_not_specialize=["Z2", "M", "N"])
def _pair_attn_bwd_dkdv_kernel(Q, K, V, BIAS, MSK, DO, LSE, DELTA, DK, DV,
                               sq1, sq2, sqh, sqm, sqd, sk1, sk2, skh, skn, skd, sv1, sv2, svh, svn, svd,
                               sb1, sb2, sbh, sbm, sbn, sm1, sm2, smh, smm, smn,
                               Z2, H, M, N, D, scale, scale_log2, inf_log2,
                               HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                               UPCAST: tl.constexpr):
    """Program ``(slice, column block)``: ``dK`` and ``dV`` (contiguous ``[slices, N, D]``) of its columns."""
    bh = tl.program_id(0)
    z1, z2, h = _slice(bh, Z2, H)
    bh64 = bh.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    k = _load_rows(K + z1 * sk1 + z2 * sk2 + h * skh, cols, skn, dd, skd, N, D)
    v = _load_rows(V + z1 * sv1 + z2 * sv2 + h * svh, cols, svn, dd, svd, N, D)
    q_base = Q + z1 * sq1 + z2 * sq2 + h * sqh
    b_base = BIAS + z1 * sb1 + z2 * sb2 + h * sbh
    m_base = MSK + z1 * sm1 + z2 * sm2 + h * smh
    do_base = DO + bh64 * M * D
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base, rows, sqm, dd, sqd, M, D)
        s = _scores(q, k, b_base, m_base, rows, cols, sbm, sbn, smm, smn, M, N, scale_log2, inf_log2,
                    HAS_BIAS, HAS_MASK, DOT_PREC, UPCAST)
        # +inf past the last row: those probabilities are exactly 0.
        lse = tl.load(LSE + bh64 * M + rows, mask=rows < M, other=float("inf"))
        p = tl.exp2(s - lse[:, None])
        do = _load_rows(do_base, rows, D, dd, 1, M, D)
        dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PREC, UPCAST)
        dp = _dot(do, tl.trans(v), DOT_PREC, UPCAST)
        delta = tl.load(DELTA + bh64 * M + rows, mask=rows < M, other=0.0)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PREC, UPCAST)
    out = bh64 * N * D + cols[:, None] * D + dd[None, :]
    ok = (cols[:, None] < N) & (dd[None, :] < D)
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["Z2", "M", "N"])
def _pair_attn_bwd_dq_kernel(Q, K, V, BIAS, MSK, DO, LSE, DELTA, DQ, DB,
                             sq1, sq2, sqh, sqm, sqd, sk1, sk2, skh, skn, skd, sv1, sv2, svh, svn, svd,
                             sb1, sb2, sbh, sbm, sbn, sm1, sm2, smh, smm, smn,
                             Z2, H, M, N, D, scale, scale_log2, inf_log2,
                             HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, STORE_DS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Program ``(slice, row block)``: ``dQ`` (contiguous ``[slices, M, D]``) of its rows; with ``STORE_DS``
    also ``dS`` into ``DB`` (contiguous ``[slices, M, N]``: the bias gradient when nothing is summed)."""
    bh = tl.program_id(0)
    z1, z2, h = _slice(bh, Z2, H)
    bh64 = bh.to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + z1 * sq1 + z2 * sq2 + h * sqh, rows, sqm, dd, sqd, M, D)
    do = _load_rows(DO + bh64 * M * D, rows, D, dd, 1, M, D)
    lse = tl.load(LSE + bh64 * M + rows, mask=rows < M, other=float("inf"))
    delta = tl.load(DELTA + bh64 * M + rows, mask=rows < M, other=0.0)
    k_base = K + z1 * sk1 + z2 * sk2 + h * skh
    v_base = V + z1 * sv1 + z2 * sv2 + h * svh
    b_base = BIAS + z1 * sb1 + z2 * sb2 + h * sbh
    m_base = MSK + z1 * sm1 + z2 * sm2 + h * smh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, skn, dd, skd, N, D)
        s = _scores(q, k, b_base, m_base, rows, cols, sbm, sbn, smm, smn, M, N, scale_log2, inf_log2,
                    HAS_BIAS, HAS_MASK, DOT_PREC, UPCAST)
        p = tl.exp2(s - lse[:, None])
        v = _load_rows(v_base, cols, svn, dd, svd, N, D)
        dp = _dot(do, tl.trans(v), DOT_PREC, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_PREC, UPCAST)
        if STORE_DS:
            tl.store(DB + bh64 * M * N + rows[:, None] * N + cols[None, :], ds.to(DB.dtype.element_ty),
                     mask=(rows[:, None] < M) & (cols[None, :] < N))
    tl.store(DQ + bh64 * M * D + rows[:, None] * D + dd[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < M) & (dd[None, :] < D))


@triton.jit(do_not_specialize=["Z2", "M", "N", "R"])
def _pair_attn_bwd_dbias_kernel(Q, K, V, BIAS, MSK, DO, LSE, DELTA, DB,
                                sq1, sq2, sqh, sqm, sqd, sk1, sk2, skh, skn, skd, sv1, sv2, svh, svn, svd,
                                sb1, sb2, sbh, sbm, sbn, sm1, sm2, smh, smm, smn,
                                Z2, H, M, N, D, KZ2, KH, RZ2, RH, R, scale_log2, inf_log2,
                                HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Program ``(kept slice g, row block, column block)``: ``DB[g]`` tile = sum over the ``R`` reduced
    slices of ``dS``. Each of ``z1, z2, h`` is either kept (``K* = size``, ``R* = 1``) or reduced
    (``K* = 1``, ``R* = size``, bias stride 0), so ``index = kept part + reduced part``."""
    g = tl.program_id(0).to(tl.int64)
    kh = g % KH
    kz = g // KH
    kz2 = kz % KZ2
    kz1 = kz // KZ2
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    # The reduced dims have bias stride 0: the bias pointer is the same for every r.
    b_base = BIAS + kz1 * sb1 + kz2 * sb2 + kh * sbh
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r in range(0, R):
        r64 = tl.cast(r, tl.int64)
        rh = r64 % RH
        rz = r64 // RH
        z1 = kz1 + rz // RZ2
        z2 = kz2 + rz % RZ2
        h = kh + rh
        bh = (z1 * Z2 + z2) * H + h
        q = _load_rows(Q + z1 * sq1 + z2 * sq2 + h * sqh, rows, sqm, dd, sqd, M, D)
        k = _load_rows(K + z1 * sk1 + z2 * sk2 + h * skh, cols, skn, dd, skd, N, D)
        s = _scores(q, k, b_base, MSK + z1 * sm1 + z2 * sm2 + h * smh, rows, cols, sbm, sbn, smm, smn, M, N,
                    scale_log2, inf_log2, True, HAS_MASK, DOT_PREC, UPCAST)
        lse = tl.load(LSE + bh * M + rows, mask=rows < M, other=float("inf"))
        delta = tl.load(DELTA + bh * M + rows, mask=rows < M, other=0.0)
        p = tl.exp2(s - lse[:, None])
        do = _load_rows(DO + bh * M * D, rows, D, dd, 1, M, D)
        v = _load_rows(V + z1 * sv1 + z2 * sv2 + h * svh, cols, svn, dd, svd, N, D)
        dp = _dot(do, tl.trans(v), DOT_PREC, UPCAST)
        acc += p * (dp - delta[:, None])
    tl.store(DB + g * M * N + rows[:, None] * N + cols[None, :], acc.to(DB.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
