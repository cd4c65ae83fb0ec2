"""Triton kernels of ``index_mul_2d``: ``out[n] = in1[idx[n]] * in2[n]`` over rows of 2-D tensors.

Every kernel walks ``(BLOCK_N, BLOCK_F)`` tiles of the ``(N, F)`` row space of ``in2`` (one index per
row, the feature dim contiguous). Row strides are arguments, so row-padded views need no copy.

The gradient of ``in1`` is a scatter-add over repeated indices. Two ways:

* the sorted segmented sum (the default): the indices are sorted once (stable) and
  ``_index_mul_2d_bwd_segment_kernel`` gives each program a block of ``in1`` rows; it walks the
  positions of each row's indices in order, adds the products in fp32 registers and writes ``grad_in1``
  once, in its dtype; the same pass writes ``grad_in2 = grad_out * in1[idx]`` with each ``in1`` row
  loaded once. Every byte moves once (an fp32 atomic buffer costs a zero fill, read-modify-writes that
  miss L2, and a conversion pass) and the result is bitwise reproducible;
* atomics (``ATOMIC=True``, ``TUNING["scatter"] = "atomic"``, never in deterministic mode): each tile
  adds its products into an fp32 (fp64 for fp64 inputs) buffer with ``tl.atomic_add``.

Indices outside ``[0, M)`` never address memory: their output rows are NaN and they scatter nothing
(the op layer raises on them where it can check values cheaply).
"""

import triton
import triton.language as tl


