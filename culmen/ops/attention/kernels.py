"""Triton FlashAttention kernels, dense BSHD and varlen (packed THD): the forward, the KV-cache append and
the ``@triton.jit`` helpers the backward kernels (``kernels_bwd.py``) share with the forward.

Conventions (the same as ``reference.py`` and ``dropout.py``):

* scores ``s = softmax_scale * q . k``; softcap ``s = softcap * tanh(s / softcap)``; ALiBi
  ``s -= slope * |i + sk - sq - j|``; then the bottom-right aligned window
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (``HAS_LEFT`` / ``HAS_RIGHT`` off = unbounded);
* ``lse`` in fp32, natural log, ``+inf`` on rows that see no key (their output and gradients are 0);
* dropout keeps ``(i, j)`` iff ``tl.rand(seed, off + ((b * H + h) * SQS + i) * SKS + j) >= p`` with
  ``SQS, SKS = sq, sk`` (dense) or ``max_seqlen_q, max_seqlen_k`` (varlen); kept probabilities are
  scaled by ``1 / (1 - p)``; ``(seed, off)`` are read from the int64 ``rng`` tensor;
* GQA: query head ``h`` reads KV head ``h // GROUP``; the dK/dV kernel loops over the ``GROUP``
  query heads of its KV head, so dK/dV are accumulated per KV head without expanded buffers;
* varlen (``VARLEN``): sequence ``b`` is rows ``cu[b] .. cu[b + 1]`` of the packed tensors; the
  batch strides are 0 and ``lse``/``delta`` are ``(H, total_q)`` (``slb = 0``, ``slh = total_q``);
* all element offsets are int64; the head dim is padded to ``BLOCK_D`` (a power of 2) with masks,
  which vanish when ``EVEN_D`` (``D == BLOCK_D``).

Compilation: a kernel specializes on what changes its code (dtypes, head dim, feature flags, block
config), never on sizes that change per batch. Sequence lengths, totals, grid extents, window sizes
and every batch/row/head stride are in ``do_not_specialize`` (a new sequence length or batch size
never recompiles). Strides are passed divided by ``SU``, the largest power of two <= 16 dividing all
of them (fixed by the head layout, e.g. 16 for ``nheads * headdim % 16 == 0``): multiplied back by
the constexpr ``SU`` they still tell the compiler that rows are 16-element aligned (vector loads),
which Triton would otherwise learn only from specializing each stride's value.

Speed: the softmax runs in base 2 (``exp2``) with ``softmax_scale * log2(e)`` folded into one
multiply. The key (or query) blocks a program visits are split into blocks that every row sees in
full, which run with no mask arithmetic and unmasked loads, and the few boundary blocks of the
causal diagonal, the window edges and the sequence end, which run masked (``_bounds``). Causal
programs are scheduled heaviest first (``HEAVY_FIRST``) so the last wave is not a long tail.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E_F = 1.4426950408889634
"""log2(e) as a Python float (launchers fold it into the softmax scale)."""
LOG2E = tl.constexpr(LOG2E_F)
LN2 = tl.constexpr(0.6931471805599453)

# Integer arguments that change with the batch's sizes (see "Compilation" above).
_STRIDES = ("sqb", "sqs", "sqh", "skb", "sks", "skh", "svb", "svs", "svh", "sob", "sos", "soh", "sdb", "sds", "sdh",
            "sdkb", "sdks", "sdkh", "sdvb", "sdvs", "sdvh", "sdqb", "sdqs", "sdqh", "slb", "slh", "sfb", "sfs", "sfh")
_SIZES = ("SQ", "SK", "SQS", "SKS", "TQ", "TK", "NUM_M", "NUM_N", "K_ADD", "left", "right")


def _dns(fn) -> list[str]:
    """The ``do_not_specialize`` names among ``fn``'s parameters."""
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return [n for n in names if n in _STRIDES or n in _SIZES]


def _jit(fn):
    return triton.jit(do_not_specialize=_dns(fn))(fn)


@triton.jit
def _su(stride, SU: tl.constexpr):
    """A stride passed divided by ``SU``, back in elements (int64, known to be a multiple of ``SU``)."""
    return tl.cast(stride, tl.int64) * SU


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``UPCAST`` (CPU interpreter only, for bf16 (1), whose dot it gets
    wrong, and fp8 (2)) multiplies the exactly upcast fp32 operands instead."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _dot_acc(a, b, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``, accumulated by the tensor cores in place (no separate add over the tile)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _tanh(x):
    # Overflow-free tanh: sign(x) * (1 - e^{-2|x|}) / (1 + e^{-2|x|}).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _sequence(cu_ptr, b, n_dense, total, n_max, VARLEN: tl.constexpr):
    """``(first row, length)`` of sequence ``b``: rows ``cu[b] .. cu[b + 1]`` of the packed tensors
    (varlen), or ``(0, n_dense)``. Whatever ``cu`` holds, the rows stay inside ``[0, total)`` and the
    length inside ``[0, n_max]`` (``max_seqlen``: the rows the grid covers), so bad offsets can give
    wrong results but never an access outside the tensors."""
    if VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu_ptr + b).to(tl.int64), 0), total)
        end = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1).to(tl.int64), start), total)
        n = tl.minimum(end - start, n_max).to(tl.int32)
    else:
        start = tl.zeros([], dtype=tl.int64)
        n = n_dense
    return start, n


