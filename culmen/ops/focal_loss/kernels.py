"""Triton kernels of the RetinaNet sigmoid focal loss (Apex's ``contrib.focal_loss`` semantics).

The logits are a contiguous ``(R, C)`` matrix (``C`` classes, the last ``C - num_real`` of them
padding), walked in ``(BLOCK_R, BLOCK_C)`` tiles: rows in parallel, the classes in a loop of
``BLOCK_C``-wide column blocks. ``BLOCK_C`` is chosen by the launcher to waste the fewest lanes (16 for
RetinaNet's 272 = 17 x 16 columns), so a row's label is loaded once per tile and no integer division
is needed (an earlier flat walk paid one 32-bit division and one label gather per element). The loss
is bound by instruction issue and the special-function unit, not by memory: every instruction counts.

Per element ``x`` with hard label ``y`` of its row (``pos = y == class``):

* ``t = pos ? 1 - s/2 : s/2`` (label smoothing ``s``), ``bce = softplus(-x) + (1 - t) x``,
* ``q = pos ? 1 - sigmoid(x) : sigmoid(x)``, ``a = pos ? alpha : 1 - alpha``,
* ``loss = a q^gamma bce``, and its exact derivative
  ``dloss/dx = a q^gamma (gamma (pos ? -1 : 1) (1 - q) bce + sigmoid(x) - t)``.

Rows labelled ``-2`` and padded classes contribute nothing. ``sigmoid``, ``1 - sigmoid`` and
``softplus(-x)`` all come from one ``e = exp(-|x|)`` without cancellation: ``d = 1 + e``,
``sigmoid(|x|) = 1 / d``, ``softplus(-|x|) = log(d)``.

``FAST`` (CUDA, 16-bit logits): ``exp2`` / ``log2`` / reciprocal as the single hardware approximations
(``ex2.approx``, ``lg2.approx``, ``rcp.approx``: about 2^-22 relative / absolute error, far below the
input's rounding) instead of Triton's accurate sequences (a software ``log`` is ~30 instructions). fp32
logits, other GPUs and the CPU interpreter take the portable functions.

The forward is persistent: program ``p`` adds the losses of row tiles ``p, p + P, ...`` into one fp32
partial; ``_focal_loss_finish_kernel`` adds the partials in a fixed order and divides by
``num_positives_sum`` (no atomics: the loss is bitwise reproducible). The backward recomputes the
gradient from the logits rather than storing it in the forward as Apex does: one pass less over memory
and no saved ``(R, C)`` buffer.
"""

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _rcp(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 / x


@triton.jit
def _focal_terms(x, pos, alpha, gamma, smoothing, INT_GAMMA: tl.constexpr, SMOOTHING: tl.constexpr,
                 NEED_LOSS: tl.constexpr, NEED_GRAD: tl.constexpr, FAST: tl.constexpr):
    """Loss and gradient of a tile (fp32), before the ignore / padding masks.

    With ``e = exp(-|x|)``, ``d = 1 + e``: ``sigmoid(|x|) = 1 / d``, ``sigmoid(-|x|) = e / d`` and
    ``log(d) = softplus(-|x|)``; ``softplus(+-x) = log(d) + max(+-x, 0)`` (no cancellation for any sign).
    ``q`` is ``sigmoid(x)`` for a negative and ``sigmoid(-x)`` for a positive: ``1 / d`` exactly when the
    sign of ``x`` disagrees with ``pos``.
    """
    e = _exp2(tl.abs(x) * (-_LOG2E), FAST)
    d = 1.0 + e
    inv = _rcp(d, FAST)
    ei = e * inv
    ln_d = _log2(d, FAST) * _LN2
    nonneg = x >= 0
    flip = pos != nonneg
    q = tl.where(flip, inv, ei)
    if INT_GAMMA >= 0:
        # Integer gamma (2 in RetinaNet): repeated products instead of exp(gamma log q).
        qg = tl.full(x.shape, 1.0, x.dtype)
        for _ in tl.static_range(INT_GAMMA):
            qg = qg * q
    else:
        # log q = -softplus(x) for a positive, -softplus(-x) for a negative.
        qg = _exp2((ln_d + tl.maximum(tl.where(pos, x, -x), 0.0)) * (-gamma * _LOG2E), FAST)
    coeff = tl.where(pos, alpha, 1.0 - alpha) * qg
    if SMOOTHING:
        t = tl.where(pos, 1.0 - 0.5 * smoothing, 0.5 * smoothing)
        bce = ln_d + tl.maximum(-x, 0.0) + (1.0 - t) * x
    else:
        # Hard targets: bce = softplus(-x) for a positive, softplus(x) for a negative.
        t = tl.where(pos, 1.0, 0.0)
        bce = ln_d + tl.maximum(tl.where(pos, -x, x), 0.0)
    loss = x
    grad = x
    if NEED_LOSS:
        loss = coeff * bce
    if NEED_GRAD:
        one_m_q = tl.where(flip, ei, inv)
        slope = tl.where(pos, -one_m_q, one_m_q)  # (pos ? -1 : 1) (1 - q)
        sig = tl.where(nonneg, inv, ei)  # sigmoid(x)
        grad = coeff * (gamma * slope * bce + sig - t)
    return loss, grad


@triton.jit
def _row_tile(Y, tile, R, BLOCK_R: tl.constexpr):
    """Rows of tile ``tile`` (clamped in bounds), their labels, and whether each counts (in range, not ignored).

    int64 labels are read through an int32 view (their low words: exact for every valid label): a
    truncated int64 would let LLVM widen every per-element label compare back to 64 bits.
    """
    rows = tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows_c = tl.minimum(rows, R - 1)
    if Y.dtype.element_ty == tl.int64:
        y = tl.load(Y.to(tl.pointer_type(tl.int32)) + 2 * rows_c)
    else:
        y = tl.load(Y + rows_c).to(tl.int32)
    return rows_c, y, row_ok & (y != -2)


@triton.jit(do_not_specialize=["R", "num_tiles"])
def _focal_loss_fwd_kernel(X, Y, PART, R, C, num_real, num_tiles, alpha, gamma, smoothing,
                           INT_GAMMA: tl.constexpr, SMOOTHING: tl.constexpr, FAST: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program ``p``: the summed element losses of row tiles ``p, p + P, ...`` into ``PART[p]``.

    The column loop advances pointers and a per-row ``label - c0`` instead of indexing with ``c0``: LLVM
    widens an induction variable used in 64-bit addresses, and every label compare with it.
    """
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    alpha = tl.cast(alpha, tl.float32)
    gamma = tl.cast(gamma, tl.float32)
    smoothing = tl.cast(smoothing, tl.float32)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = tl.arange(0, BLOCK_C)[None, :]
    # Column blocks entirely inside the real classes need no mask; one masked block for the rest.
    full = (num_real // BLOCK_C) * BLOCK_C
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for t in range(0, tl.cdiv(num_tiles - pid, nprog)):
        rows, y, counted = _row_tile(Y, pid + t * nprog, R, BLOCK_R)
        xp = X + rows[:, None] * C + j
        yrel = y[:, None]
        acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for _c in range(0, full, BLOCK_C):
            x = tl.load(xp).to(tl.float32)
            loss, _g = _focal_terms(x, yrel == j, alpha, gamma, smoothing, INT_GAMMA, SMOOTHING, True, False, FAST)
            acc2 += loss
            xp += BLOCK_C
            yrel -= BLOCK_C
        if full < num_real:
            cmask = j < num_real - full
            x = tl.load(xp, mask=cmask, other=0.0).to(tl.float32)
            loss, _g = _focal_terms(x, yrel == j, alpha, gamma, smoothing, INT_GAMMA, SMOOTHING, True, False, FAST)
            acc2 += tl.where(cmask, loss, 0.0)
        acc += tl.where(counted, tl.sum(acc2, axis=1), 0.0)
    tl.store(PART + pid, tl.sum(acc, axis=0))


@triton.jit
def _focal_loss_finish_kernel(PART, NPOS, LOSS, P, BLOCK_P: tl.constexpr):
    """``LOSS = sum(PART[:P]) / NPOS[0]`` (one program)."""
    i = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P], dtype=PART.dtype.element_ty)
    for p0 in range(0, P, BLOCK_P):
        acc += tl.load(PART + p0 + i, mask=(p0 + i) < P, other=0.0)
    total = tl.sum(acc, axis=0)
    npos = tl.load(NPOS).to(total.dtype)
    tl.store(LOSS, (total / npos).to(LOSS.dtype.element_ty))


@triton.jit(do_not_specialize=["R"])
def _focal_loss_bwd_kernel(X, Y, DX, GRAD, NPOS, R, C, num_real, alpha, gamma, smoothing,
                           INT_GAMMA: tl.constexpr, SMOOTHING: tl.constexpr, NORMALIZE: tl.constexpr,
                           FAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``DX = dloss/dx * GRAD[0] / NPOS[0]`` on row tile ``program_id``, every column (zeros where ignored or
    padded); without ``NORMALIZE`` the raw gradient of the summed loss (Apex's ``partial_grad``)."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    alpha = tl.cast(alpha, tl.float32)
    gamma = tl.cast(gamma, tl.float32)
    smoothing = tl.cast(smoothing, tl.float32)
    rows, y, counted = _row_tile(Y, tl.program_id(0), R, BLOCK_R)
    # Clamped rows past the end recompute the last row and store nothing.
    store_rows = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R) < R)[:, None]
    j = tl.arange(0, BLOCK_C)[None, :]
    off = rows[:, None] * C + j
    xp = X + off
    dp = DX + off
    yrel = y[:, None]
    keep = counted[:, None]
    scale = 1.0
    if NORMALIZE:
        scale = tl.load(GRAD).to(tl.float32) / tl.load(NPOS).to(tl.float32)
    # Blocks of real classes (no column mask), then the block(s) holding padding and the end of the row.
    full = (num_real // BLOCK_C) * BLOCK_C
    for _c in range(0, full, BLOCK_C):
        x = tl.load(xp).to(tl.float32)
        _l, g = _focal_terms(x, yrel == j, alpha, gamma, smoothing, INT_GAMMA, SMOOTHING, False, True, FAST)
        tl.store(dp, tl.where(keep, g * scale, 0.0).to(DX.dtype.element_ty), mask=store_rows)
        xp += BLOCK_C
        dp += BLOCK_C
        yrel -= BLOCK_C
    for c0 in range(full, C, BLOCK_C):
        in_row = j < C - c0
        x = tl.load(xp, mask=in_row, other=0.0).to(tl.float32)
        _l, g = _focal_terms(x, yrel == j, alpha, gamma, smoothing, INT_GAMMA, SMOOTHING, False, True, FAST)
        g = tl.where(keep & (j < num_real - c0), g * scale, 0.0)
        tl.store(dp, g.to(DX.dtype.element_ty), mask=store_rows & in_row)
        xp += BLOCK_C
        dp += BLOCK_C
        yrel -= BLOCK_C
