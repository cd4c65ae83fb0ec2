"""Triton kernels of the RNN-T (transducer) joint and loss (Apex's ``contrib.transducer`` semantics).

Layouts. The joint reads ``f (B, T, H)`` and ``g (B, U, H)``, both contiguous, and writes ``h``, either
dense ``(B, T, U, H)`` or packed ``(packed_batch, H)``: batch ``b`` owns the rows
``[boff[b-1], boff[b])`` (``boff`` the inclusive cumsum of ``f_len * g_len``), row ``t * g_len + u``
inside it. The loss reads logits laid out the same way with ``U`` positions per time step (dense
``(B, T, U, K)``, or packed ``(N, K)`` with ``f_len * (y_len + 1)`` rows per batch). Both families walk a
``(b, t)`` grid with a block of ``u`` per program, so a packed row is ``base + t * width + u`` and needs no
search; rows past a batch's lengths are never touched in packed mode.

Lengths are clamped to the tensors' extents inside the kernels (and labels to ``[0, K)``): a bad value
gives a wrong answer, never an access outside a tensor. The plans check the values where that costs no
device sync (``launch.py``).

The joint's dropout keeps element ``(b, t, u, h)`` iff ``tl.rand(seed, off + ((b*T + t)*U + u)*H + h) >= p``
(the dense index, whether or not the output is packed), so the backward replays the mask from the
``(seed, off)`` pair instead of reading a saved one; ReLU's mask is recomputed from ``f + g`` the same way.
A mask tensor is written only when asked for (``probe_mask``).

The loss works in three passes. ``_rnnt_logprobs_kernel`` streams the logits once: each row's
log-sum-exp (saved, fp32) and the two log-probabilities the recursions need, blank and the next label
(``(B, T, U)`` fp32 each). ``_rnnt_alpha_beta_kernel`` runs the forward (alpha) and backward (beta)
recursions of Graves (2012), one program per (batch, direction), one time step per iteration: inside a
row the dependence along ``u`` is the linear recurrence ``a_u = logaddexp(c_u, a_{u-1} + e_u)`` in the
log semiring, which is an associative scan over the maps ``x -> logaddexp(x + e, c)``. The beta rows are
scanned in reversed ``u`` order through the addressing, so only the forward scan is used.
``_rnnt_bwd_kernel`` writes the gradient of the logits with the softmax backward fused:
``dx_k = g * (p_k * occ - [k = blank] * w_blank - [k = label] * w_label)`` where ``occ`` is the
posterior of the lattice node and ``w`` the posteriors of its two outgoing arcs. Nothing of size
``B*T*U*K`` is stored besides the caller's logits and their gradient.
"""

import triton
import triton.language as tl

# A finite "log zero": sums of a few thousand of them stay finite in fp32, and exp() of it is 0.
NEG = tl.constexpr(-1.0e30)


@triton.jit
def _pack_base(BOFF, b):
    """First packed row of batch ``b`` (``boff`` holds the inclusive cumsum of the row counts)."""
    prev = tl.load(BOFF + b - 1, mask=b > 0, other=0)
    return tl.where(b > 0, prev, 0).to(tl.int64)


# ----------------------------------------------------------------------------------------------- joint


@triton.jit
def _joint_keep(F, G, RNG, b, t, u, h, T, U, H, f_off, g_off, hm, p_drop,
                RELU: tl.constexpr, DROPOUT: tl.constexpr):
    """The ReLU / dropout keep-mask of a ``(BLOCK_U, BLOCK_H)`` tile of rows ``(b, t, u)`` (recomputed in
    the backward exactly as the forward computed it: the sign of ``f + g``, the same counters)."""
    keep = hm
    if RELU:
        fv = tl.load(F + f_off, mask=hm, other=0.0).to(tl.float32)
        gv = tl.load(G + g_off, mask=hm, other=0.0).to(tl.float32)
        keep = keep & ((fv + gv) > 0)
    if DROPOUT:
        seed = tl.load(RNG)
        off = tl.load(RNG + 1)
        counter = off + ((b.to(tl.int64) * T + t) * U + u) * H + h
        keep = keep & (tl.rand(seed, counter) >= p_drop)
    return keep


