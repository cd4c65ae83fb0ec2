"""Triton kernel of the rotary position embedding (forward and backward are one kernel).

A program rotates a ``[BLOCK_S, BLOCK_H]`` tile of (token, head) rows. Within the rotary columns the
row is a list of pairs ``(lo, hi)``:

* GPT-NeoX style (halves): ``lo = col0 + k``, ``hi = col0 + half + k``;
* GPT-J style (interleaved): ``lo = col0 + 2k``, ``hi = col0 + 2k + 1``.

The cos/sin tables hold one row per position. A *half* table has ``half`` columns, one angle per
pair (flash_attn); a *full* table has ``2 * half`` columns, one per rotated element (Apex's
``freqs`` / cached ``cos_``/``sin_``, which may differ between the two members of a pair). The
forward is ``y_lo = x_lo c_lo - x_hi s_lo``, ``y_hi = x_hi c_hi + x_lo s_hi``; ``CONJUGATE`` applies
the transpose of that matrix, which is the backward (for a half table: rotation by ``-theta``).

Positions: ``s + offset`` (``offset`` an int or one per batch), counted from each sequence start in
the packed variable-length form (``cu_seqlens``); positions outside the table leave the pair
unrotated. ``TWO_D`` (Apex's 2-D RoPE for images) rotates columns ``[0, D/2)`` at row position
``s // img_w`` with ``COS``/``SIN`` and ``[D/2, D)`` at column position ``s % img_w`` with
``COS2``/``SIN2``. ``HEAD_GROUPS``: the heads form two groups (Q and K of a packed qkv), the second
``stride_xg`` elements after the first, with ``nheads`` and ``nheads2`` heads; with ``SPLIT_TABLES``
the second group is rotated with ``COS2``/``SIN2`` (XPos keys). ``COPY_REST`` copies the columns
after the rotary ones (partial rotary, out of place). Arithmetic is fp32 (flash_attn's numerics);
with ``ROUND`` it is that of Apex's fused RoPE for 16-bit ``x``: the table values are rounded to x's
dtype, and so is each product and the sum (what Apex's CUDA kernel and its unfused PyTorch formula
``t * cos.to(t.dtype) + rotate_half(t) * sin.to(t.dtype)`` compute). Offsets are int64.

Sizes that change from batch to batch (sequence length, table rows, the position offset) are not
specialized on, so a new size never compiles a new kernel.
"""

import triton
import triton.language as tl


@triton.jit
def _load_table(T, row, ok, idx, idx_ok, other):
    """fp32 table values at ``row * stride + idx`` (``row`` already scaled), ``other`` where not ``ok``."""
    return tl.load(T + row + idx, mask=ok & idx_ok, other=other).to(tl.float32)