@triton.jit
def _rows(IDX, N, M, BLOCK_N: tl.constexpr):
    """Rows of this program's tile, their mask, the gathered indices (int64) and where they are valid."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    idx = tl.load(IDX + rows, mask=row_ok, other=0).to(tl.int64)
    idx_ok = row_ok & (idx >= 0) & (idx < M)
    return rows.to(tl.int64), row_ok, idx, idx_ok


@triton.jit
def _cols(F, BLOCK_F: tl.constexpr):
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    return cols, cols < F


@triton.jit(do_not_specialize=["N", "M"])
def _index_mul_2d_fwd_kernel(OUT, IN1, IN2, IDX, N, M, F, s_out, s_in1, s_in2,
                             ACC: tl.constexpr, HINTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """``OUT[n] = IN1[IDX[n]] * IN2[n]``; also the gradient of ``in2`` (``grad * in1[idx]``).

    ``HINTS``: ``in2`` and ``out`` stream through L2 (evict first) so that the gathered ``in1`` rows, read
    ``N / M`` times each on average, stay there (evict last).
    """
    rows, row_ok, idx, idx_ok = _rows(IDX, N, M, BLOCK_N)
    cols, col_ok = _cols(F, BLOCK_F)
    m2 = row_ok[:, None] & col_ok[None, :]
    g1 = idx_ok[:, None] & col_ok[None, :]
    if HINTS:
        a = tl.load(IN1 + idx[:, None] * s_in1 + cols[None, :], mask=g1, other=float("nan"),
                    eviction_policy="evict_last")
        b = tl.load(IN2 + rows[:, None] * s_in2 + cols[None, :], mask=m2, other=0.0, eviction_policy="evict_first")
        y = (a.to(ACC) * b.to(ACC)).to(OUT.dtype.element_ty)
        tl.store(OUT + rows[:, None] * s_out + cols[None, :], y, mask=m2, eviction_policy="evict_first")
    else:
        a = tl.load(IN1 + idx[:, None] * s_in1 + cols[None, :], mask=g1, other=float("nan")).to(ACC)
        b = tl.load(IN2 + rows[:, None] * s_in2 + cols[None, :], mask=m2, other=0.0).to(ACC)
        tl.store(OUT + rows[:, None] * s_out + cols[None, :], (a * b).to(OUT.dtype.element_ty), mask=m2)


@triton.jit(do_not_specialize=["N", "M"])
def _index_mul_2d_bwd_kernel(GIN1, GIN2, GOUT, IN1, IN2, IDX, N, M, F, s_gin1, s_gin2, s_gout, s_in1, s_in2,
                             ACC: tl.constexpr, ATOMIC: tl.constexpr, NEED_GIN1: tl.constexpr,
                             NEED_GIN2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """``GIN2[n] = GOUT[n] * IN1[IDX[n]]`` and, with ``ATOMIC``, ``GIN1[IDX[n]] += GOUT[n] * IN2[n]``."""
    rows, row_ok, idx, idx_ok = _rows(IDX, N, M, BLOCK_N)
    cols, col_ok = _cols(F, BLOCK_F)
    m2 = row_ok[:, None] & col_ok[None, :]
    g1 = idx_ok[:, None] & col_ok[None, :]
    g = tl.load(GOUT + rows[:, None] * s_gout + cols[None, :], mask=m2, other=0.0).to(ACC)
    if NEED_GIN2:
        a = tl.load(IN1 + idx[:, None] * s_in1 + cols[None, :], mask=g1, other=float("nan")).to(ACC)
        tl.store(GIN2 + rows[:, None] * s_gin2 + cols[None, :], (g * a).to(GIN2.dtype.element_ty), mask=m2)
    if NEED_GIN1 and ATOMIC:
        b = tl.load(IN2 + rows[:, None] * s_in2 + cols[None, :], mask=m2, other=0.0).to(ACC)
        tl.atomic_add(GIN1 + idx[:, None] * s_gin1 + cols[None, :], (g * b).to(GIN1.dtype.element_ty), mask=g1,
                      sem="relaxed")


@triton.jit(do_not_specialize=["N", "M"])
def _index_mul_2d_bwd_bwd_kernel(GGOUT, GIN1, GIN2, GOUT, GG1, GG2, IN1, IN2, IDX, N, M, F,
                                 s_ggout, s_gin1, s_gin2, s_gout, s_gg1, s_gg2, s_in1, s_in2,
                                 ACC: tl.constexpr, ATOMIC: tl.constexpr, HAS_GG1: tl.constexpr,
                                 HAS_GG2: tl.constexpr, NEED_GGOUT: tl.constexpr, NEED_GIN1: tl.constexpr,
                                 NEED_GIN2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """Double backward of ``out = in1[idx] * in2`` given the grads ``GG1`` / ``GG2`` of ``(gin1, gin2)``:

    ``GGOUT = GG1[idx] * IN2 + GG2 * IN1[idx]``, ``GIN2 = GG1[idx] * GOUT`` and, with ``ATOMIC``,
    ``GIN1[idx] += GG2 * GOUT``. A missing ``GG1`` / ``GG2`` counts as zeros.
    """
    rows, row_ok, idx, idx_ok = _rows(IDX, N, M, BLOCK_N)
    cols, col_ok = _cols(F, BLOCK_F)
    m2 = row_ok[:, None] & col_ok[None, :]
    g1 = idx_ok[:, None] & col_ok[None, :]
    roff = rows[:, None]
    coff = cols[None, :]
    ggo = tl.zeros([BLOCK_N, BLOCK_F], dtype=ACC)
    if HAS_GG1:
        gg1 = tl.load(GG1 + idx[:, None] * s_gg1 + coff, mask=g1, other=float("nan")).to(ACC)
        if NEED_GGOUT:
            ggo += gg1 * tl.load(IN2 + roff * s_in2 + coff, mask=m2, other=0.0).to(ACC)
        if NEED_GIN2:
            g = tl.load(GOUT + roff * s_gout + coff, mask=m2, other=0.0).to(ACC)
            tl.store(GIN2 + roff * s_gin2 + coff, (gg1 * g).to(GIN2.dtype.element_ty), mask=m2)
    elif NEED_GIN2:
        tl.store(GIN2 + roff * s_gin2 + coff, tl.zeros([BLOCK_N, BLOCK_F], dtype=GIN2.dtype.element_ty), mask=m2)
    if HAS_GG2:
        gg2 = tl.load(GG2 + roff * s_gg2 + coff, mask=m2, other=0.0).to(ACC)
        if NEED_GGOUT:
            ggo += gg2 * tl.load(IN1 + idx[:, None] * s_in1 + coff, mask=g1, other=float("nan")).to(ACC)
        if NEED_GIN1 and ATOMIC:
            g = tl.load(GOUT + roff * s_gout + coff, mask=m2, other=0.0).to(ACC)
            tl.atomic_add(GIN1 + idx[:, None] * s_gin1 + coff, (gg2 * g).to(GIN1.dtype.element_ty), mask=g1,
                          sem="relaxed")
    if NEED_GGOUT:
        tl.store(GGOUT + roff * s_ggout + coff, ggo.to(GGOUT.dtype.element_ty), mask=m2)


@triton.jit(do_not_specialize=["N", "M"])
def _index_mul_2d_bwd_segment_kernel(GIN1, GIN2, GOUT, IN1, IN2, PERM, STARTS, N, M, F,
                                     s_gin1, s_gin2, s_gout, s_in1, s_in2,
                                     ACC: tl.constexpr, NEED_GIN1: tl.constexpr, NEED_GIN2: tl.constexpr,
                                     BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """Program ``(b, f)``: ``in1`` rows ``[b*BLOCK_M, (b+1)*BLOCK_M)``, features block ``f``.

    ``PERM`` is the stable sort permutation of the indices and ``STARTS`` ``(M + 1,)`` where each value's
    run begins. Row ``m`` walks its positions ``k`` in order (``n = PERM[k]`` increasing):
    ``GIN1[m] = sum_n GOUT[n] * IN2[n]`` (in ``ACC``, stored once; zeros for rows no index points at) and
    ``GIN2[n] = GOUT[n] * IN1[m]``. The rows of a block walk in lockstep, as long as the longest run.
    Positions of indices outside ``[0, M)`` (sorted to the two ends) get NaN rows in ``GIN2``, as the
    forward gives them.
    """
    pid = tl.program_id(0)
    ms = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    k0 = tl.load(STARTS + ms, mask=m_ok, other=0)
    cnt = tl.load(STARTS + ms + 1, mask=m_ok, other=0) - k0
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    coff = cols[None, :]
    ms64 = ms.to(tl.int64)[:, None]
    m2 = m_ok[:, None] & col_ok[None, :]
    if NEED_GIN2:
        a = tl.load(IN1 + ms64 * s_in1 + coff, mask=m2, other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_F], dtype=ACC)
    for j in range(0, tl.max(cnt, axis=0)):
        has = j < cnt
        p = tl.load(PERM + k0 + j, mask=has, other=0).to(tl.int64)[:, None]
        msk = has[:, None] & col_ok[None, :]
        g = tl.load(GOUT + p * s_gout + coff, mask=msk, other=0.0).to(ACC)
        if NEED_GIN1:
            acc += g * tl.load(IN2 + p * s_in2 + coff, mask=msk, other=0.0).to(ACC)
        if NEED_GIN2:
            tl.store(GIN2 + p * s_gin2 + coff, (g * a).to(GIN2.dtype.element_ty), mask=msk)
    if NEED_GIN1:
        tl.store(GIN1 + ms64 * s_gin1 + coff, acc.to(GIN1.dtype.element_ty), mask=m2)
    if NEED_GIN2:
        # The first block also writes the positions below STARTS[0], the last those from STARTS[M] on.
        if pid == 0:
            _nan_rows(GIN2, PERM, 0, tl.load(STARTS), s_gin2, coff, col_ok, BLOCK_M, BLOCK_F)
        if pid == tl.num_programs(0) - 1:
            _nan_rows(GIN2, PERM, tl.load(STARTS + M), N, s_gin2, coff, col_ok, BLOCK_M, BLOCK_F)


@triton.jit
def _nan_rows(GIN2, PERM, lo, hi, s_gin2, coff, col_ok, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """NaN rows ``GIN2[PERM[k]]`` for ``k`` in ``[lo, hi)``."""
    nan = tl.full([BLOCK_M, BLOCK_F], float("nan"), dtype=GIN2.dtype.element_ty)
    for k in range(lo, hi, BLOCK_M):
        kk = k + tl.arange(0, BLOCK_M)
        k_ok = kk < hi
        p = tl.load(PERM + kk, mask=k_ok, other=0).to(tl.int64)[:, None]
        tl.store(GIN2 + p * s_gin2 + coff, nan, mask=k_ok[:, None] & col_ok[None, :])