@triton.jit(do_not_specialize=["T", "U", "H", "packed_rows"])
def _joint_fwd_kernel(F, G, FLEN, GLEN, BOFF, RNG, OUT, MASK, T, U, H, packed_rows, p_drop, scale,
                      PACK: tl.constexpr, RELU: tl.constexpr, DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr,
                      BLOCK_U: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program ``(b*T + t, u block, h block)``: ``h[b, t, u] = f[b, t] + g[b, u]`` (then ReLU / dropout) on
    the valid rows; dense outputs get ``-1`` elsewhere (as Apex writes, so no NaN reaches a weight
    gradient), packed outputs have no such rows."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    p_drop = tl.cast(p_drop, tl.float32)
    scale = tl.cast(scale, tl.float32)
    bt = tl.program_id(0)
    b = bt // T
    t = bt - b * T
    u = (tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U))[:, None]
    h = (tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
    fl = tl.minimum(tl.load(FLEN + b).to(tl.int32), T)
    gl = tl.maximum(tl.minimum(tl.load(GLEN + b).to(tl.int32), U), 0)
    hm = h < H
    # (Scalar conditions are folded into the bounds: the CPU interpreter mis-types scalar & vector masks.)
    valid = (u < tl.where(t < fl, gl, 0)) & hm
    f_off = bt.to(tl.int64) * H + h
    g_off = (b.to(tl.int64) * U + tl.minimum(u, U - 1)) * H + h
    # fp32 sums: one rounding to the output dtype, the same as an add in that dtype
    fv = tl.load(F + f_off, mask=valid, other=0.0).to(tl.float32)
    gv = tl.load(G + g_off, mask=valid, other=0.0).to(tl.float32)
    out = fv + gv
    if RELU or DROPOUT:
        keep = _joint_keep(F, G, RNG, b, t, u, h, T, U, H, f_off, g_off, valid, p_drop, RELU, DROPOUT)
        out = tl.where(keep, out * scale, 0.0)
    if PACK:
        row = _pack_base(BOFF, b) + t * gl + u
        smask = valid & (row < packed_rows)
    else:
        row = bt.to(tl.int64) * U + u
        smask = (u < U) & hm
        out = tl.where(valid, out, -1.0)
    tl.store(OUT + row * H + h, out.to(OUT.dtype.element_ty), mask=smask)
    if STORE_MASK:
        tl.store(MASK + row * H + h, keep.to(tl.uint8), mask=smask)


@triton.jit(do_not_specialize=["T", "U", "H"])
def _joint_bwd_f_kernel(DH, F, G, FLEN, GLEN, BOFF, RNG, DF, T, U, H, p_drop, scale,
                        PACK: tl.constexpr, RELU: tl.constexpr, DROPOUT: tl.constexpr,
                        BLOCK_U: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program ``(b*T + t, h block)``: ``df[b, t] = sum_{u < g_len} dh[b, t, u] * keep * scale`` (fp32
    accumulation); zero for ``t >= f_len``."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    p_drop = tl.cast(p_drop, tl.float32)
    scale = tl.cast(scale, tl.float32)
    bt = tl.program_id(0)
    b = bt // T
    t = bt - b * T
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
    fl = tl.minimum(tl.load(FLEN + b).to(tl.int32), T)
    gl = tl.maximum(tl.minimum(tl.load(GLEN + b).to(tl.int32), U), 0)
    gl = tl.where(t < fl, gl, 0)
    hm = h < H
    uu = tl.arange(0, BLOCK_U)[:, None]
    if PACK:
        rows0 = _pack_base(BOFF, b) + t * gl
    else:
        rows0 = bt.to(tl.int64) * U
    f_off = bt.to(tl.int64) * H + h
    acc = tl.zeros([BLOCK_U, BLOCK_H], dtype=tl.float32)
    for u0 in range(0, gl, BLOCK_U):
        u = u0 + uu
        m = (u < gl) & hm
        d = tl.load(DH + (rows0 + u) * H + h, mask=m, other=0.0).to(tl.float32)
        if RELU or DROPOUT:
            g_off = (b.to(tl.int64) * U + u) * H + h
            keep = _joint_keep(F, G, RNG, b, t, u, h, T, U, H, f_off, g_off, m, p_drop, RELU, DROPOUT)
            d = tl.where(keep, d * scale, 0.0)
        acc += d
    tl.store(DF + f_off, tl.sum(acc, axis=0)[None, :].to(DF.dtype.element_ty), mask=hm)


@triton.jit(do_not_specialize=["T", "U", "H"])
def _joint_bwd_g_kernel(DH, F, G, FLEN, GLEN, BOFF, RNG, DG, T, U, H, p_drop, scale,
                        PACK: tl.constexpr, RELU: tl.constexpr, DROPOUT: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program ``(b*U + u, h block)``: ``dg[b, u] = sum_{t < f_len} dh[b, t, u] * keep * scale`` (fp32
    accumulation); zero for ``u >= g_len``."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    p_drop = tl.cast(p_drop, tl.float32)
    scale = tl.cast(scale, tl.float32)
    bu = tl.program_id(0)
    b = bu // U
    u = bu - b * U
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
    fl = tl.maximum(tl.minimum(tl.load(FLEN + b).to(tl.int32), T), 0)
    gl = tl.maximum(tl.minimum(tl.load(GLEN + b).to(tl.int32), U), 0)
    fl = tl.where(u < gl, fl, 0)
    hm = h < H
    tt = tl.arange(0, BLOCK_T)[:, None]
    if PACK:
        base = _pack_base(BOFF, b) + u
        stride = gl.to(tl.int64)
    else:
        base = b.to(tl.int64) * T * U + u
        stride = U
    g_off = bu.to(tl.int64) * H + h
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for t0 in range(0, fl, BLOCK_T):
        t = t0 + tt
        m = (t < fl) & hm
        d = tl.load(DH + (base + t * stride) * H + h, mask=m, other=0.0).to(tl.float32)
        if RELU or DROPOUT:
            f_off = (b.to(tl.int64) * T + t) * H + h
            keep = _joint_keep(F, G, RNG, b, t, u, h, T, U, H, f_off, g_off, m, p_drop, RELU, DROPOUT)
            d = tl.where(keep, d * scale, 0.0)
        acc += d
    tl.store(DG + g_off, tl.sum(acc, axis=0)[None, :].to(DG.dtype.element_ty), mask=hm)


@triton.jit(do_not_specialize=["B", "N", "W"])
def _zero_tail_kernel(OUT, BOFF, B, N, W, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Zero the rows ``[boff[B-1], N)`` of a packed ``(N, W)`` tensor (rows no batch owns)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    start = tl.load(BOFF + B - 1).to(tl.int64)
    rm = (r >= start) & (r < N)
    w = tl.arange(0, BLOCK_W)[None, :]
    zero = tl.zeros([BLOCK_R, BLOCK_W], dtype=OUT.dtype.element_ty)
    if tl.max(rm.to(tl.int32), axis=0) > 0:
        for w0 in range(0, W, BLOCK_W):
            tl.store(OUT + r * W + w0 + w, zero, mask=rm & (w0 + w < W))


# ------------------------------------------------------------------------------------------------ loss


@triton.jit
def _loss_rows(FLEN, YLEN, BOFF, bt, T, U, N, PACK: tl.constexpr, BLOCK_U: tl.constexpr):
    """Batch, time step, ``u`` block, clamped lengths, validity and logits rows of a program."""
    b = bt // T
    t = bt - b * T
    u = tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U)
    fl = tl.maximum(tl.minimum(tl.load(FLEN + b).to(tl.int32), T), 1)
    yl = tl.maximum(tl.minimum(tl.load(YLEN + b).to(tl.int32), U - 1), 0)
    valid = u <= tl.where(t < fl, yl, -1)
    if PACK:
        row = _pack_base(BOFF, b) + t * (yl + 1) + u
        valid = valid & (row < N)
    else:
        row = bt.to(tl.int64) * U + u
    return b, t, u, fl, yl, valid, row


@triton.jit(do_not_specialize=["T", "U", "K", "N", "L", "blank"])
def _rnnt_logprobs_kernel(X, LABEL, FLEN, YLEN, BOFF, LSE, LPB, LPE, T, U, K, N, L, blank,
                          PACK: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(b*T + t, u block)``: per valid row, ``lse = logsumexp(x)``, ``lpb = x[blank] - lse`` and
    ``lpe = x[label[b, u]] - lse`` (``NEG`` at ``u = y_len``), stored at ``(b, t, u)`` of ``(B, T, U)``."""
    bt = tl.program_id(0)
    b, t, u, fl, yl, valid, row = _loss_rows(FLEN, YLEN, BOFF, bt, T, U, N, PACK, BLOCK_U)
    k = tl.arange(0, BLOCK_K)[None, :]
    xp = X + row[:, None] * K + k
    vm = valid[:, None]
    m = tl.full([BLOCK_U], NEG, tl.float32)
    s = tl.zeros([BLOCK_U], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(xp + k0, mask=vm & (k0 + k < K), other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(tl.where(s > 0, s, 1.0))  # rows that hold nothing (masked) get a finite filler
    emit = valid & (u < yl)
    lab = tl.load(LABEL + b.to(tl.int64) * L + u, mask=emit, other=0).to(tl.int32)
    lab = tl.minimum(tl.maximum(lab, 0), K - 1)
    xb = tl.load(X + row * K + blank, mask=valid, other=0.0).to(tl.float32)
    xe = tl.load(X + row * K + lab, mask=emit, other=0.0).to(tl.float32)
    idx = bt.to(tl.int64) * U + u
    tl.store(LSE + idx, lse, mask=valid)
    tl.store(LPB + idx, xb - lse, mask=valid)
    tl.store(LPE + idx, tl.where(emit, xe - lse, NEG), mask=valid)


@triton.jit
def _log_semiring_combine(e1, c1, e2, c2):
    """Compose ``x -> logaddexp(x + e1, c1)`` then ``x -> logaddexp(x + e2, c2)`` (finite operands)."""
    a = c1 + e2
    m = tl.maximum(a, c2)
    return e1 + e2, m + tl.log(tl.exp(a - m) + tl.exp(c2 - m))


@triton.jit(do_not_specialize=["T", "U"])
def _rnnt_alpha_beta_kernel(FLEN, YLEN, LPB, LPE, ALPHA, BETA, LOSS, T, U, BLOCK_U: tl.constexpr):
    """Program ``(b, 0)``: alpha of batch ``b``; program ``(b, 1)``: beta and ``loss[b] = -beta[b, 0, 0]``.

    ``alpha[t, u] = logaddexp(alpha[t-1, u] + lpb[t-1, u], alpha[t, u-1] + lpe[t, u-1])``, ``alpha[0, 0] = 0``;
    ``beta[t, u] = logaddexp(beta[t+1, u] + lpb[t, u], beta[t, u+1] + lpe[t, u])``,
    ``beta[fl-1, yl] = lpb[fl-1, yl]``. Lane ``j`` holds ``u = j`` for alpha and ``u = yl - j`` for beta.
    """
    b = tl.program_id(0)
    fl = tl.maximum(tl.minimum(tl.load(FLEN + b).to(tl.int32), T), 1)
    yl = tl.maximum(tl.minimum(tl.load(YLEN + b).to(tl.int32), U - 1), 0)
    j = tl.arange(0, BLOCK_U)
    jm = j <= yl
    base = b.to(tl.int64) * T * U
    prev = tl.zeros([BLOCK_U], dtype=tl.float32)
    if tl.program_id(1) == 0:
        start = tl.where(j == 0, 0.0, NEG)
        for t in range(0, fl):
            lpb = tl.load(LPB + base + (t - 1) * U + j, mask=j <= tl.where(t > 0, yl, -1), other=NEG)
            c = tl.where(t > 0, prev + lpb, start)
            e = tl.load(LPE + base + t * U + j - 1, mask=jm & (j > 0), other=0.0)
            _e, a = tl.associative_scan((e, c), 0, _log_semiring_combine)
            tl.store(ALPHA + base + t * U + j, a, mask=jm)
            prev = a
    else:
        u = yl - j
        for i in range(0, fl):
            t = fl - 1 - i
            lpb = tl.load(LPB + base + t * U + u, mask=jm, other=NEG)
            c = tl.where(i > 0, prev + lpb, tl.where(j == 0, lpb, NEG))
            e = tl.load(LPE + base + t * U + u, mask=jm & (j > 0), other=0.0)
            _e, bb = tl.associative_scan((e, c), 0, _log_semiring_combine)
            tl.store(BETA + base + t * U + u, bb, mask=jm)
            prev = bb
        loss = -tl.sum(tl.where(j == yl, prev, 0.0), axis=0)
        tl.store(LOSS + b, loss.to(LOSS.dtype.element_ty))


@triton.jit
def _logit_grad(x, shift, kk, blank, lab, w_blank, w_label):
    """The RNN-T loss's gradient w.r.t. the logits ``x`` (rows x vocabulary block ``kk``), softmax backward fused:
    ``exp(x + shift)`` (the row's softmax times its lattice weight) less the blank and label lattice weights."""
    g = tl.exp(x + shift[:, None])
    g -= tl.where(kk == blank, w_blank[:, None], 0.0)
    g -= tl.where(kk == lab[:, None], w_label[:, None], 0.0)
    return g


@triton.jit(do_not_specialize=["T", "U", "K", "N", "L", "blank"])
def _rnnt_bwd_kernel(X, DX, LABEL, FLEN, YLEN, BOFF, LSE, LPB, LPE, ALPHA, BETA, LG, T, U, K, N, L, blank,
                     PACK: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(b*T + t, u block)``: the gradient of ``sum_b lg[b] * loss[b]`` w.r.t. the logits rows
    (softmax backward fused). Dense rows outside the lengths get zeros."""
    bt = tl.program_id(0)
    b, t, u, fl, yl, valid, row = _loss_rows(FLEN, YLEN, BOFF, bt, T, U, N, PACK, BLOCK_U)
    idx = bt.to(tl.int64) * U + u
    base = b.to(tl.int64) * T * U
    a = tl.load(ALPHA + idx, mask=valid, other=0.0)
    be = tl.load(BETA + idx, mask=valid, other=0.0)
    b0 = tl.load(BETA + base)
    lse = tl.load(LSE + idx, mask=valid, other=0.0)
    lpb = tl.load(LPB + idx, mask=valid, other=0.0)
    lpe = tl.load(LPE + idx, mask=valid, other=NEG)
    emit = valid & (u < yl)
    # beta of the node a blank leads to (the virtual end node after (fl-1, yl) has beta 0)
    b_next_t = tl.load(BETA + idx + U, mask=valid & (u <= tl.where(t < fl - 1, yl, -1)), other=NEG)
    b_next_t = tl.where(u == tl.where(t == fl - 1, yl, -1), 0.0, b_next_t)
    b_next_u = tl.load(BETA + idx + 1, mask=emit, other=NEG)
    lg = tl.load(LG + b).to(tl.float32)
    shift = a + be - b0 - lse
    w_blank = tl.exp(a + lpb + b_next_t - b0)
    w_label = tl.where(emit, tl.exp(a + lpe + b_next_u - b0), 0.0)
    lab = tl.load(LABEL + b.to(tl.int64) * L + u, mask=emit, other=-1).to(tl.int32)
    lab = tl.where(emit, tl.minimum(tl.maximum(lab, 0), K - 1), -1)
    k = tl.arange(0, BLOCK_K)[None, :]
    off = row[:, None] * K + k
    vm = valid[:, None]
    if PACK:
        smask = vm
    else:
        smask = (u < U)[:, None]
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        km = kk < K
        x = tl.load(X + off + k0, mask=vm & km, other=0.0).to(tl.float32)
        g = _logit_grad(x, shift, kk, blank, lab, w_blank, w_label)
        g = tl.where(vm, g * lg, 0.0)
        tl.store(DX + off + k0, g.to(DX.dtype.element_ty), mask=smask & km)


# ------------------------------------------------------------------------ projection + loss (culmen's own)
#
# ``rnnt_projection_loss`` (a culmen addition, not in Apex) never holds the whole logits tensor: it projects
# a chunk of joint rows at a time (cuBLAS through torch) and these kernels work on that chunk. Chunk row
# ``i`` is row ``r0 + i`` of the joint output (dense ``(B*T*U, H)`` or packed); its lattice node ``(b, t, u)``
# is found from the row number (packed rows: a binary search over the inclusive batch offsets), so the
# ``(B, T, U)`` statistics and recursions of the loss above serve unchanged.


@triton.jit
def _proj_rows(FLEN, YLEN, BOFF, r, B, T, U, nsteps, PACK: tl.constexpr):
    """``(b, t, u, fl, yl, valid, idx)`` of the joint rows ``r`` (int64 vector): the lattice node, the
    clamped lengths of its batch, whether the node is inside them and its flat ``(B, T, U)`` index."""
    if PACK:
        # first batch whose inclusive offset exceeds r (B when r is past every batch)
        lo = tl.zeros(r.shape, dtype=tl.int32)
        hi = lo + B
        for _ in range(0, nsteps):
            act = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(BOFF + mid, mask=act, other=0).to(tl.int64)
            go = v <= r
            lo = tl.where(act & go, mid + 1, lo)
            hi = tl.where(act & (v > r), mid, hi)
        b = tl.minimum(lo, B - 1)
        prev = tl.load(BOFF + b - 1, mask=b > 0, other=0).to(tl.int64)
        fl = tl.maximum(tl.minimum(tl.load(FLEN + b).to(tl.int32), T), 1)
        yl = tl.maximum(tl.minimum(tl.load(YLEN + b).to(tl.int32), U - 1), 0)
        local = r - tl.where(b > 0, prev, 0)
        w = (yl + 1).to(tl.int64)
        t = local // w
        u = local - t * w
        valid = (lo < B) & (t < fl)
    else:
        tu = T * U
        b = tl.minimum(r // tu, B - 1)  # rows past the chunk's end stay inside the length tensors
        rem = r - b * tu
        t = rem // U
        u = rem - t * U
        fl = tl.maximum(tl.minimum(tl.load(FLEN + b).to(tl.int32), T), 1)
        yl = tl.maximum(tl.minimum(tl.load(YLEN + b).to(tl.int32), U - 1), 0)
        valid = (t < fl) & (u <= yl)
    b = b.to(tl.int64)
    t = t.to(tl.int32)
    u = u.to(tl.int32)
    idx = (b * T + t) * U + u
    return b, t, u, fl, yl, valid, idx


@triton.jit(do_not_specialize=["r0", "C", "B", "T", "U", "K", "L", "blank", "nsteps"])
def _proj_logprobs_kernel(X, LABEL, FLEN, YLEN, BOFF, LSE, LPB, LPE, r0, C, B, T, U, K, L, blank, nsteps,
                          PACK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``i block`` of a chunk of ``C`` logits rows ``X (C, K)`` (joint rows ``r0 + i``): the
    ``lse`` / ``lpb`` / ``lpe`` of ``_rnnt_logprobs_kernel``, stored at each valid row's lattice node."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r = i.to(tl.int64) + r0
    b, t, u, fl, yl, valid, idx = _proj_rows(FLEN, YLEN, BOFF, r, B, T, U, nsteps, PACK)
    valid = valid & (i < C)
    k = tl.arange(0, BLOCK_K)[None, :]
    row = i.to(tl.int64)[:, None] * K
    vm = valid[:, None]
    m = tl.full([BLOCK_R], NEG, tl.float32)
    s = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + row + k0 + k, mask=vm & (k0 + k < K), other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(tl.where(s > 0, s, 1.0))
    emit = valid & (u < yl)
    lab = tl.load(LABEL + b * L + u, mask=emit, other=0).to(tl.int32)
    lab = tl.minimum(tl.maximum(lab, 0), K - 1)
    rk = i.to(tl.int64) * K
    xb = tl.load(X + rk + blank, mask=valid, other=0.0).to(tl.float32)
    xe = tl.load(X + rk + lab, mask=emit, other=0.0).to(tl.float32)
    tl.store(LSE + idx, lse, mask=valid)
    tl.store(LPB + idx, xb - lse, mask=valid)
    tl.store(LPE + idx, tl.where(emit, xe - lse, NEG), mask=valid)


@triton.jit(do_not_specialize=["r0", "C", "B", "T", "U", "K", "L", "blank", "nsteps"])
def _proj_grad_kernel(X, LABEL, FLEN, YLEN, BOFF, LSE, LPB, LPE, ALPHA, BETA, LG, r0, C, B, T, U, K, L, blank,
                      nsteps, PACK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``i block`` of a chunk: overwrite the logits rows ``X (C, K)`` with their gradient (the
    softmax-fused formula of ``_rnnt_bwd_kernel``); rows outside the lengths become zeros. In place: each
    element is read before the same program writes it."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = i < C
    r = i.to(tl.int64) + r0
    b, t, u, fl, yl, valid, idx = _proj_rows(FLEN, YLEN, BOFF, r, B, T, U, nsteps, PACK)
    valid = valid & inside
    base = b * T * U
    a = tl.load(ALPHA + idx, mask=valid, other=0.0)
    be = tl.load(BETA + idx, mask=valid, other=0.0)
    b0 = tl.load(BETA + base, mask=valid, other=0.0)
    lse = tl.load(LSE + idx, mask=valid, other=0.0)
    lpb = tl.load(LPB + idx, mask=valid, other=0.0)
    lpe = tl.load(LPE + idx, mask=valid, other=NEG)
    emit = valid & (u < yl)
    last_t = t == fl - 1
    b_next_t = tl.load(BETA + idx + U, mask=valid & (t < fl - 1), other=NEG)
    b_next_t = tl.where(last_t & (u == yl), 0.0, b_next_t)
    b_next_u = tl.load(BETA + idx + 1, mask=emit, other=NEG)
    lg = tl.load(LG + b, mask=valid, other=0.0).to(tl.float32)
    shift = a + be - b0 - lse
    w_blank = tl.exp(a + lpb + b_next_t - b0)
    w_label = tl.where(emit, tl.exp(a + lpe + b_next_u - b0), 0.0)
    lab = tl.load(LABEL + b * L + u, mask=emit, other=-1).to(tl.int32)
    lab = tl.where(emit, tl.minimum(tl.maximum(lab, 0), K - 1), -1)
    k = tl.arange(0, BLOCK_K)[None, :]
    off = i.to(tl.int64)[:, None] * K + k
    vm = valid[:, None]
    im = inside[:, None]
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        km = kk < K
        x = tl.load(X + off + k0, mask=vm & km, other=0.0).to(tl.float32)
        g = _logit_grad(x, shift, kk, blank, lab, w_blank, w_label)
        g = tl.where(vm, g * lg[:, None], 0.0)
        tl.store(X + off + k0, g.to(X.dtype.element_ty), mask=im & km)