@triton.jit
def _round_to(v, DT: tl.constexpr):
    """fp32 ``v`` rounded to the nearest ``DT`` value (ties to even), returned as fp32. bf16 is rounded on
    the bits: Triton's CPU interpreter truncates fp32 -> bf16 casts, so a cast would not give the GPU's
    (and PyTorch's) rounding there; the bit form is exact on both."""
    if DT == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = b + (0x7FFF + ((b >> 16) & 1))
        r = ((b >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where(v != v, v, r)  # NaN stays NaN (the carry could turn it into inf or -0)
    elif DT == tl.float16:
        # On the bits too, for another reason: a float cast pair lets the GPU compiler narrow the rounded
        # fp32 products and sums to fp16 arithmetic and then fuse a product and a sum into one FMA (one
        # rounding instead of two), which Apex's arithmetic does not do. Normal range: keep 11 significant
        # bits, ties to even; below 2^-14 fp16 is a multiple of 2^-24 (adding 0.75, whose fp32 ulp is 2^-24,
        # rounds to that); from 65520 on it rounds to inf.
        b = v.to(tl.uint32, bitcast=True)
        b = b + (0xFFF + ((b >> 13) & 1))
        r = ((b >> 13) << 13).to(tl.float32, bitcast=True)
        a = tl.abs(v)
        tiny = (v + 0.75) - 0.75
        r = tl.where(a < 6.103515625e-05, tl.where(tiny == 0.0, v * 0.0, tiny), r)  # (v * 0: the sign of 0)
        r = tl.where(a >= 65520.0, tl.where(v > 0, float("inf"), float("-inf")), r)
        return tl.where(v != v, v, r)
    else:
        return v.to(DT).to(tl.float32)


@triton.jit
def _rotate_region(X, OUT, COS, SIN, x_off, o_off, pos, row_ok, col0, half, seqlen_ro, stride_xd, stride_od,
                   stride_t, INTERLEAVED: tl.constexpr, FULL_TABLE: tl.constexpr, CONJUGATE: tl.constexpr,
                   ROUND: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rotate the ``2 * half`` columns from ``col0`` of every row of the tile.

    ``x_off``/``o_off``: ``[BLOCK_S, BLOCK_H, 1]`` int64 offsets of the rows; ``pos``: ``[BLOCK_S, 1, 1]``
    table rows; ``row_ok``: ``[BLOCK_S, BLOCK_H, 1]``.
    """
    k = tl.arange(0, BLOCK_K)[None, None, :]
    k_ok = k < half
    # Out-of-table positions read cos = 1, sin = 0: the pair passes through unrotated.
    tab_ok = (pos >= 0) & (pos < seqlen_ro)
    t_row = pos.to(tl.int64) * stride_t
    if INTERLEAVED:
        # One contiguous (vectorizable) load of the 2*BLOCK_K columns, split into the even and odd
        # members, instead of two stride-2 loads.
        c = tl.arange(0, 2 * BLOCK_K)[None, None, :]
        m = row_ok & (c < 2 * half)
        x = tl.load(X + x_off + (col0 + c) * stride_xd, mask=m, other=0.0).to(tl.float32)
        x_lo, x_hi = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_H, BLOCK_K, 2)))
        if FULL_TABLE:
            cc = _load_table(COS, t_row, tab_ok, c, c < 2 * half, 1.0)
            ss = _load_table(SIN, t_row, tab_ok, c, c < 2 * half, 0.0)
            c_lo, c_hi = tl.split(tl.reshape(cc, (BLOCK_S, 1, BLOCK_K, 2)))
            s_lo, s_hi = tl.split(tl.reshape(ss, (BLOCK_S, 1, BLOCK_K, 2)))
        else:
            c_lo = _load_table(COS, t_row, tab_ok, k, k_ok, 1.0)
            s_lo = _load_table(SIN, t_row, tab_ok, k, k_ok, 0.0)
            c_hi = c_lo
            s_hi = s_lo
    else:
        m = row_ok & k_ok
        x_lo = tl.load(X + x_off + (col0 + k) * stride_xd, mask=m, other=0.0).to(tl.float32)
        x_hi = tl.load(X + x_off + (col0 + half + k) * stride_xd, mask=m, other=0.0).to(tl.float32)
        c_lo = _load_table(COS, t_row, tab_ok, k, k_ok, 1.0)
        s_lo = _load_table(SIN, t_row, tab_ok, k, k_ok, 0.0)
        if FULL_TABLE:
            c_hi = _load_table(COS, t_row, tab_ok, half + k, k_ok, 1.0)
            s_hi = _load_table(SIN, t_row, tab_ok, half + k, k_ok, 0.0)
        else:
            c_hi = c_lo
            s_hi = s_lo
    if ROUND:
        # Apex's numerics: tables in x's dtype, every product and sum rounded to it. A product of two
        # 16-bit values is exact in fp32, so rounding the fp32 product is the 16-bit multiply; the sum
        # is rounded from fp32 as PyTorch's and Apex's 16-bit adds are.
        dt: tl.constexpr = X.dtype.element_ty
        c_lo = _round_to(c_lo, dt)
        c_hi = _round_to(c_hi, dt)
        s_lo = _round_to(s_lo, dt)
        s_hi = _round_to(s_hi, dt)
        p_lo = _round_to(x_lo * c_lo, dt)
        p_hi = _round_to(x_hi * c_hi, dt)
        if CONJUGATE:
            y_lo = _round_to(p_lo + _round_to(x_hi * s_hi, dt), dt)
            y_hi = _round_to(p_hi - _round_to(x_lo * s_lo, dt), dt)
        else:
            y_lo = _round_to(p_lo - _round_to(x_hi * s_lo, dt), dt)
            y_hi = _round_to(p_hi + _round_to(x_lo * s_hi, dt), dt)
    elif CONJUGATE:
        y_lo = x_lo * c_lo + x_hi * s_hi
        y_hi = x_hi * c_hi - x_lo * s_lo
    else:
        y_lo = x_lo * c_lo - x_hi * s_lo
        y_hi = x_hi * c_hi + x_lo * s_hi
    if INTERLEAVED:
        y = tl.reshape(tl.join(y_lo, y_hi), (BLOCK_S, BLOCK_H, 2 * BLOCK_K))
        tl.store(OUT + o_off + (col0 + c) * stride_od, y.to(OUT.dtype.element_ty), mask=m)
    else:
        tl.store(OUT + o_off + (col0 + k) * stride_od, y_lo.to(OUT.dtype.element_ty), mask=m)
        tl.store(OUT + o_off + (col0 + half + k) * stride_od, y_hi.to(OUT.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["seqlen", "seqlen_ro", "seqlen_ro2", "n_sblocks", "offset"])
def _rotary_kernel(
    X, OUT, COS, SIN, COS2, SIN2, OFFSETS, CU_SEQLENS,
    seqlen, total_rows, nheads, nheads2, headdim, half, seqlen_ro, seqlen_ro2, img_w, n_sblocks, n_hblocks, n_hblocks2,
    stride_xb, stride_xs, stride_xg, stride_xh, stride_xd,
    stride_ob, stride_os, stride_og, stride_oh, stride_od,
    stride_t, stride_t2, offset,
    INTERLEAVED: tl.constexpr, FULL_TABLE: tl.constexpr, CONJUGATE: tl.constexpr, ROUND: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, TWO_D: tl.constexpr, HEAD_GROUPS: tl.constexpr, SPLIT_TABLES: tl.constexpr,
    COPY_REST: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One program: ``BLOCK_S`` positions x ``BLOCK_H`` heads (of one head group) of one sequence.

    The grid is flat (axis 0 allows 2^31 programs, axes 1-2 only 65535): program ``pid`` is head
    block ``pid % (n_hblocks + n_hblocks2)`` (the first ``n_hblocks`` cover group 0) of sequence
    block ``(pid // ...) % n_sblocks`` of batch ``pid // (... * n_sblocks)``.
    """
    pid = tl.program_id(0)
    n_hb = n_hblocks
    if HEAD_GROUPS:
        n_hb = n_hblocks + n_hblocks2
    hb = pid % n_hb
    rest = pid // n_hb
    sb = rest % n_sblocks
    b = rest // n_sblocks
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    start = 0
    if IS_VARLEN:
        # cu_seqlens are values, not extents: rows past the packed tensor's total_rows are never touched
        start = tl.load(CU_SEQLENS + b).to(tl.int64)
        seq_len = tl.minimum(tl.load(CU_SEQLENS + b + 1).to(tl.int64), total_rows) - start
        if sb * BLOCK_S >= seq_len:
            return
        x_row = (start + s) * stride_xs
        o_row = (start + s) * stride_os
    else:
        seq_len = seqlen
        x_row = b.to(tl.int64) * stride_xb + s.to(tl.int64) * stride_xs
        o_row = b.to(tl.int64) * stride_ob + s.to(tl.int64) * stride_os
    nh = nheads
    group = 0
    if HEAD_GROUPS:
        group = (hb >= n_hblocks).to(tl.int32)
        hb -= group * n_hblocks
        nh = tl.where(group == 1, nheads2, nheads)
        x_row += group.to(tl.int64) * stride_xg
        o_row += group.to(tl.int64) * stride_og
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    x_off = x_row[:, None, None] + (h.to(tl.int64) * stride_xh)[None, :, None]
    o_off = o_row[:, None, None] + (h.to(tl.int64) * stride_oh)[None, :, None]
    row_ok = ((s < seq_len) & (start + s >= 0))[:, None, None] & (h < nh)[None, :, None]
    if TWO_D:
        s3 = s[:, None, None]
        _rotate_region(X, OUT, COS, SIN, x_off, o_off, s3 // img_w, row_ok, 0, half, seqlen_ro,
                       stride_xd, stride_od, stride_t, INTERLEAVED, FULL_TABLE, CONJUGATE, ROUND, BLOCK_S, BLOCK_H,
                       BLOCK_K)
        _rotate_region(X, OUT, COS2, SIN2, x_off, o_off, s3 % img_w, row_ok, 2 * half, half, seqlen_ro2,
                       stride_xd, stride_od, stride_t2, INTERLEAVED, FULL_TABLE, CONJUGATE, ROUND, BLOCK_S, BLOCK_H,
                       BLOCK_K)
    else:
        if HAS_OFFSETS:
            pos = s.to(tl.int64) + tl.load(OFFSETS + b).to(tl.int64)
        else:
            pos = s.to(tl.int64) + offset
        pos3 = pos[:, None, None]
        if SPLIT_TABLES:
            # A scalar branch per program (a program's heads all belong to one group).
            if group == 1:
                _rotate_region(X, OUT, COS2, SIN2, x_off, o_off, pos3, row_ok, 0, half, seqlen_ro2, stride_xd,
                               stride_od, stride_t2, INTERLEAVED, FULL_TABLE, CONJUGATE, ROUND, BLOCK_S, BLOCK_H,
                               BLOCK_K)
            else:
                _rotate_region(X, OUT, COS, SIN, x_off, o_off, pos3, row_ok, 0, half, seqlen_ro, stride_xd,
                               stride_od, stride_t, INTERLEAVED, FULL_TABLE, CONJUGATE, ROUND, BLOCK_S, BLOCK_H,
                               BLOCK_K)
        else:
            _rotate_region(X, OUT, COS, SIN, x_off, o_off, pos3, row_ok, 0, half, seqlen_ro, stride_xd, stride_od,
                           stride_t, INTERLEAVED, FULL_TABLE, CONJUGATE, ROUND, BLOCK_S, BLOCK_H, BLOCK_K)
        if COPY_REST:
            # Partial rotary out of place: the columns after the rotary ones pass through unchanged.
            p = tl.arange(0, BLOCK_P)[None, None, :]
            c = 2 * half + p
            m = row_ok & (c < headdim)
            v = tl.load(X + x_off + c * stride_xd, mask=m)
            tl.store(OUT + o_off + c * stride_od, v, mask=m)
