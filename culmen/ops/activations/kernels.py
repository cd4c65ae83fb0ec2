"""Triton kernels of the fused bias + activation ops and the gated (GLU-family) activations.

All kernels are elementwise over a 2-D ``(M, N)`` view whose last dim is contiguous (rows may be
``stride`` elements apart, so halves of a packed tensor need no copy; the gated kernels also take an
element offset per operand, so both halves of one ``(M, 2N)`` tensor, and both halves of its gradient,
are addressed through one pointer). Row counts are not specialized on (``do_not_specialize``): a new
batch size reuses the compiled kernel. A fully contiguous operand set
without a per-column operand is launched as one flat row (``M == 1``) with row stride 0, which lets
Triton prove 16-byte alignment and emit 128-bit loads whatever the shape. Programs are laid out on a
1-D grid (row block major), so neither grid axis limit of 65535 applies.

Math is fp32 whatever the storage dtype; offsets are int64 (tensors may exceed 2^31 elements).

ReLU under autograd saves a bit mask instead of its input (``_relu_mask_*``): one bit per element in
``(M, NB)`` uint8 rows (``NB = cdiv(N, 8)``; bit ``c % 8`` of byte ``c // 8``). The backward then reads
``dy`` and ``N / 8`` bytes per row instead of ``dy`` and ``x``: a ReLU fwd+bwd moves 4.125 tensor-sized
passes instead of 5. Their tiles are 3-D ``(rows, bytes, 8)``: each thread holds whole bytes' worth of
elements (one 16-byte vector of bf16), so packing and unpacking never cross threads.

Activation codes (``ACT``), shared with ``launch.ACT_CODES``:
0 none, 1 relu, 2 sigmoid, 3 gelu (erf), 4 gelu_tanh, 5 sqrelu (relu(x)^2), 6 silu,
7 relu_ge0 (relu whose derivative at 0 is 1: flash_attn's ``relu_bwd`` convention).
"""

import triton
import triton.language as tl

# Constants are written as literals inside the jitted functions (the interpreter mishandles
# constexpr globals multiplied by tensors): 0.7071067811865476 = 1/sqrt(2),
# 0.3989422804014327 = 1/sqrt(2 pi), 0.7978845608028654 = sqrt(2/pi), 1.5957691216057308 = 2 sqrt(2/pi),
# 0.044715 and 0.134145 = 3 * 0.044715 (the tanh approximation's cubic term).


@triton.jit
def _sigmoid(x):
    # Approximate division (div.full.f32 on NVIDIA, <= 2 ulp): IEEE division costs a dozen
    # instructions plus a slow path, which made the GELU backward compute-bound.
    return tl.fdiv(1.0, 1.0 + tl.exp(-x), ieee_rounding=False)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """``act(x)`` of an fp32 tile."""
    if ACT == 0:
        y = x
    elif ACT == 1:
        y = tl.maximum(x, 0.0)
    elif ACT == 2:
        y = _sigmoid(x)
    elif ACT == 3:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 4:
        # 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u): no tanh needed, and exact in both tails.
        y = x * _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif ACT == 5:
        r = tl.maximum(x, 0.0)
        y = r * r
    elif ACT == 6:
        y = x * _sigmoid(x)
    else:
        y = tl.maximum(x, 0.0)
    return y


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """``(act(x), act'(x))`` of an fp32 tile; shared subexpressions are computed once."""
    if ACT == 0:
        y = x
        d = tl.full(x.shape, 1.0, tl.float32)
    elif ACT == 1:
        y = tl.maximum(x, 0.0)
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 2:
        y = _sigmoid(x)
        d = y * (1.0 - y)
    elif ACT == 3:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        y = x * cdf
        d = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACT == 4:
        s = _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
        y = x * s
        d = s + x * 1.5957691216057308 * s * (1.0 - s) * (1.0 + 0.134145 * x * x)
    elif ACT == 5:
        r = tl.maximum(x, 0.0)
        y = r * r
        d = 2.0 * r
    elif ACT == 6:
        s = _sigmoid(x)
        y = x * s
        d = s * (1.0 + x * (1.0 - s))
    else:
        y = tl.maximum(x, 0.0)
        d = tl.where(x >= 0.0, 1.0, 0.0)
    return y, d


