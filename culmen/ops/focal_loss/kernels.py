"""Triton kernels of the RetinaNet sigmoid focal loss (Apex's ``contrib.focal_loss`` semantics).

The logits are viewed as a contiguous ``(R, C)`` matrix (``C`` classes, the last ``C - num_real``
of them padding) and walked flat, in tiles of ``BLOCK`` elements, so no lanes are wasted whatever
``C`` is (a 2-D tile of ``next_power_of_2(C)`` columns would leave up to half of them idle, and this
loss is bound by the special-function unit as much as by memory). The row of an element comes from
one 64-bit division per tile and 32-bit divisions per element.

Per element ``x`` with hard label ``y`` of its row (``pos = y == class``):

* ``t = pos ? 1 - s/2 : s/2`` (label smoothing ``s``), ``bce = softplus(-x) + (1 - t) x``,
* ``q = pos ? 1 - sigmoid(x) : sigmoid(x)``, ``a = pos ? alpha : 1 - alpha``,
* ``loss = a q^gamma bce``, and its exact derivative
  ``dloss/dx = a q^gamma (gamma (pos ? -1 : 1) (1 - q) bce + sigmoid(x) - t)``.

Rows labelled ``-2`` and padded classes contribute nothing. ``sigmoid``, ``1 - sigmoid`` and
``softplus(-x)`` all come from one ``exp(-|x|)`` without cancellation.

The forward writes one partial sum per program (``_focal_loss_fwd_kernel``) that a second tiny
kernel adds up and divides by ``num_positives_sum`` (no atomics: the loss is bitwise reproducible).
The backward recomputes the gradient from the logits (``_focal_loss_bwd_kernel``) rather than
storing it in the forward as Apex does: one pass less over memory and no saved ``(R, C)`` buffer.
"""

import triton
import triton.language as tl


@triton.jit
def _focal_terms(x, y, col, num_real, alpha, gamma, smoothing, INT_GAMMA: tl.constexpr,
                 SMOOTHING: tl.constexpr, NEED_LOSS: tl.constexpr, NEED_GRAD: tl.constexpr):
    """Loss and gradient of one tile (compute dtype of ``x``); zero where ignored or padded."""
    valid = (y != -2) & (col < num_real)
    pos = y == col
    e = tl.exp(-tl.abs(x))
    inv = 1.0 / (1.0 + e)
    nonneg = x >= 0
    sig = tl.where(nonneg, inv, e * inv)  # sigmoid(x)
    one_m_sig = tl.where(nonneg, e * inv, inv)  # 1 - sigmoid(x), without cancellation
    soft = tl.maximum(-x, 0.0) + tl.log(1.0 + e)  # softplus(-x) = -log(sigmoid(x))
    q = tl.where(pos, one_m_sig, sig)
    if INT_GAMMA >= 0:
        # Integer gamma (2 in RetinaNet): repeated products instead of exp(gamma log q).
        qg = tl.full(x.shape, 1.0, x.dtype)
        for _ in tl.static_range(INT_GAMMA):
            qg = qg * q
    else:
        # log q = -softplus(x) for positives, -softplus(-x) for negatives: no extra log needed.
        log_q = -(soft + tl.where(pos, x, 0.0))
        qg = tl.exp(gamma * log_q)
    coeff = tl.where(pos, alpha, 1.0 - alpha) * qg
    if SMOOTHING:
        t = tl.where(pos, 1.0 - 0.5 * smoothing, 0.5 * smoothing)
    else:
        t = tl.where(pos, 1.0, 0.0)
    bce = soft + (1.0 - t) * x
    loss = x
    grad = x
    if NEED_LOSS:
        loss = tl.where(valid, coeff * bce, 0.0)
    if NEED_GRAD:
        slope = tl.where(pos, -sig, one_m_sig)  # (pos ? -1 : 1) (1 - q)
        grad = tl.where(valid, coeff * (gamma * slope * bce + sig - t), 0.0)
    return loss, grad


@triton.jit
def _tile_coords(Y, tile, total, C, BLOCK: tl.constexpr):
    """Flat offsets, mask, labels and class indices of tile ``tile`` of the ``(R, C)`` matrix."""
    base = tile.to(tl.int64) * BLOCK
    row0 = base // C
    col0 = (base - row0 * C).to(tl.int32)
    j = tl.arange(0, BLOCK)
    cc = col0 + j
    dr = cc // C
    col = cc - dr * C
    offs = base + j
    mask = offs < total
    y = tl.load(Y + (row0 + dr), mask=mask, other=-2)
    return offs, mask, y, col


@triton.jit
def _focal_loss_fwd_kernel(X, Y, PART, total, C, num_real, num_tiles, alpha, gamma, smoothing,
                           ACC: tl.constexpr, INT_GAMMA: tl.constexpr, SMOOTHING: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Program ``p``: the sum of the element losses of tiles ``p, p + P, ...`` into ``PART[p]``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=ACC)
    for t in range(0, tl.cdiv(num_tiles - pid, nprog)):
        # The tile index as a tensor (an ``int`` under the interpreter would have no ``.to``).
        tile = pid + t * nprog
        offs, mask, y, col = _tile_coords(Y, tile, total, C, BLOCK)
        x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
        loss, _ = _focal_terms(x, y, col, num_real, alpha, gamma, smoothing, INT_GAMMA, SMOOTHING, True, False)
        acc += tl.where(mask, loss, 0.0)
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


@triton.jit
def _focal_loss_bwd_kernel(X, Y, DX, GRAD, NPOS, total, C, num_real, alpha, gamma, smoothing,
                           ACC: tl.constexpr, INT_GAMMA: tl.constexpr, SMOOTHING: tl.constexpr,
                           NORMALIZE: tl.constexpr, BLOCK: tl.constexpr):
    """``DX = dloss/dx * GRAD[0] / NPOS[0]`` on tile ``program_id``; without ``NORMALIZE`` the raw
    gradient of the summed loss (Apex's ``partial_grad``)."""
    tile = tl.program_id(0)
    offs, mask, y, col = _tile_coords(Y, tile, total, C, BLOCK)
    x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
    _, grad = _focal_terms(x, y, col, num_real, alpha, gamma, smoothing, INT_GAMMA, SMOOTHING, False, True)
    if NORMALIZE:
        scale = tl.load(GRAD).to(ACC) / tl.load(NPOS).to(ACC)
        grad = grad * scale
    tl.store(DX + offs, grad.to(DX.dtype.element_ty), mask=mask)
