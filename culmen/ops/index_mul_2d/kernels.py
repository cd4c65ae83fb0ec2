"""Triton kernels of ``index_mul_2d``: ``out[n] = in1[idx[n]] * in2[n]`` over rows of 2-D tensors.

Every kernel walks ``(BLOCK_N, BLOCK_F)`` tiles of the ``(N, F)`` row space of ``in2`` (one index per
row, the feature dim contiguous). Row strides are arguments, so row-padded views need no copy.

The gradient of ``in1`` is a scatter-add over repeated indices. Two ways:

* atomics (``ATOMIC=True``): each tile adds its products into an fp32 (fp64 for fp64 inputs) buffer
  with ``tl.atomic_add``; fast, but the summation order, so the last bits, vary between runs;
* the sorted segmented sum (``_index_mul_2d_segment_kernel``): the indices are sorted once (stable)
  and one program per ``in1`` row adds its products in index order; bitwise reproducible. Used when
  ``culmen.set_deterministic(True)`` or ``torch.use_deterministic_algorithms(True)``.

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


@triton.jit
def _index_mul_2d_fwd_kernel(OUT, IN1, IN2, IDX, N, M, F, s_out, s_in1, s_in2,
                             ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """``OUT[n] = IN1[IDX[n]] * IN2[n]``; also the gradient of ``in2`` (``grad * in1[idx]``)."""
    rows, row_ok, idx, idx_ok = _rows(IDX, N, M, BLOCK_N)
    cols, col_ok = _cols(F, BLOCK_F)
    m2 = row_ok[:, None] & col_ok[None, :]
    g1 = idx_ok[:, None] & col_ok[None, :]
    a = tl.load(IN1 + idx[:, None] * s_in1 + cols[None, :], mask=g1, other=float("nan")).to(ACC)
    b = tl.load(IN2 + rows[:, None] * s_in2 + cols[None, :], mask=m2, other=0.0).to(ACC)
    tl.store(OUT + rows[:, None] * s_out + cols[None, :], (a * b).to(OUT.dtype.element_ty), mask=m2)


@triton.jit
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


@triton.jit
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


@triton.jit
def _index_mul_2d_segment_kernel(OUT, A, B, PERM, STARTS, M, F, s_out, s_a, s_b,
                                 ACC: tl.constexpr, BLOCK_F: tl.constexpr):
    """``OUT[m] = sum_{k in [STARTS[m], STARTS[m+1])} A[PERM[k]] * B[PERM[k]]`` in order: program ``(m, f)``.

    ``PERM`` is the stable sort permutation of the indices and ``STARTS`` where each value's run begins,
    so the sum runs over the rows ``n`` with ``idx[n] == m`` in increasing ``n`` (deterministic). Rows of
    ``OUT`` no index points at get zeros.
    """
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    k0 = tl.load(STARTS + m)
    k1 = tl.load(STARTS + m + 1)
    acc = tl.zeros([BLOCK_F], dtype=ACC)
    for k in range(k0, k1):
        p = tl.load(PERM + k).to(tl.int64)
        a = tl.load(A + p * s_a + cols, mask=col_ok, other=0.0).to(ACC)
        b = tl.load(B + p * s_b + cols, mask=col_ok, other=0.0).to(ACC)
        acc += a * b
    tl.store(OUT + m.to(tl.int64) * s_out + cols, acc.to(OUT.dtype.element_ty), mask=col_ok)
