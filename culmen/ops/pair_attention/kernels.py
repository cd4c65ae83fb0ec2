"""Triton kernels of attention with an additive pair bias and a logit mask (OpenFold's MSA row / column
attention and triangle attention), forward and backward including the bias gradient.

Every tensor is addressed in a canonical 5-d layout ``[Z1, Z2, H, rows, cols]`` through its strides, so
OpenFold's ``[B, I, H, N, D]`` projections (often transposed views) are read in place and a bias or
mask broadcast over any of the three leading dims has stride 0 there. Per row ``m`` of one ``(z1, z2,
h)`` slice, in the log2 domain (``LOG2E`` folded into the scale):

    s[m, n] = (q[m] . k[n]) * scale + bias[m, n] + (mask[m, n] != 1 ? (mask[m, n] - 1) * inf : 0)
    o[m]    = sum_n softmax(s[m])[n] v[n]

which is Apex's ``matmul(q * scale, k^T) + (mask - 1) * inf + bias -> softmax -> matmul(., v)`` for any
mask value (the ``!= 1`` test only keeps ``0 * inf`` out for an infinite ``inf``). A mask with one row
(OpenFold's key masks ``[B, I, 1, 1, N]``, ``MASK_ROWS`` off) is read as a vector per column block.

Memory is O(rows) per row block in the forward (running max and sum, one fp32 log-sum-exp per row
saved). Kernels:

* ``_pair_attn_fwd_kernel``: grid ``(Z1*Z2*H, row blocks)``; writes ``O`` and ``LSE`` (log2 units).
* ``_pair_attn_bwd_delta_kernel``: ``DELTA[m] = sum_d O[m, d] dO[m, d]`` (fp32), once per backward.
* ``_pair_attn_bwd_kv_kernel``: grid ``(Z1*Z2*H, column blocks)``, loops over row blocks; computes each
  probability tile and ``dS`` tile once (transposed, ``[cols, rows]``, so every dot's left operand is a
  register tile), accumulates ``dK`` and ``dV`` and, with ``STORE_DS``, stores ``dS`` (the gradient of
  the logits) for the two passes below: 4 matmuls per tile.
* ``_pair_attn_bwd_dq_staged_kernel``: ``dQ = dS K * scale`` from the stored ``dS`` (1 matmul per tile).
* ``_pair_attn_bwd_dbias_reduce_kernel``: grid ``(kept slices, row blocks, column blocks)``: ``dS``
  summed over the dims the bias is broadcast on (triangle attention: over ``I``) in fp32 registers, one
  store per tile, no atomics (bitwise reproducible).
* ``_pair_attn_bwd_dq_kernel``: ``dQ`` recomputing ``P`` and ``dS`` (3 matmuls per tile) when no bias
  gradient is wanted and the plan keeps the backward's memory O(rows) (no ``dS`` buffer).
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
def _load_cols(base, rows, s_r, dd, s_d, R, D):
    """The transposed ``[BLOCK_D, len(rows)]`` tile of a ``(rows, D)`` matrix at ``base``, zeros outside."""
    return tl.load(base + rows[None, :] * s_r + dd[:, None] * s_d, mask=(rows[None, :] < R) & (dd[:, None] < D),
                   other=0.0)


@triton.jit
def _mask_add(mk, inf_log2):
    """The additive log2-domain logit term of mask values ``mk`` (0 where ``mk == 1``)."""
    mk = mk.to(tl.float32)
    return tl.where(mk != 1.0, (mk - 1.0) * inf_log2, 0.0)


@triton.jit
def _scores(q, k, b_base, m_base, rows, cols, sb_m, sb_n, sm_m, sm_n, M, N, scale_log2, inf_log2,
            HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROWS: tl.constexpr, DOT_PREC: tl.constexpr,
            UPCAST: tl.constexpr):
    """Log2-domain logits ``[BLOCK_M, BLOCK_N]`` of a tile; columns past ``N`` are ``-inf``."""
    s = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_BIAS:
        b = tl.load(b_base + rows[:, None] * sb_m + cols[None, :] * sb_n, mask=inside, other=0.0)
        s += b.to(tl.float32) * LOG2E
    if HAS_MASK:
        if MASK_ROWS:
            s += _mask_add(tl.load(m_base + rows[:, None] * sm_m + cols[None, :] * sm_n, mask=inside, other=1),
                           inf_log2)
        else:
            s += _mask_add(tl.load(m_base + cols * sm_n, mask=cols < N, other=1), inf_log2)[None, :]
    return tl.where(cols[None, :] < N, s, float("-inf"))


@triton.jit(do_not_specialize=["Z2", "M", "N"])
def _pair_attn_fwd_kernel(Q, K, V, BIAS, MSK, OUT, LSE,
                          sq1, sq2, sqh, sqm, sqd, sk1, sk2, skh, skn, skd, sv1, sv2, svh, svn, svd,
                          sb1, sb2, sbh, sbm, sbn, sm1, sm2, smh, smm, smn,
                          Z2, H, M, N, D, scale_log2, inf_log2,
                          HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROWS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
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
                    HAS_BIAS, HAS_MASK, MASK_ROWS, DOT_PREC, UPCAST)
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
def _pair_attn_bwd_kv_kernel(Q, K, V, BIAS, MSK, DO, LSE, DELTA, DK, DV, DS,
                             sq1, sq2, sqh, sqm, sqd, sk1, sk2, skh, skn, skd, sv1, sv2, svh, svn, svd,
                             sb1, sb2, sbh, sbm, sbn, sm1, sm2, smh, smm, smn,
                             Z2, H, M, N, D, scale, scale_log2, inf_log2,
                             HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROWS: tl.constexpr,
                             STORE_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Program ``(slice, column block)``: ``dK`` and ``dV`` (contiguous ``[slices, N, D]``) of its columns and,
    with ``STORE_DS``, ``dS`` into ``DS`` (contiguous ``[slices, M, N]``, its own dtype).

    Tiles are transposed (``[BLOCK_N, BLOCK_M]``: ``s^T = K Q^T``) so that ``dV += P^T dO`` and
    ``dK += dS^T Q`` take the probability tiles as register operands, with no layout transposes."""
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
    # A key mask is the same for every row: its logit term is loaded once per program.
    madd = tl.zeros([BLOCK_N], tl.float32)
    if HAS_MASK:
        if not MASK_ROWS:
            madd = _mask_add(tl.load(m_base + cols * smn, mask=cols < N, other=1), inf_log2)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        inside = (cols[:, None] < N) & (rows[None, :] < M)
        qt = _load_cols(q_base, rows, sqm, dd, sqd, M, D)
        st = _dot(k, qt, DOT_PREC, UPCAST) * scale_log2
        if HAS_BIAS:
            b = tl.load(b_base + rows[None, :] * sbm + cols[:, None] * sbn, mask=inside, other=0.0)
            st += b.to(tl.float32) * LOG2E
        if HAS_MASK:
            if MASK_ROWS:
                st += _mask_add(tl.load(m_base + rows[None, :] * smm + cols[:, None] * smn, mask=inside, other=1),
                                inf_log2)
            else:
                st += madd[:, None]
        # +inf past the last row: those probabilities are exactly 0. Columns past N are never stored.
        lse = tl.load(LSE + bh64 * M + rows, mask=rows < M, other=float("inf"))
        pt = tl.exp2(st - lse[None, :])
        do = _load_rows(do_base, rows, D, dd, 1, M, D)
        dv += _dot(pt.to(do.dtype), do, DOT_PREC, UPCAST)
        dpt = _dot(v, tl.trans(do), DOT_PREC, UPCAST)
        delta = tl.load(DELTA + bh64 * M + rows, mask=rows < M, other=0.0)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(qt.dtype), tl.trans(qt), DOT_PREC, UPCAST)
        if STORE_DS:
            tl.store(DS + bh64 * M * N + rows[None, :] * N + cols[:, None], dst.to(DS.dtype.element_ty),
                     mask=inside)
    out = bh64 * N * D + cols[:, None] * D + dd[None, :]
    ok = (cols[:, None] < N) & (dd[None, :] < D)
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["Z2", "M", "N"])
def _pair_attn_bwd_dq_staged_kernel(K, DS, DQ, sk1, sk2, skh, skn, skd, Z2, H, M, N, D, scale,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Program ``(slice, row block)``: ``dQ = dS K * scale`` (contiguous ``[slices, M, D]``) from the stored
    ``dS`` (contiguous ``[slices, M, N]``), cast to K's dtype for the matmul."""
    bh = tl.program_id(0)
    z1, z2, h = _slice(bh, Z2, H)
    bh64 = bh.to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    k_base = K + z1 * sk1 + z2 * sk2 + h * skh
    ds_base = DS + bh64 * M * N
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ds = tl.load(ds_base + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < N),
                     other=0.0)
        k = _load_rows(k_base, cols, skn, dd, skd, N, D)
        dq += _dot(ds.to(k.dtype), k, DOT_PREC, UPCAST)
    tl.store(DQ + bh64 * M * D + rows[:, None] * D + dd[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < M) & (dd[None, :] < D))