@triton.jit
def _query_tile(NUM_M, HEAVY_FIRST: tl.constexpr):
    """``(query block, batch * head)`` of this program of a 1-D grid of ``NUM_M * B * H`` programs.
    ``HEAVY_FIRST``: the last query blocks see the most keys under a causal mask, so they start first."""
    pid = tl.program_id(0)
    if HEAVY_FIRST:
        nbh = tl.num_programs(0) // NUM_M
        return NUM_M - 1 - pid // nbh, pid % nbh
    return pid % NUM_M, pid // NUM_M


@triton.jit
def _chunk_start(pos, sq, CHUNK: tl.constexpr):
    """First key position of the chunk holding key position ``pos >= -sq`` (floor division, computed on
    non-negative numbers so that C-style and floor division agree)."""
    off = tl.cdiv(sq, CHUNK) * CHUNK
    return ((pos + off) // CHUNK) * CHUNK - off


@triton.jit
def _bounds(m0, sq, sk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, CHUNK: tl.constexpr = 0):
    """Key columns rows ``m0 .. m0 + BLOCK_M`` visit: ``[lo, f0)`` masked, ``[f0, f1)`` full (every
    row ``< sq`` sees every column, all columns ``< sk``), ``[f1, hi)`` masked. ``lo``, ``f0``, ``f1``
    are multiples of ``BLOCK_N`` unless equal to ``hi``; empty when ``m0 >= sq``."""
    diag = sk - sq
    last = tl.minimum(m0 + BLOCK_M, sq) - 1
    hi = sk
    full_hi = (sk // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(last + diag + right + 1, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + diag + right + 1, 0) // BLOCK_N) * BLOCK_N)
    lo = 0
    full_lo = 0
    if HAS_LEFT:
        lo = (tl.maximum(m0 + diag - left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last + diag - left, 0), BLOCK_N) * BLOCK_N
    if CHUNK > 0:  # keys of the chunks of the first and the last row: [start(first), end(last))
        c_first = _chunk_start(m0 + diag, sq, CHUNK)
        c_last = _chunk_start(last + diag, sq, CHUNK)
        hi = tl.minimum(hi, tl.maximum(c_last + CHUNK, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(c_first + CHUNK, 0) // BLOCK_N) * BLOCK_N)
        lo = tl.maximum(lo, (tl.maximum(c_first, 0) // BLOCK_N) * BLOCK_N)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(c_last, 0), BLOCK_N) * BLOCK_N)
    hi = tl.where(m0 < sq, hi, 0)
    lo = tl.minimum(lo, hi)
    f0 = tl.minimum(tl.maximum(full_lo, lo), hi)
    f1 = tl.maximum(tl.minimum(full_hi, hi), f0)
    return lo, f0, f1, hi


@triton.jit
def _bounds_t(n0, sq, sk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, CHUNK: tl.constexpr = 0):
    """The transpose of ``_bounds``: query rows that see key columns ``n0 .. n0 + BLOCK_N``, split the
    same way (full blocks: every column of the block, all ``< sk``, is seen by every row, all ``< sq``)."""
    diag = sk - sq
    last = tl.minimum(n0 + BLOCK_N, sk) - 1
    hi = sq
    full_hi = (sq // BLOCK_M) * BLOCK_M
    lo = 0
    full_lo = 0
    if HAS_RIGHT:  # row i sees column j only if i >= j - diag - right
        lo = (tl.maximum(n0 - diag - right, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(last - diag - right, 0), BLOCK_M) * BLOCK_M
    if HAS_LEFT:  # ... and only if i <= j - diag + left
        hi = tl.minimum(hi, tl.maximum(last - diag + left + 1, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(n0 - diag + left + 1, 0) // BLOCK_M) * BLOCK_M)
    if CHUNK > 0:  # row i sees column j only if i + diag is in j's chunk
        c0 = (n0 // CHUNK) * CHUNK
        c1 = (last // CHUNK) * CHUNK
        lo = tl.maximum(lo, (tl.maximum(c0 - diag, 0) // BLOCK_M) * BLOCK_M)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(c1 - diag, 0), BLOCK_M) * BLOCK_M)
        hi = tl.minimum(hi, tl.maximum(c1 + CHUNK - diag, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(c0 + CHUNK - diag, 0) // BLOCK_M) * BLOCK_M)
    hi = tl.where(n0 < sk, hi, 0)
    full_hi = tl.where(n0 + BLOCK_N <= sk, full_hi, 0)  # a partial key block is masked throughout
    lo = tl.minimum(lo, hi)
    f0 = tl.minimum(tl.maximum(full_lo, lo), hi)
    f1 = tl.maximum(tl.minimum(full_hi, hi), f0)
    return lo, f0, f1, hi


@triton.jit
def _scores2(qk, i, j, sq, sk, qk_scale, softcap, slope2, left, right, MASK: tl.constexpr,
             SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             CHUNK: tl.constexpr = 0):
    """Scores in base-2 units (``s * log2 e``) from the raw ``q . k`` tile, masked -> -inf when
    ``MASK``; also the softcap ``tanh`` (else ``qk``). ``i`` / ``j`` are the tile's row / column
    indices broadcast to its shape (``[M, 1]`` and ``[1, N]``, or transposed)."""
    t = qk
    if SOFTCAP:
        t = _tanh(qk * (qk_scale * LN2 / softcap))
        s = t * (softcap * LOG2E)
    else:
        s = qk * qk_scale
    if ALIBI or MASK:
        rel = j - (i + sk - sq)  # column minus the row's diagonal
        if ALIBI:
            s = s - slope2 * tl.abs(rel).to(tl.float32)
        if MASK:
            vis = (j < sk) & (i < sq)
            if HAS_RIGHT:
                vis = vis & (rel <= right)
            if HAS_LEFT:
                vis = vis & (rel >= -left)
            if CHUNK > 0:  # chunked-local: the key lies in the chunk of the row's position i + sk - sq
                c0 = _chunk_start(i + sk - sq, sq, CHUNK)
                vis = vis & (j >= c0) & (j < c0 + CHUNK)
            s = tl.where(vis, s, float("-inf"))
    return s, t


@triton.jit
def _keep(rng_ptr, p_drop, bh, i, j, SQS, SKS):
    """Dropout keep mask of the tile with row indices ``i`` and column indices ``j`` (broadcast)."""
    seed = tl.load(rng_ptr)
    off = tl.load(rng_ptr + 1)
    counter = off + ((bh.to(tl.int64) * SQS + i.to(tl.int64)) * SKS + j.to(tl.int64))
    return tl.rand(seed, counter) >= p_drop


@triton.jit
def _load_rows(desc, base, stride, n0, j64, dd, dmask, n, MASK: tl.constexpr, EVEN_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Rows ``n0 ..`` of a ``(n, D)`` tile source: a tensor descriptor (TMA; out-of-range rows and
    columns read as 0) or pointers (masked only where the block may leave the tile)."""
    if USE_TMA:
        return desc.load([n0, 0])
    if MASK:
        return tl.load(base + j64 * stride + dd[None, :], mask=(j64 < n) & dmask[None, :], other=0.0)
    if EVEN_D:
        return tl.load(base + j64 * stride + dd[None, :])
    return tl.load(base + j64 * stride + dd[None, :], mask=dmask[None, :], other=0.0)


@triton.jit
def _load_rows_t(base, stride, j, dd, dmask, n, MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows ``j`` of a ``(n, D)`` tile source stored transposed (row ``r``, column ``c`` at ``base + r +
    c * stride``), as ``(len(j), D)``: FP8 V, whose second matmul operand Hopper's FP8 MMA wants with the key
    dim contiguous (the transposed load gives the same shared layout K's ``tl.trans`` gives the first)."""
    jr = j.to(tl.int64)[None, :]
    ptr = base + dd[:, None] * stride + jr
    if MASK:
        t = tl.load(ptr, mask=(jr < n) & dmask[:, None], other=0.0)
    elif EVEN_D:
        t = tl.load(ptr)
    else:
        t = tl.load(ptr, mask=dmask[:, None], other=0.0)
    return tl.trans(t)


@triton.jit
def _exp2(x, EXP16: tl.constexpr):
    """``2 ** x`` (``x <= 0``, the softmax numerators). ``EXP16`` (FP8 forwards on a GPU, whose P is rounded to
    fp8, 3 mantissa bits): in fp16, two per ``ex2.approx.f16x2`` (half the MUFU issue of fp32; the argument's
    fp16 rounding errs by at most 0.6% of p at ``x >= -16``, a tenth of fp8's step), returned as fp16."""
    if EXP16:
        y = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16,
                                      is_pure=True, pack=2)
    else:
        y = tl.math.exp2(x)
    return y


@triton.jit
def _load_paged(base, table_row, TK, k0, sb, ss, n0, j, dd, dmask, sk, PAGE: tl.constexpr, PAGE_BLOCK: tl.constexpr,
                MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows ``j = n0 + arange(BLOCK_N)`` (``< sk``) of a paged cache: position ``k0 + j`` lives in row ``pos % PAGE``
    of page ``table_row[pos // PAGE]`` (page stride ``sb``, row stride ``ss``). Page numbers are clamped into
    ``[0, TK)`` (``TK``: the cache's number of pages), so no table value reads outside the cache.

    ``PAGE_BLOCK`` (the launcher's promise that ``PAGE % BLOCK_N == 0`` and ``k0 == 0``; ``n0`` is a multiple of
    ``BLOCK_N``): the block's rows are consecutive rows of one page, found by one table load for the block instead
    of one per row, and read unmasked when ``MASK`` is off (a block every row of which is ``< sk``). Otherwise each
    row looks its page up (any page size, any ``k0``)."""
    if PAGE_BLOCK:
        pos0 = k0 + n0
        pg = tl.load(table_row + pos0 // PAGE).to(tl.int64)
        pg = tl.minimum(tl.maximum(pg, 0), TK - 1)
        rows = (j - n0).to(tl.int64)
        ptr = base + pg * sb + (pos0 % PAGE) * ss + rows[:, None] * ss + dd[None, :]
        if MASK:
            return tl.load(ptr, mask=(j < sk)[:, None] & dmask[None, :], other=0.0)
        if EVEN_D:
            return tl.load(ptr)
        return tl.load(ptr, mask=dmask[None, :], other=0.0)
    valid = j < sk
    pos = k0 + j.to(tl.int64)
    pg = tl.load(table_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    pg = tl.minimum(tl.maximum(pg, 0), TK - 1)
    off = pg * sb + (pos % PAGE) * ss
    return tl.load(base + off[:, None] + dd[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _qk_block(q, k_base, k_desc, sks, dd, dmask, n0, sk, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
              UPCAST: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, table_row, TK,
              k0, skb, PAGE: tl.constexpr, PAGE_BLOCK: tl.constexpr):
    """``q @ k.T`` of the key block at ``n0`` (fp32 ``(BLOCK_M, BLOCK_N)``, unscaled)."""
    j = n0 + tl.arange(0, BLOCK_N)
    if PAGE > 0:
        k = _load_paged(k_base, table_row, TK, k0, skb, sks, n0, j, dd, dmask, sk, PAGE, PAGE_BLOCK, MASK, EVEN_D)
    else:
        k = _load_rows(k_desc, k_base, sks, n0, j.to(tl.int64)[:, None], dd, dmask, sk, MASK, EVEN_D, USE_TMA)
    return _dot(q, tl.trans(k), DOT_PREC, UPCAST)


@triton.jit
def _pv_block(acc, l_i, m_i, qk, v_base, v_desc, svs, i, n0, sq, sk, qk_scale, softcap, slope2, left, right, p_drop,
              rng_ptr, bh, SQS, SKS, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
              MASK: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, USE_TMA: tl.constexpr, ddv, dvmask,
              EVEN_DV: tl.constexpr, CHUNK: tl.constexpr, table_row, TK, k0, svb, PAGE: tl.constexpr, V_T: tl.constexpr,
              EXP16: tl.constexpr, v_pre, HAS_V: tl.constexpr, PAGE_BLOCK: tl.constexpr):
    """The online-softmax update of ``(acc, l_i, m_i)`` by the scores ``qk`` of the key block at ``n0`` and its V
    rows (``v_pre`` when ``HAS_V``: already loaded for ``qv``)."""
    j = n0 + tl.arange(0, BLOCK_N)
    if MASK or SOFTCAP or ALIBI:
        s, _t = _scores2(qk, i[:, None], j[None, :], sq, sk, qk_scale, softcap, slope2, left, right, MASK, SOFTCAP,
                         ALIBI, HAS_LEFT, HAS_RIGHT, CHUNK)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASK:  # a row may still have seen nothing: keep its max finite so exp2 gives 0, not NaN
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = _exp2(s - m_new[:, None], EXP16)
    else:  # max(c * x) = c * max(x) for c > 0: the scale folds into one FMA per score
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = _exp2(qk * qk_scale - m_new[:, None], EXP16)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    if DROPOUT:
        p = tl.where(_keep(rng_ptr, p_drop, bh, i[:, None], j[None, :], SQS, SKS), p, 0.0)
    if HAS_V:
        v = v_pre
    elif PAGE > 0:
        v = _load_paged(v_base, table_row, TK, k0, svb, svs, n0, j, ddv, dvmask, sk, PAGE, PAGE_BLOCK, MASK, EVEN_DV)
    elif V_T and USE_TMA:
        # Triton 3.6 never pipelines the pointer load of FP8 V (3.9 does): TMA loads always are
        v = tl.trans(v_desc.load([0, n0]))
    elif V_T:
        v = _load_rows_t(v_base, svs, j, ddv, dvmask, sk, MASK, EVEN_DV)
    else:
        v = _load_rows(v_desc, v_base, svs, n0, j.to(tl.int64)[:, None], ddv, dvmask, sk, MASK, EVEN_DV, USE_TMA)
    if UPCAST == 2:  # fp8 under the CPU interpreter, whose fp32 -> fp8 rounding is wrong at binade edges: P in fp32
        acc = _dot_acc(p, v, acc * alpha[:, None], DOT_PREC, UPCAST)
    else:
        acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, sks, svs, dd, dmask, i, n0, sq, sk, qk_scale,
               softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS,
               BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, MASK: tl.constexpr,
               EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, USE_TMA: tl.constexpr, ddv, dvmask,
               EVEN_DV: tl.constexpr, CHUNK: tl.constexpr, qv, QV: tl.constexpr, table_row, TK, k0, skb, svb,
               PAGE: tl.constexpr, V_T: tl.constexpr, EXP16: tl.constexpr, PAGE_BLOCK: tl.constexpr):
    """One key block: scores, then the softmax update and ``P @ V``."""
    qk = _qk_block(q, k_base, k_desc, sks, dd, dmask, n0, sk, BLOCK_N, DOT_PREC, UPCAST, MASK, EVEN_D, USE_TMA,
                   table_row, TK, k0, skb, PAGE, PAGE_BLOCK)
    v = qk
    if QV:  # FA3's qv (MLA): the scores gain qv . v, so V is needed before the softmax
        j = n0 + tl.arange(0, BLOCK_N)
        if PAGE > 0:
            v = _load_paged(v_base, table_row, TK, k0, svb, svs, n0, j, ddv, dvmask, sk, PAGE, PAGE_BLOCK, MASK,
                            EVEN_DV)
        else:
            v = _load_rows(v_desc, v_base, svs, n0, j.to(tl.int64)[:, None], ddv, dvmask, sk, MASK, EVEN_DV, USE_TMA)
        qk = _dot_acc(qv, tl.trans(v), qk, DOT_PREC, UPCAST)
    return _pv_block(acc, l_i, m_i, qk, v_base, v_desc, svs, i, n0, sq, sk, qk_scale, softcap, slope2, left, right,
                     p_drop, rng_ptr, bh, SQS, SKS, BLOCK_N, DOT_PREC, UPCAST, MASK, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT,
                     HAS_RIGHT, USE_TMA, ddv, dvmask, EVEN_DV, CHUNK, table_row, TK, k0, svb, PAGE, V_T, EXP16, v, QV,
                     PAGE_BLOCK)


@triton.jit
def _merge_splits(o_part, l_part, out_ptr, lse_out_ptr, out_row, l_row, n_splits, split_o, split_l, sos, sfs, m0, sq,
                  ddv, dvmask, STORE_LSE_OUT: tl.constexpr, MERGE_M: tl.constexpr, MERGE_S: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    """The split-KV merge of query rows ``m0 .. m0 + MERGE_M`` (those ``< sq``) of one head, inside the split kernel:
    the math of ``combine._combine_rows_kernel`` (weights ``exp(lse_s - max)``, their sum, ``+inf`` lse and 0 output
    for a row no split saw a key of), as one online pass over chunks of ``MERGE_S`` splits whose partial outputs
    (``o_part + s * split_o``, rows ``sos`` apart) and lse (``l_part + s * split_l``) are all loaded at once (one
    memory latency per chunk; a chunk of ``(MERGE_S, MERGE_M, BLOCK_DV)`` fp32). Writes ``out_ptr + out_row`` (rows
    ``sfs`` apart) and, ``STORE_LSE_OUT``, ``lse_out_ptr + l_row``. An empty split's partial is its kernel's 0 output
    (never garbage), weighted 0."""
    r = m0 + tl.arange(0, MERGE_M)
    rmask = r < sq
    r64 = r.to(tl.int64)
    m = tl.full([MERGE_M], float("-inf"), tl.float32)
    tot = tl.zeros([MERGE_M], tl.float32)
    acc = tl.zeros([MERGE_M, BLOCK_DV], tl.float32)
    o_rows = o_part + (r64 * sos)[:, None] + ddv[None, :]
    omask = rmask[:, None] & dvmask[None, :]
    for c0 in range(0, n_splits, MERGE_S):
        sp = c0 + tl.arange(0, MERGE_S)
        sp64 = sp.to(tl.int64)
        smask = sp < n_splits
        ls = tl.load(l_part + sp64[:, None] * split_l + r64[None, :], mask=smask[:, None] & rmask[None, :],
                     other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_rows[None, :, :] + (sp64 * split_o)[:, None, None], mask=smask[:, None, None] & omask[None, :, :],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(ls, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split seen yet: exp2 gives 0, not NaN
        alpha = tl.math.exp2((m - m_ref) * LOG2E)
        w = tl.math.exp2((ls - m_ref[None, :]) * LOG2E)
        tot = tot * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    seen = tot > 0.0
    safe = tl.where(seen, tot, 1.0)
    res = acc * tl.where(seen, 1.0 / safe, 0.0)[:, None]
    tl.store(out_ptr + out_row + (r64 * sfs)[:, None] + ddv[None, :], res.to(out_ptr.dtype.element_ty), mask=omask)
    if STORE_LSE_OUT:
        tl.store(lse_out_ptr + l_row + r64, tl.where(seen, m + tl.log(safe), float("inf")), mask=rmask)


@_jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, alibi_ptr, rng_ptr, cu_q_ptr, cu_k_ptr, kst_ptr, ken_ptr,
    qd_ptr, kd_ptr, vd_ptr, qv_ptr, table_ptr,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
    stride_ab,
    H, GROUP, SQ, SK, SQS, SKS, TQ, TK, D, NUM_M, K_ADD,
    qk_scale, softcap, p_drop, left, right,
    sfb, sfs, sfh, out_ptr, lse_out_ptr, ctr_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, HEAVY_FIRST: tl.constexpr,
    USE_TMA: tl.constexpr, K_RANGE: tl.constexpr, STORE_LSE: tl.constexpr, SU: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, CHUNK: tl.constexpr, DESCALE: tl.constexpr,
    QV: tl.constexpr, SPLIT: tl.constexpr, PAGE: tl.constexpr, V_T: tl.constexpr = False,
    EXP16: tl.constexpr = False, OVERLAP: tl.constexpr = False, PAGE_BLOCK: tl.constexpr = False,
    MERGE: tl.constexpr = 0, MERGE_M: tl.constexpr = 1, MERGE_S: tl.constexpr = 1,
):
    """Output (and, with ``STORE_LSE``, the log-sum-exp) of one query block of one head.

    ``K_RANGE`` (dense only; a KV cache): 1 = batch row ``b`` attends to keys ``[0, ken[b] + K_ADD)``,
    2 = keys ``[kst[b], ken[b] + K_ADD)``, clamped to ``[0, SK)``; its causal diagonal aligned to the end.
    FA3's features, each off (and absent from the generated code) at its default: ``DV > 0`` a V head dim
    ``DV`` (padded to ``BLOCK_DV``) other than the QK head dim ``D``; ``CHUNK > 0`` chunked-local attention
    (``_scores2``); ``DESCALE`` FP8 descales ``qd``/``kd``/``vd`` (fp32 ``(B, HK)``, contiguous), the first
    two folded into the softmax scale, the last into the output; ``QV`` FA3's ``qv`` (``(.., h, DV)``, laid out
    like ``out``: read with ``out``'s strides), whose ``qv . v`` joins ``q . k`` in every score.

    Split-KV decoding (``K_RANGE`` only): ``SPLIT`` splits each row's visible keys into ``num_programs(1)`` runs of
    whole key blocks; program ``(.., s)`` writes split ``s``'s normalized partial output and lse (``-inf`` when it
    saw no key) at ``o_ptr`` / ``lse_ptr`` + ``s`` times one output / lse, merged by a second launch
    (``combine._combine_rows_kernel``) or, ``MERGE > 0``, by the last of the row block's split programs to finish
    (``_merge_splits``: it writes ``out_ptr``, strides ``sfb, sfs, sfh``, and with ``MERGE == 2`` the lse at
    ``lse_out_ptr``, laid out like ``lse_ptr``'s). The programs of a row block count themselves in
    ``ctr_ptr[program_id(0)]`` (int32, 0 before the launch); the last one puts it back to 0 (see
    ``launch.AttnPlan._forward_split`` for the rules that keeps).
    ``PAGE > 0``: K/V are a paged cache of ``PAGE`` rows a page read through ``table_ptr`` (contiguous ``(B,
    SK // PAGE)``, page numbers clamped in-kernel); ``skb``/``svb`` are then the page strides. ``PAGE_BLOCK``: one
    page-table load per key block (``_load_paged``; the launcher sets it when ``PAGE % BLOCK_N == 0`` and keys
    start at 0).
    ``OVERLAP`` (no ``qv``): the loop over the unmasked key blocks issues block ``n + 1``'s ``q @ k.T`` before
    block ``n``'s softmax (FA3's intra-warpgroup overlap, left to the compiler's async MMA). ``EXP16`` (FP8 on a
    GPU): the softmax numerators in fp16 (``_exp2``). ``V_T`` (dense, no ``qv``): V is stored with its sequence dim
    contiguous (``svs`` is then its head-dim stride; the launcher's transposed copy of FP8 V, ``_load_rows_t``).
    """
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    p_drop = tl.cast(p_drop, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    sqb, sqs, sqh = _su(sqb, SU), _su(sqs, SU), _su(sqh, SU)
    skb, sks, skh = _su(skb, SU), _su(sks, SU), _su(skh, SU)
    svb, svs, svh = _su(svb, SU), _su(svs, SU), _su(svh, SU)
    sob, sos, soh = _su(sob, SU), _su(sos, SU), _su(soh, SU)
    pid_m, bh = _query_tile(NUM_M, HEAVY_FIRST)
    b = bh // H
    h = bh % H
    kh = h // GROUP
    q0, sq = _sequence(cu_q_ptr, b, SQ, TQ, SQ, VARLEN)
    k0, sk = _sequence(cu_k_ptr, b, SK, TK, SK, VARLEN)
    if K_RANGE > 0:  # keys [start, end) of this row only (a KV cache's filled part, after a left pad)
        ken = tl.minimum(tl.maximum(tl.load(ken_ptr + b).to(tl.int32) + K_ADD, 0), SK)
        if K_RANGE > 1:
            kst = tl.minimum(tl.maximum(tl.load(kst_ptr + b).to(tl.int32), 0), ken)
            k0 = k0 + kst.to(tl.int64)
            sk = ken - kst
        else:
            sk = ken
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    i = m0 + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    if DV > 0:
        ddv = tl.arange(0, BLOCK_DV)
        dvmask = ddv < DV
    else:
        ddv = dd
        dvmask = dmask
    b64 = b.to(tl.int64)
    q_base = q_ptr + b64 * sqb + h.to(tl.int64) * sqh + q0 * sqs
    if PAGE > 0:  # rows are found through the page table (_load_paged)
        k_base = k_ptr + kh.to(tl.int64) * skh
        v_base = v_ptr + kh.to(tl.int64) * svh
        table_row = table_ptr + b64 * (SK // PAGE)
    else:
        k_base = k_ptr + b64 * skb + kh.to(tl.int64) * skh + k0 * sks
        if V_T:  # V stored (.., d, seq): svs is the head-dim stride, the sequence stride is 1
            v_base = v_ptr + b64 * svb + kh.to(tl.int64) * svh + k0
        else:
            v_base = v_ptr + b64 * svb + kh.to(tl.int64) * svh + k0 * svs
        table_row = table_ptr
    i64 = i.to(tl.int64)[:, None]
    rowmask = i[:, None] < sq
    q = tl.load(q_base + i64 * sqs + dd[None, :], mask=rowmask & dmask[None, :], other=0.0)
    if QV:
        qv = tl.load(qv_ptr + b64 * sob + h.to(tl.int64) * soh + q0 * sos + i64 * sos + ddv[None, :],
                     mask=rowmask & dvmask[None, :], other=0.0)
    else:
        qv = q
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(alibi_ptr + b * stride_ab + h).to(tl.float32) * LOG2E
    if DESCALE:  # FP8: q . k in units of the descaled inputs; v's descale multiplies the output
        sc = b * (H // GROUP) + kh
        qk_scale = qk_scale * tl.load(qd_ptr + sc) * tl.load(kd_ptr + sc)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if USE_TMA:  # per-program descriptors bound to this sequence: rows past sk read as 0
        k_desc = tl.make_tensor_descriptor(k_base, shape=[sk, D], strides=[sks, 1], block_shape=[BLOCK_N, BLOCK_D])
        if V_T:  # FP8 V's transposed copy: (D, sk) tiles, the key dim contiguous
            v_desc = tl.make_tensor_descriptor(v_base, shape=[D, sk], strides=[svs, 1],
                                               block_shape=[BLOCK_D, BLOCK_N])
        else:
            v_desc = tl.make_tensor_descriptor(v_base, shape=[sk, D], strides=[svs, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc = k_base
        v_desc = v_base
    lo, f0, f1, hi = _bounds(m0, sq, sk, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, CHUNK)
    if SPLIT:  # this split's run of whole key blocks of [lo, hi), each of the three ranges cut to it
        per = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), tl.num_programs(1)) * BLOCK_N
        s0 = lo + tl.program_id(1) * per
        s1 = tl.maximum(tl.minimum(s0 + per, hi), s0)
        lo = tl.minimum(tl.maximum(lo, s0), s1)
        f0 = tl.minimum(tl.maximum(f0, s0), s1)
        f1 = tl.minimum(tl.maximum(f1, s0), s1)
        hi = tl.minimum(tl.maximum(hi, s0), s1)
    for n0 in range(lo, f0, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, sks, svs, dd, dmask, i, n0, sq,
                                   sk, qk_scale, softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS, BLOCK_N,
                                   DOT_PREC,
                                   UPCAST, True, EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, USE_TMA, ddv,
                                   dvmask, EVEN_DV, CHUNK, qv, QV, table_row, TK, k0, skb, svb, PAGE, V_T, EXP16,
                                   PAGE_BLOCK)
    if OVERLAP:  # the unmasked run rotated: block n+1's q @ k.T is issued before block n's softmax and P @ V
        if f1 > f0:
            qk = _qk_block(q, k_base, k_desc, sks, dd, dmask, f0, sk, BLOCK_N, DOT_PREC, UPCAST, False, EVEN_D,
                           USE_TMA, table_row, TK, k0, skb, PAGE, PAGE_BLOCK)
            for n0 in range(f0, f1 - BLOCK_N, BLOCK_N):
                qk_next = _qk_block(q, k_base, k_desc, sks, dd, dmask, n0 + BLOCK_N, sk, BLOCK_N, DOT_PREC, UPCAST,
                                    False, EVEN_D, USE_TMA, table_row, TK, k0, skb, PAGE, PAGE_BLOCK)
                acc, l_i, m_i = _pv_block(acc, l_i, m_i, qk, v_base, v_desc, svs, i, n0, sq, sk, qk_scale, softcap,
                                          slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS, BLOCK_N, DOT_PREC, UPCAST,
                                          False, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, USE_TMA, ddv, dvmask,
                                          EVEN_DV, CHUNK, table_row, TK, k0, svb, PAGE, V_T, EXP16, qk, False,
                                      PAGE_BLOCK)
                qk = qk_next
            acc, l_i, m_i = _pv_block(acc, l_i, m_i, qk, v_base, v_desc, svs, i, f1 - BLOCK_N, sq, sk, qk_scale,
                                      softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS, BLOCK_N, DOT_PREC,
                                      UPCAST, False, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, USE_TMA, ddv, dvmask,
                                      EVEN_DV, CHUNK, table_row, TK, k0, svb, PAGE, V_T, EXP16, qk, False,
                                      PAGE_BLOCK)
    else:
        for n0 in range(f0, f1, BLOCK_N):
            acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, sks, svs, dd, dmask, i, n0,
                                       sq, sk, qk_scale, softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS,
                                       BLOCK_N, DOT_PREC, UPCAST, False, EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT,
                                       HAS_RIGHT, USE_TMA, ddv, dvmask, EVEN_DV, CHUNK, qv, QV, table_row, TK, k0, skb,
                                       svb, PAGE, V_T, EXP16, PAGE_BLOCK)
    for n0 in range(f1, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, sks, svs, dd, dmask, i, n0, sq,
                                   sk, qk_scale, softcap, slope2, left, right, p_drop, rng_ptr, bh, SQS, SKS, BLOCK_N,
                                   DOT_PREC,
                                   UPCAST, True, EVEN_D, SOFTCAP, ALIBI, DROPOUT, HAS_LEFT, HAS_RIGHT, USE_TMA, ddv,
                                   dvmask, EVEN_DV, CHUNK, qv, QV, table_row, TK, k0, skb, svb, PAGE, V_T, EXP16,
                                   PAGE_BLOCK)
    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    if DROPOUT:
        inv = inv / (1.0 - p_drop)
    if DESCALE:
        inv = inv * tl.load(vd_ptr + sc)
    out = acc * inv[:, None]
    o_row = b64 * sob + h.to(tl.int64) * soh + q0 * sos  # this head's first row, in the output's strides
    l_row = b64 * slb + h.to(tl.int64) * slh + q0
    if SPLIT:  # a split that saw no key weighs nothing in the merge
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        one = tl.cast(tl.num_programs(0) // NUM_M, tl.int64) * SQ  # rows of one split's output (B * H * SQ)
        if DV > 0:
            split_o = one * DV
        else:
            split_o = one * D
        o_part = o_ptr + o_row
        l_part = lse_ptr + l_row
        o_ptr += tl.program_id(1) * split_o
        lse_ptr += tl.program_id(1) * one
    else:
        lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(o_ptr + o_row + i64 * sos + ddv[None, :], out.to(o_ptr.dtype.element_ty), mask=rowmask & dvmask[None, :])
    if STORE_LSE:
        tl.store(lse_ptr + l_row + i, lse, mask=i < sq)
    if MERGE > 0:  # (SPLIT and STORE_LSE) the last split program of this row block to get here merges them all
        # Release: every thread's partial stores above come before thread 0's atomic (the barrier, CTA scope), which
        # publishes them at GPU scope (acq_rel is cumulative); the last program's acquire (the same atomic) makes
        # the other programs' partials visible to it, and the merge reads them from L2 (.cg), past this SM's L1.
        tl.debug_barrier()
        ticket = tl.atomic_add(ctr_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            fs = tl.cast(sfs, tl.int64)
            out_row = b64 * tl.cast(sfb, tl.int64) + h.to(tl.int64) * tl.cast(sfh, tl.int64) + q0 * fs
            _merge_splits(o_part, l_part, out_ptr, lse_out_ptr, out_row, l_row, tl.num_programs(1), split_o, one, sos,
                          fs, m0, sq, ddv, dvmask, MERGE == 2, MERGE_M, MERGE_S, BLOCK_DV)
            tl.store(ctr_ptr + tl.program_id(0), 0)  # ready for the next launch (no other program touches it now)


@triton.jit(do_not_specialize=["sknb", "skns", "sknh", "svnb", "svns", "svnh", "skcb", "skcs", "skch", "svcb", "svcs",
                               "svch", "stb", "S_NEW", "CAP", "NROWS", "PAGE"])
def _kv_append_kernel(
    kn_ptr, vn_ptr, kc_ptr, vc_ptr, lens_ptr, rows_ptr, table_ptr,
    sknb, skns, sknh, sknd, svnb, svns, svnh, svnd,
    skcb, skcs, skch, skcd, svcb, svcs, svch, svcd, stb,
    S_NEW, HK, D, CAP, NROWS, PAGE,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr, ROWS: tl.constexpr,
):
    """The KV-cache append of ``flash_attn_with_kvcache``: new token ``t`` of batch row ``b`` (KV head of
    program axis 1) goes to position ``pos = lens[b] + t`` of cache row ``rows[b]`` (``ROWS``; else ``b``)
    or, ``PAGED``, to row ``pos % PAGE`` of page ``table[b, pos // PAGE]``. A write whose position is
    outside ``[0, CAP)`` (``CAP`` = positions a row or a row of ``table`` holds) or whose cache row / page
    is outside ``[0, NROWS)`` is skipped: whatever ``lens`` / ``rows`` / ``table`` hold, every address read
    or written is inside the given tensors (the indices are clamped before use, the stores masked)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HK).to(tl.int64)
    kh = (bh % HK).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < S_NEW
    pos = tl.load(lens_ptr + b).to(tl.int64) + t
    ok = tmask & (pos >= 0) & (pos < CAP)
    pos = tl.minimum(tl.maximum(pos, 0), CAP - 1)
    if PAGED:
        blk = tl.load(table_ptr + b * stb + pos // PAGE, mask=tmask, other=0).to(tl.int64)
        ok = ok & (blk >= 0) & (blk < NROWS)
        row = tl.minimum(tl.maximum(blk, 0), NROWS - 1)
        pos = pos % PAGE
    else:
        if ROWS:
            r = tl.load(rows_ptr + b).to(tl.int64)
        else:
            r = b
        r = r + tl.zeros([BLOCK_T], tl.int64)  # a vector like pos (the interpreter mis-types scalar & vector)
        ok = ok & (r >= 0) & (r < NROWS)
        row = tl.minimum(tl.maximum(r, 0), NROWS - 1)
    dd = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    m = ok[:, None] & (dd < D)
    t64 = t.to(tl.int64)[:, None]
    kn = tl.load(kn_ptr + b * sknb + kh * sknh + t64 * skns + dd * sknd, mask=m, other=0.0)
    vn = tl.load(vn_ptr + b * svnb + kh * svnh + t64 * svns + dd * svnd, mask=m, other=0.0)
    kdst = (row * skcb + pos * skcs)[:, None] + kh * skch + dd * skcd
    vdst = (row * svcb + pos * svcs)[:, None] + kh * svch + dd * svcd
    tl.store(kc_ptr + kdst, kn.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + vdst, vn.to(vc_ptr.dtype.element_ty), mask=m)


@triton.jit
def _transpose_rows_kernel(x_ptr, y_ptr, S, H, sxb, sxs, sxh, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """``y[b, h, :, s] = x[b, s, h, :]`` for one ``BLOCK_S``-row slab of one (batch, head): the FP8 forward's
    K-major V. Rows are read along ``d`` and written along ``s``, both coalesced (a strided torch copy of
    one-byte elements runs at a fraction of the bandwidth)."""
    # one flat grid (CUDA's second grid dimension stops at 65535 programs: batch * heads can pass it)
    pid = tl.program_id(0).to(tl.int64)
    n_s = tl.cdiv(S, BLOCK_S)
    bh = pid // n_s
    b = bh // H
    h = bh % H
    s = (pid % n_s) * BLOCK_S + tl.arange(0, BLOCK_S)
    dd = tl.arange(0, D)
    x = tl.load(x_ptr + b * sxb + h * sxh + s[:, None].to(tl.int64) * sxs + dd[None, :], mask=s[:, None] < S)
    # int64 offsets: a varlen V of T tokens has D * T elements per head, past int32 for T beyond ~8M at d256
    tl.store(y_ptr + bh * D * S + dd[:, None].to(tl.int64) * S + s[None, :], tl.trans(x), mask=s[None, :] < S)