@triton.jit
def _grad_from_output(y, ACT: tl.constexpr):
    """``act'`` expressed through the output ``y = act(x)`` (none / relu / sigmoid only)."""
    if ACT == 0:
        d = tl.full(y.shape, 1.0, tl.float32)
    elif ACT == 2:
        d = y * (1.0 - y)
    else:
        d = tl.where(y > 0.0, 1.0, 0.0)
    return d


@triton.jit
def _tile(n_col_blocks, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows, columns and in-bounds mask of this program's tile (1-D grid, row-block major)."""
    pid = tl.program_id(0).to(tl.int64)
    pid_m = pid // n_col_blocks
    pid_n = pid - pid_m * n_col_blocks
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    return rows, cols, (rows < M) & (cols < N)


@triton.jit(do_not_specialize=["M"])
def _act_fwd_kernel(X, B, Y, M, N, stride_x, stride_y, n_col_blocks,
                    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Y = act(X + B)``; ``B`` (N,) broadcast over rows. ``Y`` may be ``X`` (in place)."""
    rows, cols, tile = _tile(n_col_blocks, M, N, BLOCK_M, BLOCK_N)
    x = tl.load(X + rows * stride_x + cols, mask=tile, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Y + rows * stride_y + cols, _act(x, ACT).to(Y.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["M"])
def _act_bwd_kernel(G, X, B, DX, OUT, M, N, stride_g, stride_x, stride_dx, stride_out, n_col_blocks,
                    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, FROM_OUTPUT: tl.constexpr,
                    STORE_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``DX = G * act'(X + B)`` (or ``act'`` from the output ``X = act(.)`` when ``FROM_OUTPUT``);
    ``STORE_OUT`` also writes ``OUT = act(X + B)`` (recomputation for checkpointing). ``DX`` may be ``G``."""
    rows, cols, tile = _tile(n_col_blocks, M, N, BLOCK_M, BLOCK_N)
    x = tl.load(X + rows * stride_x + cols, mask=tile, other=0.0).to(tl.float32)
    g = tl.load(G + rows * stride_g + cols, mask=tile, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
    if FROM_OUTPUT:
        d = _grad_from_output(x, ACT)
    else:
        y, d = _act_and_grad(x, ACT)
        if STORE_OUT:
            tl.store(OUT + rows * stride_out + cols, y.to(OUT.dtype.element_ty), mask=tile)
    tl.store(DX + rows * stride_dx + cols, (g * d).to(DX.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def _act_bwd_dbias_kernel(G, X, B, DX, OUT, DB_PART, M, N, stride_g, stride_x, stride_dx, stride_out,
                          rows_per_split,
                          ACT: tl.constexpr, HAS_BIAS: tl.constexpr, FROM_OUTPUT: tl.constexpr,
                          STORE_OUT: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """``_act_bwd_kernel`` plus the bias gradient: program ``(n, s)`` walks the rows of split ``s`` for
    column block ``n`` and writes one row of column sums of (unrounded) ``DX`` to ``DB_PART[s]`` (fp32
    partials; with a single split ``DB_PART`` is the bias gradient itself, in its dtype).

    ``PREFETCH``: the loads of the next row block are issued before the current one is computed and
    stored (software pipelining by hand: two tiles of loads in flight per program)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = (pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    col_ok = cols < N
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        b = 0.0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_start = pid_s.to(tl.int64) * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    rows = (row_start + tl.arange(0, BLOCK_M))[:, None]
    tile = (rows < row_end) & col_ok
    if PREFETCH:
        x = tl.load(X + rows * stride_x + cols, mask=tile, other=0.0)
        g = tl.load(G + rows * stride_g + cols, mask=tile, other=0.0)
    for _ in range(row_start, row_end, BLOCK_M):
        if PREFETCH:
            nrows = rows + BLOCK_M
            ntile = (nrows < row_end) & col_ok
            xn = tl.load(X + nrows * stride_x + cols, mask=ntile, other=0.0)
            gn = tl.load(G + nrows * stride_g + cols, mask=ntile, other=0.0)
        else:
            x = tl.load(X + rows * stride_x + cols, mask=tile, other=0.0)
            g = tl.load(G + rows * stride_g + cols, mask=tile, other=0.0)
        h = x.to(tl.float32) + b
        if FROM_OUTPUT:
            d = _grad_from_output(h, ACT)
        else:
            y, d = _act_and_grad(h, ACT)
            if STORE_OUT:
                tl.store(OUT + rows * stride_out + cols, y.to(OUT.dtype.element_ty), mask=tile)
        dx = g.to(tl.float32) * d
        tl.store(DX + rows * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=tile)
        acc += tl.where(tile, dx, 0.0)
        if PREFETCH:
            x, g, rows, tile = xn, gn, nrows, ntile
        else:
            rows += BLOCK_M
            tile = (rows < row_end) & col_ok
    cols1 = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(DB_PART + pid_s.to(tl.int64) * N + cols1, tl.sum(acc, axis=0).to(DB_PART.dtype.element_ty),
             mask=cols1 < N)


@triton.jit(do_not_specialize=["M"])
def _glu_fwd_kernel(X, U, Y, M, N, stride_x, stride_u, stride_y, x_off, u_off, n_col_blocks,
                    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Y = act(X) * U`` (SwiGLU: silu, GeGLU: gelu / gelu_tanh, ReGLU: relu, GLU: sigmoid). ``x_off`` /
    ``u_off``: element offsets of the operands from ``X`` / ``U`` (both halves of one packed tensor are
    then read through one pointer; 0 for separate tensors)."""
    rows, cols, tile = _tile(n_col_blocks, M, N, BLOCK_M, BLOCK_N)
    x = tl.load(X + x_off + rows * stride_x + cols, mask=tile, other=0.0).to(tl.float32)
    u = tl.load(U + u_off + rows * stride_u + cols, mask=tile, other=0.0).to(tl.float32)
    tl.store(Y + rows * stride_y + cols, (_act(x, ACT) * u).to(Y.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["M"])
def _glu_bwd_kernel(G, X, U, DX, DU, M, N, stride_g, stride_x, stride_u, stride_dx, stride_du, x_off, u_off,
                    n_col_blocks, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``DX = G * U * act'(X)``, ``DU = G * act(X)``. ``DX`` / ``DU`` sit at the offsets of ``X`` / ``U``
    (the gradient of a packed input is one packed buffer)."""
    rows, cols, tile = _tile(n_col_blocks, M, N, BLOCK_M, BLOCK_N)
    x = tl.load(X + x_off + rows * stride_x + cols, mask=tile, other=0.0).to(tl.float32)
    u = tl.load(U + u_off + rows * stride_u + cols, mask=tile, other=0.0).to(tl.float32)
    g = tl.load(G + rows * stride_g + cols, mask=tile, other=0.0).to(tl.float32)
    y, d = _act_and_grad(x, ACT)
    tl.store(DX + x_off + rows * stride_dx + cols, (g * u * d).to(DX.dtype.element_ty), mask=tile)
    tl.store(DU + u_off + rows * stride_du + cols, (g * y).to(DU.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["S"])
def _dbias_sum_kernel(PART, DB, S, N, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """``DB[n] = sum_s PART[s, n]`` (fp32, fixed order: deterministic), stored in ``DB``'s dtype."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        rows = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
        ok = (rows[:, None] < S) & (cols[None, :] < N)
        acc += tl.sum(tl.load(PART + rows[:, None] * N + cols[None, :], mask=ok, other=0.0), axis=0)
    tl.store(DB + cols, acc.to(DB.dtype.element_ty), mask=cols < N)


@triton.jit
def _mask_tile(n_col_blocks, M, NB, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """This program's mask tile (rows x bytes, 2-D) and element tile (rows x bytes x 8, 3-D)."""
    pid = tl.program_id(0).to(tl.int64)
    pid_m = pid // n_col_blocks
    pid_b = pid - pid_m * n_col_blocks
    rows2 = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    byts2 = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B))[None, :]
    return rows2, byts2, (rows2 < M) & (byts2 < NB)


@triton.jit(do_not_specialize=["M"])
def _relu_mask_fwd_kernel(X, B, Y, MASK, M, N, NB, stride_x, stride_y, n_col_blocks,
                          GE0: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_B: tl.constexpr):
    """``Y = relu(X + B)`` and its bit mask (``X + B > 0``; ``>= 0`` with ``GE0``) into ``MASK``."""
    rows2, byts2, tile2 = _mask_tile(n_col_blocks, M, NB, BLOCK_M, BLOCK_B)
    rows = rows2[:, :, None]
    bits = tl.arange(0, 8)[None, None, :]
    cols = byts2[:, :, None] * 8 + bits
    tile = (rows < M) & (cols < N)
    x = tl.load(X + rows * stride_x + cols, mask=tile, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
    if GE0:
        on = x >= 0.0
    else:
        on = x > 0.0
    tl.store(Y + rows * stride_y + cols, tl.where(on, x, 0.0).to(Y.dtype.element_ty), mask=tile)
    packed = tl.sum(tl.where(on & tile, 1, 0) << bits, axis=2)
    tl.store(MASK + rows2 * NB + byts2, packed.to(tl.uint8), mask=tile2)


@triton.jit(do_not_specialize=["M"])
def _relu_mask_bwd_kernel(G, MASK, DX, M, N, NB, stride_g, stride_dx, n_col_blocks,
                          BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """``DX = G`` where the mask bit is set, else 0."""
    rows2, byts2, tile2 = _mask_tile(n_col_blocks, M, NB, BLOCK_M, BLOCK_B)
    rows = rows2[:, :, None]
    bits = tl.arange(0, 8)[None, None, :]
    cols = byts2[:, :, None] * 8 + bits
    tile = (rows < M) & (cols < N)
    m = tl.load(MASK + rows2 * NB + byts2, mask=tile2, other=0).to(tl.int32)
    on = ((m[:, :, None] >> bits) & 1) != 0
    g = tl.load(G + rows * stride_g + cols, mask=tile, other=0.0).to(tl.float32)
    tl.store(DX + rows * stride_dx + cols, tl.where(on, g, 0.0).to(DX.dtype.element_ty), mask=tile)


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def _relu_mask_bwd_dbias_kernel(G, MASK, DX, DB_PART, M, N, NB, stride_g, stride_dx, rows_per_split,
                                PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """``_relu_mask_bwd_kernel`` plus column sums of ``DX``: program ``(b, s)`` walks the rows of split ``s``
    for byte block ``b`` and writes one row of sums to ``DB_PART[s]`` (in ``DB_PART``'s dtype).
    ``PREFETCH`` as in ``_act_bwd_dbias_kernel``."""
    pid_b = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    byts2 = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B))[None, :]
    bits = tl.arange(0, 8)[None, None, :]
    cols = byts2[:, :, None] * 8 + bits
    acc = tl.zeros([BLOCK_M, BLOCK_B, 8], dtype=tl.float32)
    row_start = pid_s * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    rows2 = (row_start + tl.arange(0, BLOCK_M))[:, None]
    if PREFETCH:
        m = tl.load(MASK + rows2 * NB + byts2, mask=(rows2 < row_end) & (byts2 < NB), other=0)
        g = tl.load(G + rows2[:, :, None] * stride_g + cols, mask=(rows2[:, :, None] < row_end) & (cols < N),
                    other=0.0)
    for _ in range(row_start, row_end, BLOCK_M):
        rows = rows2[:, :, None]
        tile = (rows < row_end) & (cols < N)
        if PREFETCH:
            nrows2 = rows2 + BLOCK_M
            mn = tl.load(MASK + nrows2 * NB + byts2, mask=(nrows2 < row_end) & (byts2 < NB), other=0)
            gn = tl.load(G + nrows2[:, :, None] * stride_g + cols, mask=(nrows2[:, :, None] < row_end) & (cols < N),
                         other=0.0)
        else:
            m = tl.load(MASK + rows2 * NB + byts2, mask=(rows2 < row_end) & (byts2 < NB), other=0)
            g = tl.load(G + rows * stride_g + cols, mask=tile, other=0.0)
        on = ((m.to(tl.int32)[:, :, None] >> bits) & 1) != 0
        dx = tl.where(on & tile, g.to(tl.float32), 0.0)
        tl.store(DX + rows * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=tile)
        acc += dx
        if PREFETCH:
            m, g, rows2 = mn, gn, nrows2
        else:
            rows2 += BLOCK_M
    cols2 = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B))[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(DB_PART + pid_s * N + cols2, tl.sum(acc, axis=0).to(DB_PART.dtype.element_ty), mask=cols2 < N)