@triton.jit(do_not_specialize=["Z2", "M", "N", "R"])
def _pair_attn_bwd_dbias_reduce_kernel(DS, DB, Z2, H, M, N, KZ2, KH, RZ2, RH, R, BLOCK_M: tl.constexpr,
                                       BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    """Program ``(kept slice g, row block, column block)``: ``DB[g]`` tile (contiguous ``[kept, M, N]``) = the
    fp32 sum over the ``R`` reduced slices of ``DS`` (contiguous ``[slices, M, N]``). Each of ``z1, z2, h``
    is either kept (``K* = size``, ``R* = 1``) or reduced (``K* = 1``, ``R* = size``), so ``index = kept
    part + reduced part``. ``UNROLL`` loads are issued before they are summed (memory-level parallelism)."""
    g = tl.program_id(0).to(tl.int64)
    kh = g % KH
    kz = g // KH
    kz2 = kz % KZ2
    kz1 = kz // KZ2
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = rows[:, None] * N + cols[None, :]
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, R, UNROLL):
        for u in tl.static_range(UNROLL):
            r = tl.cast(r0 + u, tl.int64)
            rh = r % RH
            rz = r // RH
            bh = ((kz1 + rz // RZ2) * Z2 + kz2 + rz % RZ2) * H + kh + rh
            acc += tl.load(DS + bh * M * N + offs, mask=ok & (rows[:, None] * 0 + r < R), other=0.0).to(tl.float32)
    tl.store(DB + g * M * N + offs, acc.to(DB.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["Z2", "M", "N"])
def _pair_attn_bwd_dq_kernel(Q, K, V, BIAS, MSK, DO, LSE, DELTA, DQ,
                             sq1, sq2, sqh, sqm, sqd, sk1, sk2, skh, skn, skd, sv1, sv2, svh, svn, svd,
                             sb1, sb2, sbh, sbm, sbn, sm1, sm2, smh, smm, smn,
                             Z2, H, M, N, D, scale, scale_log2, inf_log2,
                             HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROWS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Program ``(slice, row block)``: ``dQ`` (contiguous ``[slices, M, D]``) of its rows, recomputing the
    probabilities and ``dS`` tile by tile (no ``dS`` buffer)."""
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
                    HAS_BIAS, HAS_MASK, MASK_ROWS, DOT_PREC, UPCAST)
        p = tl.exp2(s - lse[:, None])
        v = _load_rows(v_base, cols, svn, dd, svd, N, D)
        dp = _dot(do, tl.trans(v), DOT_PREC, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_PREC, UPCAST)
    tl.store(DQ + bh64 * M * D + rows[:, None] * D + dd[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < M) & (dd[None, :] < D))
