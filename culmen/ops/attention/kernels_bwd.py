"""Triton FlashAttention backward kernels: ``delta = rowsum(out * dout)`` (``_attn_bwd_preprocess_kernel``),
dK/dV per KV head (``_attn_bwd_dkdv_kernel``) and dQ (``_attn_bwd_dq_kernel``), dense BSHD and varlen.

They follow the conventions of ``kernels.py`` (score transform, masks, dropout stream, GQA, varlen layout,
``SU``-scaled strides, ``do_not_specialize``) and share its ``@triton.jit`` helpers, imported from there so
the forward and the backward compute scores, masks and bounds with the same code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from culmen.ops.attention.kernels import (
    LN2,
    LOG2E,
    _bounds,
    _bounds_t,
    _dot,
    _dot_acc,
    _jit,
    _keep,
    _load_rows,
    _query_tile,
    _scores2,
    _sequence,
    _su,
)


@_jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr, cu_q_ptr,
    sob, sos, soh, sdb, sds, sdh, slb, slh,
    H, SQ, TQ, D, NUM_M,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, SU: tl.constexpr,
):
    """``delta = rowsum(out * dout)`` (fp32, laid out like ``lse``)."""
    sob, sos, soh = _su(sob, SU), _su(sos, SU), _su(soh, SU)
    sdb, sds, sdh = _su(sdb, SU), _su(sds, SU), _su(sdh, SU)
    pid_m, bh = _query_tile(NUM_M, False)
    b = bh // H
    h = (bh % H).to(tl.int64)
    q0, sq = _sequence(cu_q_ptr, b, SQ, TQ, SQ, VARLEN)
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    mask = (i[:, None] < sq) & (dd[None, :] < D)
    i64 = (q0 + i.to(tl.int64))[:, None]
    b64 = b.to(tl.int64)
    o = tl.load(o_ptr + b64 * sob + h * soh + i64 * sos + dd[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b64 * sdb + h * sdh + i64 * sds + dd[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + b64 * slb + h * slh + q0 + i, tl.sum(o * do, 1), mask=i < sq)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc, sqs, sds, sdqs, dd, dmask, j,
                m0, sq,
                sk, qk_scale, softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS,
                BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, MASK: tl.constexpr,
                EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ATOMIC_DQ: tl.constexpr, ddv, dvmask,
                DV: tl.constexpr, EVEN_DV: tl.constexpr, CHUNK: tl.constexpr, TMA_DQ: tl.constexpr):
    """One query block's contribution to a key block's dK / dV, computed in the transposed
    ``(key, query)`` orientation so that ``dV += P^T dO`` and ``dK += dS^T Q`` need no transposed tile.
    ``ATOMIC_DQ``: also add this tile's dQ into fp32 ``dq_base``, by element atomics or, with ``TMA_DQ``, by one
    bulk reduce-add through the descriptor ``dq_desc`` (rows past the sequence lie outside it: dropped)."""
    i = m0 + tl.arange(0, BLOCK_M)
    i64 = i.to(tl.int64)[:, None]
    if MASK:
        qmask = (i[:, None] < sq) & dmask[None, :]
        q = tl.load(q_base + i64 * sqs + dd[None, :], mask=qmask, other=0.0)
        if DV > 0:
            do = tl.load(do_base + i64 * sds + ddv[None, :], mask=(i[:, None] < sq) & dvmask[None, :], other=0.0)
        else:
            do = tl.load(do_base + i64 * sds + dd[None, :], mask=qmask, other=0.0)
        lse = tl.load(lse_base + i, mask=i < sq, other=float("inf"))
        delta = tl.load(delta_base + i, mask=i < sq, other=0.0)
    else:
        if DV > 0:
            q = _load_rows(q_base, q_base, sqs, 0, i64, dd, dmask, sq, False, EVEN_D, False)
            do = _load_rows(do_base, do_base, sds, 0, i64, ddv, dvmask, sq, False, EVEN_DV, False)
        elif EVEN_D:
            q = tl.load(q_base + i64 * sqs + dd[None, :])
            do = tl.load(do_base + i64 * sds + dd[None, :])
        else:
            q = tl.load(q_base + i64 * sqs + dd[None, :], mask=dmask[None, :], other=0.0)
            do = tl.load(do_base + i64 * sds + dd[None, :], mask=dmask[None, :], other=0.0)
        lse = tl.load(lse_base + i)
        delta = tl.load(delta_base + i)
    kq = _dot(k, tl.trans(q), DOT_PREC, UPCAST)  # (N, M) = scores transposed
    s, t = _scores2(kq, i[None, :], j[:, None], sq, sk, qk_scale, softcap, slope2, left, right, MASK, SOFTCAP,
                    ALIBI, HAS_LEFT, HAS_RIGHT, CHUNK)
    # lse = +inf on rows that see nothing and s = -inf on masked entries: both give p = 0, not NaN.
    p = tl.math.exp2(s - lse[None, :] * LOG2E)
    if MASK:
        p = tl.where(s == float("-inf"), 0.0, p)
    dp = _dot(v, tl.trans(do), DOT_PREC, UPCAST)
    pd = p
    if DROPOUT:
        keep = _keep(rng_ptr, p_drop, bh, i[None, :], j[:, None], SQS, SKS)
        inv = 1.0 / (1.0 - p_drop)
        pd = tl.where(keep, p, 0.0) * inv
        dp = tl.where(keep, dp, 0.0) * inv
    ds = p * (dp - delta[None, :])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dv = _dot_acc(pd.to(do.dtype), do, dv, DOT_PREC, UPCAST)
    dsc = ds.to(q.dtype)
    dk = _dot_acc(dsc, q, dk, DOT_PREC, UPCAST)
    if ATOMIC_DQ:  # dQ of this tile straight from dS (5 matmuls instead of 7), summed in fp32 by atomics
        dq = _dot(tl.trans(dsc), k, DOT_PREC, UPCAST) * (qk_scale * LN2)
        if TMA_DQ:  # cp.reduce.async.bulk.tensor on Hopper: one instruction per tile, not one atomic per element
            dq_desc.atomic_add([m0, 0], dq)
        elif MASK:
            tl.atomic_add(dq_base + i64 * sdqs + dd[None, :], dq, mask=qmask, sem="relaxed")
        elif EVEN_D:
            tl.atomic_add(dq_base + i64 * sdqs + dd[None, :], dq, sem="relaxed")
        else:
            tl.atomic_add(dq_base + i64 * sdqs + dd[None, :], dq, mask=dmask[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_range(dk, dv, dvq, k, v, start, stop, start2, stop2, GROUP, hb, ptrs, strides, scal, q0, b, dd, dmask, j,
                sq, sk, D, SQS, SKS,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                MASK: tl.constexpr, EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                DROPOUT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                ddv, dvmask, DV: tl.constexpr, EVEN_DV: tl.constexpr, CHUNK: tl.constexpr, TMA_DQ: tl.constexpr,
                QV: tl.constexpr):
    """Query blocks ``start, start + BLOCK_M, .. < stop``, then ``start2, .. < stop2``, of every query head of the
    key block's group, in one loop (block by block, the group's heads within a block). ``hb``: the batch offsets
    of q / do / lse / dq, the group's first head and ``b * H``; ``ptrs``, ``strides``, ``scal``: the kernel's
    pointers, per-row / per-head strides and scalars the blocks read."""
    qb0, db0, lb0, dqb0, h0, bh0 = hb
    q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, alibi_ptr, qv_ptr, rng_ptr = ptrs
    sqs, sqh, sds, sdh, slh, sdqs, sdqh, stride_ab = strides
    qk_scale, softcap, left, right, p_drop = scal
    nb = tl.cdiv(tl.maximum(stop - start, 0), BLOCK_M)
    nb2 = tl.cdiv(tl.maximum(stop2 - start2, 0), BLOCK_M)
    for t in range(0, (nb + nb2) * GROUP):
        # Divide by GROUP (>= 1), never by nb: nb may be 0, and LLVM, free to assume a divisor is not 0, then
        # dropped the zero-trip guard of the pipelined loads (illegal addresses on the GPU when GROUP == 1).
        mb = t // GROUP
        h = h0 + (t - mb * GROUP)
        m0 = tl.where(mb < nb, start + mb * BLOCK_M, start2 + (mb - nb) * BLOCK_M)
        h64 = h.to(tl.int64)
        q_base = q_ptr + qb0 + h64 * sqh + q0 * sqs
        do_base = do_ptr + db0 + h64 * sdh + q0 * sds
        lse_base = lse_ptr + lb0 + h64 * slh + q0
        delta_base = delta_ptr + lb0 + h64 * slh + q0
        dq_base = dq_ptr + dqb0 + h64 * sdqh + q0 * sdqs
        if TMA_DQ:  # bound to this head's rows of this sequence: the reduce drops rows >= sq, columns >= D
            dq_desc = tl.make_tensor_descriptor(dq_base, shape=[sq, D], strides=[sdqs, 1],
                                                block_shape=[BLOCK_M, BLOCK_D])
        else:
            dq_desc = dq_base
        slope2 = 0.0
        if ALIBI:
            slope2 = tl.load(alibi_ptr + b * stride_ab + h).to(tl.float32) * LOG2E
        if QV:
            qv_base = qv_ptr + db0 + h64 * sdh + q0 * sds
            dk, dv, dvq = _dkdv_block_qv(dk, dv, dvq, k, v, q_base, qv_base, do_base, lse_base, delta_base, sqs, sds,
                                         dd, dmask, j, m0, sq, sk, qk_scale, softcap, slope2, left, right, BLOCK_M,
                                         DOT_PREC, UPCAST, MASK, EVEN_D, SOFTCAP, ALIBI, HAS_LEFT, HAS_RIGHT, ddv,
                                         dvmask, EVEN_DV, CHUNK)
        else:
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc, sqs, sds, sdqs,
                                 dd, dmask, j, m0, sq, sk, qk_scale, softcap, slope2, left, right, p_drop, rng_ptr,
                                 bh0 + h, SQS, SKS, BLOCK_M, DOT_PREC, UPCAST, MASK, EVEN_D, SOFTCAP, ALIBI,
                                 DROPOUT, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ, ddv, dvmask, DV, EVEN_DV, CHUNK, TMA_DQ)
    return dk, dv, dvq


@_jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr, alibi_ptr, rng_ptr, cu_q_ptr, cu_k_ptr,
    qv_ptr,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    sdkb, sdks, sdkh, sdvb, sdvs, sdvh, sdqb, sdqs, sdqh, slb, slh,
    stride_ab,
    H, HK, GROUP, SQ, SK, SQS, SKS, TQ, TK, D, NUM_N,
    qk_scale, softcap, p_drop, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    SU: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, CHUNK: tl.constexpr,
    QV: tl.constexpr, TMA_DQ: tl.constexpr,
):
    """dK and dV of one key block (and, with ``ATOMIC_DQ``, its atomic share of dQ in fp32 ``dq_ptr``, with
    ``TMA_DQ`` added by TMA reduce through per-head descriptors: ``dq_ptr`` contiguous, rows 16-byte aligned).
    ``DV`` / ``CHUNK`` as in the forward (a V head dim other than ``D``; chunked-local masks). ``QV``: FA3's
    ``qv`` (read with ``do``'s strides: both contiguous ``(.., h, DV)``) adds ``dS^T qv`` to dV."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    p_drop = tl.cast(p_drop, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    sqb, sqs, sqh = _su(sqb, SU), _su(sqs, SU), _su(sqh, SU)
    skb, sks, skh = _su(skb, SU), _su(sks, SU), _su(skh, SU)
    svb, svs, svh = _su(svb, SU), _su(svs, SU), _su(svh, SU)
    sdb, sds, sdh = _su(sdb, SU), _su(sds, SU), _su(sdh, SU)
    sdkb, sdks, sdkh = _su(sdkb, SU), _su(sdks, SU), _su(sdkh, SU)
    sdvb, sdvs, sdvh = _su(sdvb, SU), _su(sdvs, SU), _su(sdvh, SU)
    sdqb, sdqs, sdqh = _su(sdqb, SU), _su(sdqs, SU), _su(sdqh, SU)
    pid = tl.program_id(0)
    pid_n = pid % NUM_N
    bkh = pid // NUM_N
    b = bkh // HK
    kh = bkh % HK
    q0, sq = _sequence(cu_q_ptr, b, SQ, TQ, SQ, VARLEN)
    k0, sk = _sequence(cu_k_ptr, b, SK, TK, SK, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= sk:
        return
    j = n0 + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    b64 = b.to(tl.int64)
    j64 = (k0 + j.to(tl.int64))[:, None]
    kvmask = (j[:, None] < sk) & dmask[None, :]
    if DV > 0:
        ddv = tl.arange(0, BLOCK_DV)
        dvmask = ddv < DV
        vmask = (j[:, None] < sk) & dvmask[None, :]
    else:
        ddv = dd
        dvmask = dmask
        vmask = kvmask
    k = tl.load(k_ptr + b64 * skb + kh.to(tl.int64) * skh + j64 * sks + dd[None, :], mask=kvmask, other=0.0)
    v = tl.load(v_ptr + b64 * svb + kh.to(tl.int64) * svh + j64 * svs + ddv[None, :], mask=vmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if QV:
        dvq = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    else:
        dvq = 0.0
    lo, f0, f1, hi = _bounds_t(n0, sq, sk, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, CHUNK)
    # One flat loop per block kind over (query block, query head of the group), not a head loop around three
    # block loops: the nested form spilled (255 registers and a 712 B stack at d64 under Triton 3.6); flat, the
    # spills are gone (bench/notes/attention.md v8).
    hb = (b64 * sqb, b64 * sdb, b64 * slb, b64 * sdqb, kh * GROUP, b * H)
    ptrs = (q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, alibi_ptr, qv_ptr, rng_ptr)
    strides = (sqs, sqh, sds, sdh, slh, sdqs, sdqh, stride_ab)
    scal = (qk_scale, softcap, left, right, p_drop)
    dk, dv, dvq = _dkdv_range(dk, dv, dvq, k, v, f0, f1, 0, 0, GROUP, hb, ptrs, strides, scal, q0, b,
                              dd, dmask, j, sq, sk, D, SQS, SKS, BLOCK_M, BLOCK_D, DOT_PREC, UPCAST, False,
                              EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ, ddv, dvmask, DV,
                              EVEN_DV, CHUNK, TMA_DQ, QV)
    # The boundary blocks (diagonal / window edges, the sequence end): at d <= 64 in one masked loop (H200, d64
    # GQA 32/8 s2k causal: 1.39 -> 1.36 ms), at d128 in two (one loop was 2-5% slower there).
    if BLOCK_D <= 64:
        dk, dv, dvq = _dkdv_range(dk, dv, dvq, k, v, lo, f0, f1, hi, GROUP, hb, ptrs, strides, scal, q0, b,
                                  dd, dmask, j, sq, sk, D, SQS, SKS, BLOCK_M, BLOCK_D, DOT_PREC, UPCAST, True,
                                  EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ, ddv, dvmask, DV,
                                  EVEN_DV, CHUNK, TMA_DQ, QV)
    else:
        dk, dv, dvq = _dkdv_range(dk, dv, dvq, k, v, lo, f0, 0, 0, GROUP, hb, ptrs, strides, scal, q0, b,
                                  dd, dmask, j, sq, sk, D, SQS, SKS, BLOCK_M, BLOCK_D, DOT_PREC, UPCAST, True,
                                  EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ, ddv, dvmask, DV,
                                  EVEN_DV, CHUNK, TMA_DQ, QV)
        dk, dv, dvq = _dkdv_range(dk, dv, dvq, k, v, f1, hi, 0, 0, GROUP, hb, ptrs, strides, scal, q0, b,
                                  dd, dmask, j, sq, sk, D, SQS, SKS, BLOCK_M, BLOCK_D, DOT_PREC, UPCAST, True,
                                  EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ, ddv, dvmask, DV,
                                  EVEN_DV, CHUNK, TMA_DQ, QV)
    dk = dk * (qk_scale * LN2)
    if QV:
        dv = dv + dvq * (qk_scale * LN2)
    tl.store(dk_ptr + b64 * sdkb + kh.to(tl.int64) * sdkh + j64 * sdks + dd[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=kvmask)
    tl.store(dv_ptr + b64 * sdvb + kh.to(tl.int64) * sdvh + j64 * sdvs + ddv[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=vmask)


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_base, v_base, sks, svs, dd, dmask, i, n0, sq, sk, qk_scale, softcap, slope2,
              left, right, p_drop, rng_ptr, bh, SQS, SKS,
              BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, MASK: tl.constexpr,
              EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ddv, dvmask, DV: tl.constexpr,
              EVEN_DV: tl.constexpr, CHUNK: tl.constexpr):
    j = n0 + tl.arange(0, BLOCK_N)
    j64 = j.to(tl.int64)[:, None]
    if DV > 0:
        k = _load_rows(k_base, k_base, sks, n0, j64, dd, dmask, sk, MASK, EVEN_D, False)
        v = _load_rows(v_base, v_base, svs, n0, j64, ddv, dvmask, sk, MASK, EVEN_DV, False)
    elif MASK:
        kvmask = (j[:, None] < sk) & dmask[None, :]
        k = tl.load(k_base + j64 * sks + dd[None, :], mask=kvmask, other=0.0)
        v = tl.load(v_base + j64 * svs + dd[None, :], mask=kvmask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_base + j64 * sks + dd[None, :])
        v = tl.load(v_base + j64 * svs + dd[None, :])
    else:
        k = tl.load(k_base + j64 * sks + dd[None, :], mask=dmask[None, :], other=0.0)
        v = tl.load(v_base + j64 * svs + dd[None, :], mask=dmask[None, :], other=0.0)
    qk = _dot(q, tl.trans(k), DOT_PREC, UPCAST)
    s, t = _scores2(qk, i[:, None], j[None, :], sq, sk, qk_scale, softcap, slope2, left, right, MASK, SOFTCAP,
                    ALIBI, HAS_LEFT, HAS_RIGHT, CHUNK)
    p = tl.math.exp2(s - lse2[:, None])
    if MASK:
        p = tl.where(s == float("-inf"), 0.0, p)
    dp = _dot(do, tl.trans(v), DOT_PREC, UPCAST)
    if DROPOUT:
        keep = _keep(rng_ptr, p_drop, bh, i[:, None], j[None, :], SQS, SKS)
        dp = tl.where(keep, dp, 0.0) * (1.0 / (1.0 - p_drop))
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return _dot_acc(ds.to(k.dtype), k, dq, DOT_PREC, UPCAST)


@triton.jit
def _dkdv_block_qv(dk, dv, dvq, k, v, q_base, qv_base, do_base, lse_base, delta_base, sqs, sds, dd, dmask, j, m0, sq,
                   sk, qk_scale, softcap, slope2, left, right,
                   BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, MASK: tl.constexpr,
                   EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, ddv, dvmask, EVEN_DV: tl.constexpr, CHUNK: tl.constexpr):
    """``_dkdv_block`` with FA3's ``qv`` (no dropout, no atomic dQ: FA3 has neither): scores ``k q^T + v qv^T``;
    ``dvq += dS^T qv`` (scaled by the softmax scale at the end, like dK)."""
    i = m0 + tl.arange(0, BLOCK_M)
    i64 = i.to(tl.int64)[:, None]
    q = _load_rows(q_base, q_base, sqs, 0, i64, dd, dmask, sq, MASK, EVEN_D, False)
    qv = _load_rows(qv_base, qv_base, sds, 0, i64, ddv, dvmask, sq, MASK, EVEN_DV, False)
    do = _load_rows(do_base, do_base, sds, 0, i64, ddv, dvmask, sq, MASK, EVEN_DV, False)
    if MASK:
        lse = tl.load(lse_base + i, mask=i < sq, other=float("inf"))
        delta = tl.load(delta_base + i, mask=i < sq, other=0.0)
    else:
        lse = tl.load(lse_base + i)
        delta = tl.load(delta_base + i)
    kq = _dot_acc(v, tl.trans(qv), _dot(k, tl.trans(q), DOT_PREC, UPCAST), DOT_PREC, UPCAST)
    s, t = _scores2(kq, i[None, :], j[:, None], sq, sk, qk_scale, softcap, slope2, left, right, MASK, SOFTCAP,
                    ALIBI, HAS_LEFT, HAS_RIGHT, CHUNK)
    p = tl.math.exp2(s - lse[None, :] * LOG2E)
    if MASK:
        p = tl.where(s == float("-inf"), 0.0, p)
    dp = _dot(v, tl.trans(do), DOT_PREC, UPCAST)
    ds = p * (dp - delta[None, :])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dv = _dot_acc(p.to(do.dtype), do, dv, DOT_PREC, UPCAST)
    dsc = ds.to(q.dtype)
    dk = _dot_acc(dsc, q, dk, DOT_PREC, UPCAST)
    dvq = _dot_acc(dsc, qv, dvq, DOT_PREC, UPCAST)
    return dk, dv, dvq


@triton.jit
def _dq_block_qv(dq, dqv, q, qv, do, lse2, delta, k_base, v_base, sks, svs, dd, dmask, i, n0, sq, sk, qk_scale, softcap,
                 slope2, left, right,
                 BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, MASK: tl.constexpr,
                 EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, ddv, dvmask, EVEN_DV: tl.constexpr, CHUNK: tl.constexpr):
    """``_dq_block`` with FA3's ``qv``: scores ``q k^T + qv v^T``; ``dq += dS k``, ``dqv += dS v``."""
    j = n0 + tl.arange(0, BLOCK_N)
    j64 = j.to(tl.int64)[:, None]
    k = _load_rows(k_base, k_base, sks, n0, j64, dd, dmask, sk, MASK, EVEN_D, False)
    v = _load_rows(v_base, v_base, svs, n0, j64, ddv, dvmask, sk, MASK, EVEN_DV, False)
    qk = _dot_acc(qv, tl.trans(v), _dot(q, tl.trans(k), DOT_PREC, UPCAST), DOT_PREC, UPCAST)
    s, t = _scores2(qk, i[:, None], j[None, :], sq, sk, qk_scale, softcap, slope2, left, right, MASK, SOFTCAP,
                    ALIBI, HAS_LEFT, HAS_RIGHT, CHUNK)
    p = tl.math.exp2(s - lse2[:, None])
    if MASK:
        p = tl.where(s == float("-inf"), 0.0, p)
    dp = _dot(do, tl.trans(v), DOT_PREC, UPCAST)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dsc = ds.to(k.dtype)
    return _dot_acc(dsc, k, dq, DOT_PREC, UPCAST), _dot_acc(dsc, v, dqv, DOT_PREC, UPCAST)


@_jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, alibi_ptr, rng_ptr, cu_q_ptr, cu_k_ptr, qv_ptr, dqv_ptr,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdqb, sdqs, sdqh, slb, slh,
    stride_ab,
    H, GROUP, SQ, SK, SQS, SKS, TQ, TK, D, NUM_M,
    qk_scale, softcap, p_drop, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, HEAVY_FIRST: tl.constexpr,
    SU: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, CHUNK: tl.constexpr,
    QV: tl.constexpr,
):
    """dQ of one query block of one head (each program owns its rows: deterministic). ``DV`` / ``CHUNK``
    as in the forward; ``QV``: also ``dqv = scale * dS V`` (``qv``/``dqv`` with ``do``'s strides)."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    p_drop = tl.cast(p_drop, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    sqb, sqs, sqh = _su(sqb, SU), _su(sqs, SU), _su(sqh, SU)
    skb, sks, skh = _su(skb, SU), _su(sks, SU), _su(skh, SU)
    svb, svs, svh = _su(svb, SU), _su(svs, SU), _su(svh, SU)
    sdb, sds, sdh = _su(sdb, SU), _su(sds, SU), _su(sdh, SU)
    sdqb, sdqs, sdqh = _su(sdqb, SU), _su(sdqs, SU), _su(sdqh, SU)
    pid_m, bh = _query_tile(NUM_M, HEAVY_FIRST)
    b = bh // H
    h = bh % H
    kh = h // GROUP
    q0, sq = _sequence(cu_q_ptr, b, SQ, TQ, SQ, VARLEN)
    k0, sk = _sequence(cu_k_ptr, b, SK, TK, SK, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    i = m0 + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    b64 = b.to(tl.int64)
    i64 = (q0 + i.to(tl.int64))[:, None]
    qmask = (i[:, None] < sq) & dmask[None, :]
    q = tl.load(q_ptr + b64 * sqb + h.to(tl.int64) * sqh + i64 * sqs + dd[None, :], mask=qmask, other=0.0)
    if DV > 0:
        ddv = tl.arange(0, BLOCK_DV)
        dvmask = ddv < DV
        do = tl.load(do_ptr + b64 * sdb + h.to(tl.int64) * sdh + i64 * sds + ddv[None, :],
                     mask=(i[:, None] < sq) & dvmask[None, :], other=0.0)
    else:
        ddv = dd
        dvmask = dmask
        do = tl.load(do_ptr + b64 * sdb + h.to(tl.int64) * sdh + i64 * sds + dd[None, :], mask=qmask, other=0.0)
    row = b64 * slb + h.to(tl.int64) * slh + q0 + i
    lse2 = tl.load(lse_ptr + row, mask=i < sq, other=float("inf")) * LOG2E
    delta = tl.load(delta_ptr + row, mask=i < sq, other=0.0)
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(alibi_ptr + b * stride_ab + h).to(tl.float32) * LOG2E
    k_base = k_ptr + b64 * skb + kh.to(tl.int64) * skh + k0 * sks
    v_base = v_ptr + b64 * svb + kh.to(tl.int64) * svh + k0 * svs
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if QV:
        qv_off = b64 * sdb + h.to(tl.int64) * sdh + i64 * sds + ddv[None, :]
        qv_mask = (i[:, None] < sq) & dvmask[None, :]
        qv = tl.load(qv_ptr + qv_off, mask=qv_mask, other=0.0)
        dqv = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, f0, f1, hi = _bounds(m0, sq, sk, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, CHUNK)
    for n0 in range(lo, f0, BLOCK_N):
        if QV:
            dq, dqv = _dq_block_qv(dq, dqv, q, qv, do, lse2, delta, k_base, v_base, sks, svs, dd, dmask, i, n0, sq, sk,
                                   qk_scale, softcap, slope2, left, right, BLOCK_N, DOT_PREC, UPCAST, True, EVEN_D,
                                   SOFTCAP, ALIBI, HAS_LEFT, HAS_RIGHT, ddv, dvmask, EVEN_DV, CHUNK)
        else:
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, sks, svs, dd, dmask, i, n0, sq, sk, qk_scale,
                           softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS, BLOCK_N, DOT_PREC, UPCAST, True,
                           EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, ddv, dvmask, DV, EVEN_DV, CHUNK)
    for n0 in range(f0, f1, BLOCK_N):
        if QV:
            dq, dqv = _dq_block_qv(dq, dqv, q, qv, do, lse2, delta, k_base, v_base, sks, svs, dd, dmask, i, n0, sq, sk,
                                   qk_scale, softcap, slope2, left, right, BLOCK_N, DOT_PREC, UPCAST, False, EVEN_D,
                                   SOFTCAP, ALIBI, HAS_LEFT, HAS_RIGHT, ddv, dvmask, EVEN_DV, CHUNK)
        else:
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, sks, svs, dd, dmask, i, n0, sq, sk, qk_scale,
                           softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS, BLOCK_N, DOT_PREC, UPCAST,
                           False, EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, ddv, dvmask, DV, EVEN_DV, CHUNK)
    for n0 in range(f1, hi, BLOCK_N):
        if QV:
            dq, dqv = _dq_block_qv(dq, dqv, q, qv, do, lse2, delta, k_base, v_base, sks, svs, dd, dmask, i, n0, sq, sk,
                                   qk_scale, softcap, slope2, left, right, BLOCK_N, DOT_PREC, UPCAST, True, EVEN_D,
                                   SOFTCAP, ALIBI, HAS_LEFT, HAS_RIGHT, ddv, dvmask, EVEN_DV, CHUNK)
        else:
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, sks, svs, dd, dmask, i, n0, sq, sk, qk_scale,
                           softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS, BLOCK_N, DOT_PREC, UPCAST, True,
                           EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, ddv, dvmask, DV, EVEN_DV, CHUNK)
    dq = dq * (qk_scale * LN2)
    tl.store(dq_ptr + b64 * sdqb + h.to(tl.int64) * sdqh + i64 * sdqs + dd[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=qmask)
    if QV:
        tl.store(dqv_ptr + qv_off, (dqv * (qk_scale * LN2)).to(dqv_ptr.dtype.element_ty), mask=qv_mask)
