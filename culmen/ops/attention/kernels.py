"""Triton FlashAttention kernels for the dense BSHD layout (forward and backward).

Conventions (the same as ``reference.py`` and ``dropout.py``):

* scores ``s = softmax_scale * q . k``; softcap ``s = softcap * tanh(s / softcap)``; ALiBi
  ``s -= slope * |i + sk - sq - j|``; then the bottom-right aligned window
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (``HAS_LEFT`` / ``HAS_RIGHT`` off = unbounded);
* ``lse`` in fp32, ``+inf`` on rows that see no key (their output and gradients are 0);
* dropout keeps ``(i, j)`` iff ``tl.rand(seed, off + ((b * H + h) * sq + i) * sk + j) >= p``, kept
  probabilities scaled by ``1 / (1 - p)``; ``(seed, off)`` are read from the int64 ``rng`` tensor;
* GQA: query head ``h`` reads KV head ``h // GROUP``; the dK/dV kernel loops over the ``GROUP``
  query heads of its KV head, so dK/dV are accumulated per KV head without expanded buffers;
* all element offsets are int64; the head dim is padded to ``BLOCK_D`` (a power of 2) with masks.

The softmax runs in base 2 (``exp2``) on ``s * log2(e)``; fully masked K/V blocks are skipped by
bounding the loops with the window.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``UPCAST`` (CPU interpreter and bf16 only: the interpreter's
    bf16 dot is wrong) multiplies the exactly upcast fp32 operands instead."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _tanh(x):
    # Overflow-free tanh: sign(x) * (1 - e^{-2|x|}) / (1 + e^{-2|x|}).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, i, j, sq, sk, scale, softcap, slope, left, right, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Scores ``(BLOCK_M, BLOCK_N)`` in natural units (masked -> -inf) and the softcap tanh (or s)."""
    s = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale
    t = s
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = softcap * t
    rel = j[None, :] - (i[:, None] + sk - sq)  # column minus the row's diagonal
    if ALIBI:
        s = s - slope * tl.abs(rel).to(tl.float32)
    vis = (j[None, :] < sk) & (i[:, None] < sq)
    if HAS_RIGHT:
        vis = vis & (rel <= right)
    if HAS_LEFT:
        vis = vis & (rel >= -left)
    s = tl.where(vis, s, float("-inf"))
    return s, t


@triton.jit
def _keep(rng_ptr, p_drop, bh, i, j, sq, sk):
    seed = tl.load(rng_ptr)
    off = tl.load(rng_ptr + 1)
    counter = off + ((bh.to(tl.int64) * sq + i.to(tl.int64)[:, None]) * sk + j.to(tl.int64)[None, :])
    return tl.rand(seed, counter) >= p_drop


@triton.jit
def _kv_range(m0, sq, sk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """``[lo, hi)`` of the key columns rows ``m0 .. m0 + BLOCK_M`` can see; ``lo`` block-aligned."""
    lo = 0
    hi = sk
    if HAS_RIGHT:
        last = tl.minimum(m0 + BLOCK_M, sq) - 1
        hi = tl.maximum(tl.minimum(sk, last + sk - sq + right + 1), 0)
    if HAS_LEFT:
        lo = tl.maximum(m0 + sk - sq - left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, alibi_ptr, rng_ptr,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    stride_ab,
    H, GROUP, sq, sk, D,
    scale, softcap, p_drop, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kh = h // GROUP
    m0 = pid_m * BLOCK_M
    i = m0 + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    b64 = b.to(tl.int64)
    q_base = q_ptr + b64 * sqb + h.to(tl.int64) * sqh
    k_base = k_ptr + b64 * skb + kh.to(tl.int64) * skh
    v_base = v_ptr + b64 * svb + kh.to(tl.int64) * svh
    q = tl.load(q_base + i.to(tl.int64)[:, None] * sqs + dd[None, :], mask=(i[:, None] < sq) & dmask[None, :],
                other=0.0)
    slope = 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + b * stride_ab + h).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _kv_range(m0, sq, sk, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        kvmask = (j[:, None] < sk) & dmask[None, :]
        j64 = j.to(tl.int64)[:, None]
        k = tl.load(k_base + j64 * sks + dd[None, :], mask=kvmask, other=0.0)
        s, _t = _scores(q, k, i, j, sq, sk, scale, softcap, slope, left, right, DOT_PREC, UPCAST, SOFTCAP, ALIBI,
                        HAS_LEFT, HAS_RIGHT)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2((s - m_safe[:, None]) * 1.4426950408889634)
        alpha = tl.exp2((m_i - m_safe) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(_keep(rng_ptr, p_drop, bh, i, j, sq, sk), p, 0.0)
        v = tl.load(v_base + j64 * svs + dd[None, :], mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, UPCAST)
        m_i = m_new
    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    if DROPOUT:
        inv = inv / (1.0 - p_drop)
    out = acc * inv[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    o_base = o_ptr + b64 * sob + h.to(tl.int64) * soh
    tl.store(o_base + i.to(tl.int64)[:, None] * sos + dd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(i[:, None] < sq) & dmask[None, :])
    tl.store(lse_ptr + bh.to(tl.int64) * sq + i, lse, mask=i < sq)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr,
    sob, sos, soh, sdb, sds, sdh,
    H, sq, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    mask = (i[:, None] < sq) & (dd[None, :] < D)
    i64 = i.to(tl.int64)[:, None]
    o = tl.load(o_ptr + b * sob + h * soh + i64 * sos + dd[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b * sdb + h * sdh + i64 * sds + dd[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * sq + i, tl.sum(o * do, 1), mask=i < sq)


@triton.jit
def _bwd_ds(q, k, v, do, lse, delta, i, j, bh, sq, sk, scale, softcap, slope, left, right, p_drop, rng_ptr,
            DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
            DROPOUT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """``(p_dropped, ds)`` of one ``(BLOCK_M, BLOCK_N)`` tile; ``ds`` is w.r.t. the unscaled q.k."""
    s, t = _scores(q, k, i, j, sq, sk, scale, softcap, slope, left, right, DOT_PREC, UPCAST, SOFTCAP, ALIBI,
                   HAS_LEFT, HAS_RIGHT)
    # lse = +inf on empty rows and s = -inf on masked entries: both give p = 0, never NaN.
    p = tl.exp2((s - lse[:, None]) * 1.4426950408889634)
    p = tl.where(s == float("-inf"), 0.0, p)
    dp = _dot(do, tl.trans(v), DOT_PREC, UPCAST)
    pd = p
    if DROPOUT:
        keep = _keep(rng_ptr, p_drop, bh, i, j, sq, sk)
        inv = 1.0 / (1.0 - p_drop)
        pd = tl.where(keep, p, 0.0) * inv
        dp = tl.where(keep, dp, 0.0) * inv
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return pd, ds


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, alibi_ptr, rng_ptr,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
    stride_ab,
    H, HK, GROUP, sq, sk, D,
    scale, softcap, p_drop, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bkh = tl.program_id(1)
    b = bkh // HK
    kh = bkh % HK
    n0 = pid_n * BLOCK_N
    j = n0 + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    b64 = b.to(tl.int64)
    j64 = j.to(tl.int64)[:, None]
    kvmask = (j[:, None] < sk) & dmask[None, :]
    k = tl.load(k_ptr + b64 * skb + kh.to(tl.int64) * skh + j64 * sks + dd[None, :], mask=kvmask, other=0.0)
    v = tl.load(v_ptr + b64 * svb + kh.to(tl.int64) * svh + j64 * svs + dd[None, :], mask=kvmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Rows that can see columns n0 .. n0 + BLOCK_N: i >= j + sq - sk - right, i <= j + sq - sk + left.
    lo = 0
    hi = sq
    if HAS_RIGHT:
        lo = tl.maximum(n0 + sq - sk - right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        last = tl.minimum(n0 + BLOCK_N, sk) - 1
        hi = tl.maximum(tl.minimum(sq, last + sq - sk + left + 1), 0)
    for g in range(0, GROUP):
        h = kh * GROUP + g
        bh = b * H + h
        q_base = q_ptr + b64 * sqb + h.to(tl.int64) * sqh
        do_base = do_ptr + b64 * sdb + h.to(tl.int64) * sdh
        slope = 0.0
        if ALIBI:
            slope = tl.load(alibi_ptr + b * stride_ab + h).to(tl.float32)
        for m0 in range(lo, hi, BLOCK_M):
            i = m0 + tl.arange(0, BLOCK_M)
            i64 = i.to(tl.int64)[:, None]
            qmask = (i[:, None] < sq) & dmask[None, :]
            q = tl.load(q_base + i64 * sqs + dd[None, :], mask=qmask, other=0.0)
            do = tl.load(do_base + i64 * sds + dd[None, :], mask=qmask, other=0.0)
            lse = tl.load(lse_ptr + bh.to(tl.int64) * sq + i, mask=i < sq, other=float("inf"))
            delta = tl.load(delta_ptr + bh.to(tl.int64) * sq + i, mask=i < sq, other=0.0)
            pd, ds = _bwd_ds(q, k, v, do, lse, delta, i, j, bh, sq, sk, scale, softcap, slope, left, right,
                             p_drop, rng_ptr, DOT_PREC, UPCAST, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT)
            dv += _dot(tl.trans(pd.to(do.dtype)), do, DOT_PREC, UPCAST)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PREC, UPCAST)
    dk = dk * scale
    tl.store(dk_ptr + b64 * sdkb + kh.to(tl.int64) * sdkh + j64 * sdks + dd[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=kvmask)
    tl.store(dv_ptr + b64 * sdvb + kh.to(tl.int64) * sdvh + j64 * sdvs + dd[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=kvmask)


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, alibi_ptr, rng_ptr,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdqb, sdqs, sdqh,
    stride_ab,
    H, GROUP, sq, sk, D,
    scale, softcap, p_drop, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kh = h // GROUP
    m0 = pid_m * BLOCK_M
    i = m0 + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    b64 = b.to(tl.int64)
    i64 = i.to(tl.int64)[:, None]
    qmask = (i[:, None] < sq) & dmask[None, :]
    q = tl.load(q_ptr + b64 * sqb + h.to(tl.int64) * sqh + i64 * sqs + dd[None, :], mask=qmask, other=0.0)
    do = tl.load(do_ptr + b64 * sdb + h.to(tl.int64) * sdh + i64 * sds + dd[None, :], mask=qmask, other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * sq + i, mask=i < sq, other=float("inf"))
    delta = tl.load(delta_ptr + bh.to(tl.int64) * sq + i, mask=i < sq, other=0.0)
    slope = 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + b * stride_ab + h).to(tl.float32)
    k_base = k_ptr + b64 * skb + kh.to(tl.int64) * skh
    v_base = v_ptr + b64 * svb + kh.to(tl.int64) * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _kv_range(m0, sq, sk, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j64 = j.to(tl.int64)[:, None]
        kvmask = (j[:, None] < sk) & dmask[None, :]
        k = tl.load(k_base + j64 * sks + dd[None, :], mask=kvmask, other=0.0)
        v = tl.load(v_base + j64 * svs + dd[None, :], mask=kvmask, other=0.0)
        _pd, ds = _bwd_ds(q, k, v, do, lse, delta, i, j, bh, sq, sk, scale, softcap, slope, left, right,
                          p_drop, rng_ptr, DOT_PREC, UPCAST, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT)
        dq += _dot(ds.to(k.dtype), k, DOT_PREC, UPCAST)
    dq = dq * scale
    tl.store(dq_ptr + b64 * sdqb + h.to(tl.int64) * sdqh + i64 * sdqs + dd[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=qmask)
