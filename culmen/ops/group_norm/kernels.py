"""Triton kernels of GroupNorm (+ optional fused SiLU), forward and backward, NCHW and channels-last.

The input is viewed as ``(N, C, L)`` (``L`` = the spatial dims, which must collapse into one stride)
with arbitrary strides ``(sn, sc, sl)``: NCHW has ``sl == 1``, channels-last has ``sc == 1``. Group
``(n, g)`` holds the ``D = C / G`` channels ``g D ... g D + D - 1`` at all ``L`` positions.

One launch per direction, every row split into chunks. A *row* is what one set of statistics needs:

* ``rows`` kernels (NCHW, and any layout whose channel rows are long): a row is one group ``(n, g)``;
  a chunk is a ``Dc x Lc`` block of its channels x positions, read as ``BLOCK_D x BLOCK_L`` tiles with
  the unit stride along the positions.
* ``cl`` kernels (channels-last): a row is one sample ``n``; a chunk is ``Lc`` whole positions (all
  ``C`` channels, contiguous), read as ``BLOCK_P x BLOCK_C`` tiles. The per-channel sums of a chunk are
  regrouped into per-group sums once per chunk (``_regroup``).

Schedule ("look-back"): the grid has ``R * S + S`` programs (``R`` rows of ``S`` chunks; the backward
adds ``E`` tail programs). Every program takes a *ticket* (an atomic counter) as its logical index
``p``, so tickets follow the order in which programs really start. Program ``p``

1. (``p < R S``) reduces chunk ``p``: partial statistics (forward) or partial gradient sums
   (backward) to the workspace, then counts itself in its row's counter. The last chunk of a row to
   arrive merges the row's partials (fixed order: deterministic), stores the row's result and marks
   the row ready;
2. (``p >= S``) waits until the row of chunk ``p - S`` is ready and writes the output of that chunk:
   ``y`` (forward) or ``dx`` (backward). The chunk was read by program ``p - S`` a moment before, so
   this second read hits L2: DRAM sees one read of each input and one write of each output. In the
   backward the ``S`` readers of a row also sum the row's per-chunk weight/bias-gradient partials into
   per-sample partials, a slice of the channels each (``_dw_slice``);
3. (backward tail, ``E`` programs, ``p >= R S + S``) waits for all those per-sample partials and sums
   them over the batch into ``dweight`` / ``dbias`` for a block of channels, in sample order.

Every wait is on programs with smaller tickets, which have started and wait only on smaller tickets
in turn, so the schedule cannot deadlock whatever the GPU's block order and however few programs are
resident (the classic decoupled look-back argument). Under the CPU interpreter programs run one after
the other in ticket order and never wait. Counters reset themselves (the last user of each stores 0),
so the launcher keeps one zeroed counter buffer per stream.

Memory order: a program's stores are published by ``debug_barrier`` + a release (acq_rel) atomic;
readers spin on an acquire atomic, pass a barrier and read what other programs wrote with ``.cg``
loads (L2, never a stale L1 line).

Statistics: fp32 (fp64 for fp64 inputs) sums of ``x - K`` with ``K`` the mean of the chunk's first
tile (per channel in the ``cl`` kernels), which removes the cancellation of the plain sum-of-squares
formula; chunks merge with Chan's parallel formula (exact). The gradient sums ``dW = sum dz xhat``,
``dB = sum dz`` and the per-group ``c1 = sum dz w xhat``, ``c2 = sum dz w`` are plain fp32 sums in a fixed
order, so results are bitwise reproducible (no floating-point atomics anywhere).

Pointers advance by small increments inside the loops and per-row base offsets are int64, so no
product of a loop index and a stride overflows 32 bits however large the tensor. ``tl.cast`` (not
``.to``) converts sizes such as ``L * D``: Triton turns an integer argument equal to 1 into a constant,
which has no ``.to``.
"""

import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------- schedule


@triton.jit
def _ticket(CNT, T):
    """The program's logical index: the order in which programs start. The last one resets the counter."""
    p = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")
    if p == T - 1:
        tl.atomic_xchg(CNT, 0, sem="relaxed", scope="gpu")
    return p


@triton.jit
def _publish(CTR):
    """Count this program in ``CTR`` after all its threads' stores; returns the previous count."""
    tl.debug_barrier()
    return tl.atomic_add(CTR, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _wait(CTR, target):
    """Spin until ``CTR >= target`` (acquire), then let every thread of the program go on."""
    while tl.atomic_add(CTR, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _leave(CTR, last):
    """Count this reader in ``CTR``; the reader that finds ``last`` there is the final user: reset to 0."""
    if tl.atomic_add(CTR, 1, sem="relaxed", scope="gpu") == last:
        tl.atomic_xchg(CTR, 0, sem="relaxed", scope="gpu")


# ---------------------------------------------------------------------------------------------- helpers


@triton.jit
def _merge(PART, S, G, Sl, Lc, Dc, L, D: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_G: tl.constexpr):
    """Chan's merge of the ``S`` chunk partials ``(mean, M2)`` of each of ``G`` groups, stored at
    ``PART[(s G + g) 2 + {0, 1}]``: ``(mean, M2, count)`` per group, ``[BLOCK_G]`` each, merged in chunk order.
    The next ``BLOCK_M`` chunks' partials load while the current ones merge (the readers of the row wait)."""
    gg = tl.arange(0, BLOCK_G)
    gok = gg < G
    mm = tl.arange(0, BLOCK_M)
    off = (mm[:, None] * G + gg[None, :]) * 2
    m = (mm < S)[:, None] & gok[None, :]
    pm = tl.load(PART + off, mask=m, other=0.0, cache_modifier=".cg")
    pq = tl.load(PART + off + 1, mask=m, other=0.0, cache_modifier=".cg")
    tot = tl.full([BLOCK_G], 0.0, ACC)
    mu = tl.full([BLOCK_G], 0.0, ACC)
    m2 = tl.full([BLOCK_G], 0.0, ACC)
    for s0 in range(0, S, BLOCK_M):
        nxt = (s0 + BLOCK_M + mm[:, None]) * G * 2 + gg[None, :] * 2
        mn = ((s0 + BLOCK_M + mm) < S)[:, None] & gok[None, :]
        pmn = tl.load(PART + nxt, mask=mn, other=0.0, cache_modifier=".cg")
        pqn = tl.load(PART + nxt + 1, mask=mn, other=0.0, cache_modifier=".cg")
        ss = s0 + mm
        ok = ss < S
        sd = ss // Sl  # chunk s: channel block s // Sl (of Dc), position block s % Sl (of Lc)
        cnt = tl.where(ok, tl.minimum(Dc, D - sd * Dc) * tl.minimum(Lc, L - (ss - sd * Sl) * Lc), 0).to(ACC)
        bt = tl.sum(cnt, axis=0)
        bmu = tl.sum(pm.to(ACC) * cnt[:, None], axis=0) / bt
        dm = tl.where(ok[:, None] & gok[None, :], pm.to(ACC) - bmu[None, :], 0.0)
        bq = tl.sum(pq.to(ACC) + cnt[:, None] * dm * dm, axis=0)
        nt = tot + bt
        delta = bmu - mu
        mu += delta * (bt / nt)
        m2 += bq + delta * delta * (tot * (bt / nt))
        tot = nt
        pm = pmn
        pq = pqn
    return mu, m2, tot


@triton.jit
def _sum_pairs(PART, S, G, ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Sums over ``s`` of the pairs ``PART[(s G + g) 2 + {0, 1}]``, in chunk order: two ``[BLOCK_G]`` vectors (the
    next block loads while the current one adds up)."""
    gg = tl.arange(0, BLOCK_G)
    gok = gg < G
    mm = tl.arange(0, BLOCK_M)
    off = (mm[:, None] * G + gg[None, :]) * 2
    m = (mm < S)[:, None] & gok[None, :]
    p1 = tl.load(PART + off, mask=m, other=0.0, cache_modifier=".cg")
    p2 = tl.load(PART + off + 1, mask=m, other=0.0, cache_modifier=".cg")
    a1 = tl.full([BLOCK_G], 0.0, ACC)
    a2 = tl.full([BLOCK_G], 0.0, ACC)
    for s0 in range(0, S, BLOCK_M):
        nxt = (s0 + BLOCK_M + mm[:, None]) * G * 2 + gg[None, :] * 2
        mn = ((s0 + BLOCK_M + mm) < S)[:, None] & gok[None, :]
        p1n = tl.load(PART + nxt, mask=mn, other=0.0, cache_modifier=".cg")
        p2n = tl.load(PART + nxt + 1, mask=mn, other=0.0, cache_modifier=".cg")
        a1 += tl.sum(p1.to(ACC), axis=0)
        a2 += tl.sum(p2.to(ACC), axis=0)
        p1 = p1n
        p2 = p2n
    return a1, a2


@triton.jit
def _regroup(v, SCRATCH, G, D: tl.constexpr, USE_GATHER: tl.constexpr, BLOCK_C: tl.constexpr,
             BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per-channel ``v`` ``[BLOCK_C]`` as ``[BLOCK_G, BLOCK_D]`` (group, channel in group), 0 outside.

    ``tl.gather`` in registers, or (``USE_GATHER`` off) a round trip through this program's own
    ``SCRATCH`` row: its stores are visible to its threads after the barrier."""
    gg = tl.arange(0, BLOCK_G)[:, None]
    dd = tl.arange(0, BLOCK_D)[None, :]
    ok = (gg < G) & (dd < D)
    src = tl.where(ok, gg * D + dd, 0)
    if USE_GATHER:
        out = tl.reshape(tl.gather(v, tl.reshape(src, [BLOCK_G * BLOCK_D]), 0), [BLOCK_G, BLOCK_D])
    else:
        tl.store(SCRATCH + tl.arange(0, BLOCK_C), v)
        tl.debug_barrier()
        out = tl.load(SCRATCH + src)
        tl.debug_barrier()
    return tl.where(ok, out, 0.0)


@triton.jit
def _affine(WP, BP, ch, dmask, ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """Per-channel weight (1 without) and bias (0 without) of channels ``ch``."""
    w = tl.full(ch.shape, 1.0, ACC)
    b = tl.full(ch.shape, 0.0, ACC)
    if HAS_W:
        w = tl.load(WP + ch, mask=dmask, other=0.0).to(ACC)
    if HAS_B:
        b = tl.load(BP + ch, mask=dmask, other=0.0).to(ACC)
    return w, b


# ------------------------------------------------------------------------------- rows (group) kernels


@triton.jit
def _tile_off(t, nlb, sc, sl, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Tile ``t`` of a chunk walked channel block by channel block (``nlb`` position tiles each): its first
    channel and position, and its int64 offset."""
    db = t // nlb
    d0 = db * BLOCK_D
    l0 = (t - db * nlb) * BLOCK_L
    return d0, l0, d0.to(tl.int64) * sc + l0.to(tl.int64) * sl


# The chunk loops below walk the chunk's tiles in one flat loop and load tile t + 1 before working on
# tile t: the raw 16-bit tile costs few registers and doubles the bytes each program has in flight
# (Triton does not software-pipeline loads that feed no dot). The tile after the last one starts past the
# last channel block (or position), so its load is masked off entirely.


@triton.jit
def _rows_stats(xp, sxc, sxl, nl, nd, ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                FOLD: tl.constexpr):
    """``(mean, M2)`` of the ``nd x nl`` block at ``xp`` (``M2`` = sum of squared deviations). The accumulators
    fold ``FOLD`` neighbouring positions (one thread's vector: an in-register sum), which frees registers."""
    dd = tl.arange(0, BLOCK_D)
    ll = tl.arange(0, BLOCK_L)
    voff = dd[:, None] * sxc + ll[None, :] * sxl
    nlb = (nl + BLOCK_L - 1) // BLOCK_L
    nt = (nd + BLOCK_D - 1) // BLOCK_D * nlb
    x = tl.load(xp + voff, mask=(dd < nd)[:, None] & (ll < nl)[None, :], other=0.0)
    k = tl.sum(x.to(ACC)) / tl.cast(tl.minimum(nl, BLOCK_L) * tl.minimum(nd, BLOCK_D), ACC)
    acc1 = tl.full([BLOCK_D, BLOCK_L // FOLD], 0.0, ACC)
    acc2 = tl.full([BLOCK_D, BLOCK_L // FOLD], 0.0, ACC)
    for t in range(0, nt):
        d1, l1, o1 = _tile_off(t + 1, nlb, sxc, sxl, BLOCK_D, BLOCK_L)
        m1 = ((d1 + dd) < nd)[:, None] & ((l1 + ll) < nl)[None, :]
        xn = tl.load(xp + o1 + voff, mask=m1, other=0.0)
        d0, l0, _ = _tile_off(t, nlb, sxc, sxl, BLOCK_D, BLOCK_L)
        m = ((d0 + dd) < nd)[:, None] & ((l0 + ll) < nl)[None, :]
        dlt = tl.where(m, x.to(ACC) - k, 0.0)
        acc1 += tl.sum(tl.reshape(dlt, [BLOCK_D, BLOCK_L // FOLD, FOLD]), axis=2)
        acc2 += tl.sum(tl.reshape(dlt * dlt, [BLOCK_D, BLOCK_L // FOLD, FOLD]), axis=2)
        x = xn
    cnt = tl.cast(nl * nd, ACC)
    s1 = tl.sum(acc1)
    s2 = tl.sum(acc2)
    return k + s1 / cnt, tl.maximum(s2 - s1 * s1 / cnt, 0.0)


@triton.jit
def _rows_normalize(xp, yp, WP, BP, sxc, sxl, syc, syl, mean, rstd, nl, nd, ACC: tl.constexpr, HAS_W: tl.constexpr,
                    HAS_B: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """``y = silu?((x - mean) * rstd * w + b)`` over the ``nd x nl`` block at ``xp`` / ``yp``."""
    dd = tl.arange(0, BLOCK_D)
    ll = tl.arange(0, BLOCK_L)
    xoff = dd[:, None] * sxc + ll[None, :] * sxl
    yoff = dd[:, None] * syc + ll[None, :] * syl
    nlb = (nl + BLOCK_L - 1) // BLOCK_L
    nt = (nd + BLOCK_D - 1) // BLOCK_D * nlb
    x = tl.load(xp + xoff, mask=(dd < nd)[:, None] & (ll < nl)[None, :], other=0.0)
    for t in range(0, nt):
        d1, l1, o1 = _tile_off(t + 1, nlb, sxc, sxl, BLOCK_D, BLOCK_L)
        m1 = ((d1 + dd) < nd)[:, None] & ((l1 + ll) < nl)[None, :]
        xn = tl.load(xp + o1 + xoff, mask=m1, other=0.0)
        d0, l0, oy = _tile_off(t, nlb, syc, syl, BLOCK_D, BLOCK_L)
        ch = d0 + dd
        m = (ch < nd)[:, None] & ((l0 + ll) < nl)[None, :]
        w, b = _affine(WP, BP, ch, ch < nd, ACC, HAS_W, HAS_B)
        y = (x.to(ACC) - mean) * (w * rstd)[:, None] + b[:, None]
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(yp + oy + yoff, y.to(yp.dtype.element_ty), mask=m)
        x = xn


@triton.jit
def _rows_bwd_sums(dyp, xp, WP, BP, PW, PB, sdc, sdl, sxc, sxl, mean, rstd, nl, nd, ACC: tl.constexpr,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr, STORE_DW: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, FOLD: tl.constexpr):
    """Pass 1 of the backward over the ``nd x nl`` block: per-channel ``sum(dz * xhat)`` and ``sum(dz)``
    (stored to ``PW`` / ``PB`` with ``STORE_DW``) and the block's ``c1 = sum(dz * w * xhat)``, ``c2 = sum(dz * w)``."""
    dd = tl.arange(0, BLOCK_D)
    ll = tl.arange(0, BLOCK_L)
    doff = dd[:, None] * sdc + ll[None, :] * sdl
    xoff = dd[:, None] * sxc + ll[None, :] * sxl
    nlb = (nl + BLOCK_L - 1) // BLOCK_L
    nt = (nd + BLOCK_D - 1) // BLOCK_D * nlb
    m0 = (dd < nd)[:, None] & (ll < nl)[None, :]
    dy = tl.load(dyp + doff, mask=m0, other=0.0)
    x = tl.load(xp + xoff, mask=m0, other=0.0)
    c1 = tl.full([BLOCK_D], 0.0, ACC)
    c2 = tl.full([BLOCK_D], 0.0, ACC)
    a1 = tl.full([BLOCK_D, BLOCK_L // FOLD], 0.0, ACC)
    a2 = tl.full([BLOCK_D, BLOCK_L // FOLD], 0.0, ACC)
    for t in range(0, nt):
        d1, l1, o1 = _tile_off(t + 1, nlb, sdc, sdl, BLOCK_D, BLOCK_L)
        m1 = ((d1 + dd) < nd)[:, None] & ((l1 + ll) < nl)[None, :]
        dyn = tl.load(dyp + o1 + doff, mask=m1, other=0.0)
        xn = tl.load(xp + d1.to(tl.int64) * sxc + l1.to(tl.int64) * sxl + xoff, mask=m1, other=0.0)
        d0 = (t // nlb) * BLOCK_D
        ch = d0 + dd
        dmask = ch < nd
        w, b = _affine(WP, BP, ch, dmask, ACC, HAS_W, HAS_B)
        xhat = (x.to(ACC) - mean) * rstd
        dz = dy.to(ACC)
        if SILU:  # the gradient at the pre-activation z = xhat * w + b
            z = xhat * w[:, None] + b[:, None]
            sg = 1.0 / (1.0 + tl.exp(-z))
            dz = dz * sg * (1.0 + z * (1.0 - sg))
        a1 += tl.sum(tl.reshape(dz * xhat, [BLOCK_D, BLOCK_L // FOLD, FOLD]), axis=2)  # dz = 0 off the mask
        a2 += tl.sum(tl.reshape(dz, [BLOCK_D, BLOCK_L // FOLD, FOLD]), axis=2)
        if d1 != d0:  # the channel block ends here: its per-channel sums are complete
            dwc = tl.sum(a1, axis=1)
            dbc = tl.sum(a2, axis=1)
            if STORE_DW:
                tl.store(PW + ch, dwc, mask=dmask)
                tl.store(PB + ch, dbc, mask=dmask)
            c1 += tl.where(dmask, dwc * w, 0.0)
            c2 += tl.where(dmask, dbc * w, 0.0)
            a1 = tl.full([BLOCK_D, BLOCK_L // FOLD], 0.0, ACC)
            a2 = tl.full([BLOCK_D, BLOCK_L // FOLD], 0.0, ACC)
        dy = dyn
        x = xn
    return tl.sum(c1, axis=0), tl.sum(c2, axis=0)


@triton.jit
def _rows_bwd_dx(dyp, xp, dxp, WP, BP, sdc, sdl, sxc, sxl, sgc, sgl, mean, rstd, k1, k2, nl, nd, ACC: tl.constexpr,
                 HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_L: tl.constexpr):
    """Pass 2: ``dx = rstd * (dz * w - xhat * k1 - k2)`` (``k = c / count``) over the ``nd x nl`` block."""
    dd = tl.arange(0, BLOCK_D)
    ll = tl.arange(0, BLOCK_L)
    doff = dd[:, None] * sdc + ll[None, :] * sdl
    xoff = dd[:, None] * sxc + ll[None, :] * sxl
    goff = dd[:, None] * sgc + ll[None, :] * sgl
    nlb = (nl + BLOCK_L - 1) // BLOCK_L
    nt = (nd + BLOCK_D - 1) // BLOCK_D * nlb
    m0 = (dd < nd)[:, None] & (ll < nl)[None, :]
    dy = tl.load(dyp + doff, mask=m0, other=0.0)
    x = tl.load(xp + xoff, mask=m0, other=0.0)
    for t in range(0, nt):
        d1, l1, o1 = _tile_off(t + 1, nlb, sdc, sdl, BLOCK_D, BLOCK_L)
        m1 = ((d1 + dd) < nd)[:, None] & ((l1 + ll) < nl)[None, :]
        dyn = tl.load(dyp + o1 + doff, mask=m1, other=0.0)
        xn = tl.load(xp + d1.to(tl.int64) * sxc + l1.to(tl.int64) * sxl + xoff, mask=m1, other=0.0)
        d0, l0, og = _tile_off(t, nlb, sgc, sgl, BLOCK_D, BLOCK_L)
        ch = d0 + dd
        m = (ch < nd)[:, None] & ((l0 + ll) < nl)[None, :]
        w, b = _affine(WP, BP, ch, ch < nd, ACC, HAS_W, HAS_B)
        xhat = (x.to(ACC) - mean) * rstd
        dz = dy.to(ACC)
        if SILU:
            z = xhat * w[:, None] + b[:, None]
            sg = 1.0 / (1.0 + tl.exp(-z))
            dz = dz * sg * (1.0 + z * (1.0 - sg))
        dx = rstd * (dz * w[:, None] - (xhat * k1 + k2))
        tl.store(dxp + og + goff, dx.to(dxp.dtype.element_ty), mask=m)
        dy = dyn
        x = xn


@triton.jit(do_not_specialize=["roff", "poff", "R"])
def _gn_fwd_rows_kernel(X, Y, W, B, MEAN, RSTD, roff, PART, poff, CNT, R, G, L, Lc, Dc, Sl, S,
                        sxn, sxc, sxl, syn, syc, syl, eps, D: tl.constexpr, ACC: tl.constexpr, HAS_W: tl.constexpr,
                        HAS_B: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                        FOLD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Forward, one row per group ``(n, g)``: statistics at ``MEAN[row]`` / ``RSTD[roff + row]``, partials at
    ``PART[poff + ...]`` (``R * S`` pairs), counters at ``CNT``."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    eps = tl.cast(eps, tl.float32)
    p = _ticket(CNT, (R + 1) * S)
    ARR = CNT + 2
    RS = RSTD + roff
    PT = PART + poff
    if p < R * S:
        row = p // S
        s = p - row * S
        n = row // G
        g = row - n * G
        sd = s // Sl
        d0 = sd * Dc
        l0 = (s - sd * Sl) * Lc
        nd = tl.minimum(Dc, D - d0)
        nl = tl.minimum(Lc, L - l0)
        ox = n.to(tl.int64) * sxn + (g * D + d0).to(tl.int64) * sxc + l0.to(tl.int64) * sxl
        mean, m2 = _rows_stats(X + ox, sxc, sxl, nl, nd, ACC, BLOCK_D, BLOCK_L, FOLD)
        tl.store(PT + p * 2, mean)
        tl.store(PT + p * 2 + 1, m2)
        if _publish(ARR + row) == S - 1:  # the row's last chunk: merge, store the statistics, mark ready
            mu, q2, tot = _merge(PT + row * S * 2, S, 1, Sl, Lc, Dc, L, D, ACC, BLOCK_M, 1)
            mu1 = tl.sum(mu, axis=0)
            tl.store(MEAN + row, mu1)
            tl.store(RS + row, 1.0 / tl.sqrt(tl.sum(q2, axis=0) / tl.sum(tot, axis=0) + eps))
            _publish(ARR + row)
    if p >= S:
        q = p - S
        row = q // S
        s = q - row * S
        n = row // G
        g = row - n * G
        sd = s // Sl
        d0 = sd * Dc
        l0 = (s - sd * Sl) * Lc
        _wait(ARR + row, S + 1)
        mean = tl.load(MEAN + row, cache_modifier=".cg")
        rstd = tl.load(RS + row, cache_modifier=".cg")
        _leave(ARR + row, 2 * S)
        n64 = n.to(tl.int64)
        c64 = (g * D + d0).to(tl.int64)
        l64 = l0.to(tl.int64)
        _rows_normalize(X + n64 * sxn + c64 * sxc + l64 * sxl, Y + n64 * syn + c64 * syc + l64 * syl,
                        W + g * D + d0, B + g * D + d0, sxc, sxl, syc, syl, mean, rstd, tl.minimum(Lc, L - l0),
                        tl.minimum(Dc, D - d0), ACC, HAS_W, HAS_B, SILU, BLOCK_D, BLOCK_L)


@triton.jit
def _dw_slice(PW, PB, OW, OB, nrows, ncols, ldc, j, S, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              BLOCK_RR: tl.constexpr, BLOCK_CC: tl.constexpr):
    """Column slice ``j`` of ``S`` of the ``nrows x ncols`` block at ``PW`` / ``PB`` (row stride ``ldc``): sums over
    the rows, in row order, stored at ``OW`` / ``OB``. The ``S`` readers of a row split its partials this way."""
    cpc = (ncols + S - 1) // S
    c0 = j * cpc
    cc = c0 + tl.arange(0, BLOCK_CC)
    ok = (cc < ncols) & (cc < c0 + cpc)
    rr = tl.arange(0, BLOCK_RR)
    m = (rr < nrows)[:, None] & ok[None, :]
    off = rr.to(tl.int64)[:, None] * ldc + cc[None, :]
    if HAS_W:
        tl.store(OW + cc, tl.sum(tl.load(PW + off, mask=m, other=0.0, cache_modifier=".cg"), axis=0), mask=ok)
    if HAS_B:
        tl.store(OB + cc, tl.sum(tl.load(PB + off, mask=m, other=0.0, cache_modifier=".cg"), axis=0), mask=ok)


@triton.jit
def _tail_dwdb(PW, DW, DB, Rw, C, e, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_CT: tl.constexpr):
    """``DW[c] = sum_r PW[r, c]``, ``DB[c] = sum_r PB[r, c]`` (``PB = PW + Rw C``) for channel block ``e``, in row
    order (``Rw`` = the batch: one row per sample)."""
    PB = PW + Rw * C
    cols = e * BLOCK_CT + tl.arange(0, BLOCK_CT)
    ok = cols < C
    rr = tl.arange(0, BLOCK_R)
    aw = tl.full([BLOCK_R, BLOCK_CT], 0.0, PW.dtype.element_ty)
    ab = tl.full([BLOCK_R, BLOCK_CT], 0.0, PW.dtype.element_ty)
    for r in range(0, Rw, BLOCK_R):
        rows = r + rr
        m = (rows < Rw)[:, None] & ok[None, :]
        off = rows.to(tl.int64)[:, None] * C + cols[None, :]
        if HAS_W:
            aw += tl.load(PW + off, mask=m, other=0.0, cache_modifier=".cg")
        if HAS_B:
            ab += tl.load(PB + off, mask=m, other=0.0, cache_modifier=".cg")
    if HAS_W:
        tl.store(DW + cols, tl.sum(aw, axis=0).to(DW.dtype.element_ty), mask=ok)
    if HAS_B:
        tl.store(DB + cols, tl.sum(ab, axis=0).to(DB.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["roff", "R"])
def _gn_bwd_rows_kernel(DY, X, DX, W, B, MEAN, RSTD, roff, WS, CNT, DW, DB, R, G, C, L, Lc, Dc, Sl, S, E,
                        sdn, sdc, sdl, sxn, sxc, sxl, sgn, sgc, sgl, D: tl.constexpr, ACC: tl.constexpr,
                        HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr, STORE_DW: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_RR: tl.constexpr, BLOCK_CC: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_CT: tl.constexpr):
    """Backward, one row per group. Workspace ``WS``: with ``STORE_DW`` the per-channel partials ``PW`` and ``PB``
    (``(N Sl, C)`` each; row ``n Sl + position chunk``) and their per-sample sums ``PWN`` and ``PBN`` (``(N, C)``
    each), then ``(c1, c2)`` per chunk (``R S`` pairs), then per row (``R`` pairs). The ``S`` readers of a row
    sum its ``PW`` / ``PB`` rows (a column slice each); ``E`` tail programs sum the samples into ``DW`` / ``DB``."""
    p = _ticket(CNT, (R + 1) * S + E)
    ARR = CNT + 2
    RS = RSTD + roff
    N = R // G
    Rw = N * Sl
    PW = WS
    PWN = WS + 2 * Rw * C
    PC = WS
    if STORE_DW:
        PC = PWN + 2 * N * C
    FIN = PC + R * S * 2
    if p < R * S:
        row = p // S
        s = p - row * S
        n = row // G
        g = row - n * G
        sd = s // Sl
        sl = s - sd * Sl
        d0 = sd * Dc
        l0 = sl * Lc
        mean = tl.load(MEAN + row)
        rstd = tl.load(RS + row)
        n64 = n.to(tl.int64)
        c64 = (g * D + d0).to(tl.int64)
        l64 = l0.to(tl.int64)
        prow = (n64 * Sl + sl) * C + c64
        c1, c2 = _rows_bwd_sums(DY + n64 * sdn + c64 * sdc + l64 * sdl, X + n64 * sxn + c64 * sxc + l64 * sxl,
                                W + g * D + d0, B + g * D + d0, PW + prow, PW + Rw * C + prow, sdc, sdl, sxc, sxl, mean,
                                rstd, tl.minimum(Lc, L - l0), tl.minimum(Dc, D - d0), ACC, HAS_W, HAS_B, SILU,
                                STORE_DW, BLOCK_D, BLOCK_L, FOLD)
        tl.store(PC + p * 2, c1)
        tl.store(PC + p * 2 + 1, c2)
        if _publish(ARR + row) == S - 1:
            t1, t2 = _sum_pairs(PC + row * S * 2, S, 1, ACC, BLOCK_M, 1)
            tl.store(FIN + row * 2, tl.sum(t1, axis=0))
            tl.store(FIN + row * 2 + 1, tl.sum(t2, axis=0))
            _publish(ARR + row)
    if (p >= S) & (p < (R + 1) * S):
        q = p - S
        row = q // S
        s = q - row * S
        n = row // G
        g = row - n * G
        sd = s // Sl
        d0 = sd * Dc
        l0 = (s - sd * Sl) * Lc
        _wait(ARR + row, S + 1)
        c1 = tl.load(FIN + row * 2, cache_modifier=".cg")
        c2 = tl.load(FIN + row * 2 + 1, cache_modifier=".cg")
        if STORE_DW:  # every chunk of the row is in: sum a slice of the group's channels over the position chunks
            pw = PW + n.to(tl.int64) * Sl * C + g * D
            pn = PWN + n.to(tl.int64) * C + g * D
            _dw_slice(pw, pw + Rw * C, pn, pn + N * C, Sl, D, C, s, S, HAS_W, HAS_B, BLOCK_RR, BLOCK_CC)
            _publish(CNT + 1)
        _leave(ARR + row, 2 * S)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RS + row)
        cnt = tl.cast(L * D, ACC)
        n64 = n.to(tl.int64)
        c64 = (g * D + d0).to(tl.int64)
        l64 = l0.to(tl.int64)
        _rows_bwd_dx(DY + n64 * sdn + c64 * sdc + l64 * sdl, X + n64 * sxn + c64 * sxc + l64 * sxl,
                     DX + n64 * sgn + c64 * sgc + l64 * sgl, W + g * D + d0, B + g * D + d0, sdc, sdl, sxc, sxl,
                     sgc, sgl, mean, rstd, c1 / cnt, c2 / cnt, tl.minimum(Lc, L - l0), tl.minimum(Dc, D - d0), ACC,
                     HAS_W, HAS_B, SILU, BLOCK_D, BLOCK_L)
    if STORE_DW:
        if p >= (R + 1) * S:
            _wait(CNT + 1, R * S)
            _tail_dwdb(PWN, DW, DB, N, C, p - (R + 1) * S, HAS_W, HAS_B, BLOCK_R, BLOCK_CT)
            _leave(CNT + 1, R * S + E - 1)


# ----------------------------------------------------------------------------- channels-last kernels


@triton.jit
def _cl_stats(xp, sxc, sxl, nl, cm, ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per-channel ``(mean, M2)`` ``[BLOCK_C]`` of the ``nl`` positions at ``xp`` (channels masked by ``cm``)."""
    pp = tl.arange(0, BLOCK_P)
    cc = tl.arange(0, BLOCK_C)
    off = pp[:, None] * sxl + cc[None, :] * sxc
    m = (pp < nl)[:, None] & cm[None, :]
    x = tl.load(xp + off, mask=m, other=0.0)
    k = tl.sum(x.to(ACC), axis=0) / tl.cast(tl.minimum(nl, BLOCK_P), ACC)
    acc1 = tl.full([BLOCK_P, BLOCK_C], 0.0, ACC)
    acc2 = tl.full([BLOCK_P, BLOCK_C], 0.0, ACC)
    p = xp
    for lb in range(0, nl, BLOCK_P):
        p += BLOCK_P * sxl
        m1 = ((lb + BLOCK_P + pp) < nl)[:, None] & cm[None, :]
        xn = tl.load(p + off, mask=m1, other=0.0)
        m = ((lb + pp) < nl)[:, None] & cm[None, :]
        dlt = tl.where(m, x.to(ACC) - k[None, :], 0.0)
        acc1 += dlt
        acc2 += dlt * dlt
        x = xn
    cnt = tl.cast(nl, ACC)
    s1 = tl.sum(acc1, axis=0)
    s2 = tl.sum(acc2, axis=0)
    return k + s1 / cnt, tl.maximum(s2 - s1 * s1 / cnt, 0.0)


@triton.jit(do_not_specialize=["roff", "poff", "N"])
def _gn_fwd_cl_kernel(X, Y, W, B, MEAN, RSTD, roff, PART, poff, CNT, N, G, C, L, Lc, S,
                      sxn, sxc, sxl, syn, syc, syl, eps, D: tl.constexpr, ACC: tl.constexpr, HAS_W: tl.constexpr,
                      HAS_B: tl.constexpr, SILU: tl.constexpr, USE_GATHER: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Forward, one row per sample, chunks of ``Lc`` positions x all channels. Partials: ``(mean, M2)`` per
    ``(n, chunk, g)`` at ``PART[poff + ...]``; without ``USE_GATHER`` each chunk also has a ``BLOCK_C`` scratch
    row after them."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    eps = tl.cast(eps, tl.float32)
    p = _ticket(CNT, (N + 1) * S)
    ARR = CNT + 2
    RS = RSTD + roff
    PT = PART + poff
    if p < N * S:
        cc = tl.arange(0, BLOCK_C)
        cm = cc < C
        gg = tl.arange(0, BLOCK_G)
        gok = gg < G
        n = p // S
        s = p - n * S
        l0 = s * Lc
        nl = tl.minimum(Lc, L - l0)
        mc, qc = _cl_stats(X + n.to(tl.int64) * sxn + l0.to(tl.int64) * sxl, sxc, sxl, nl, cm, ACC, BLOCK_P, BLOCK_C)
        scratch = PT + N * S * G * 2 + p.to(tl.int64) * BLOCK_C
        mg = _regroup(mc, scratch, G, D, USE_GATHER, BLOCK_C, BLOCK_G, BLOCK_D)
        qg = _regroup(qc, scratch, G, D, USE_GATHER, BLOCK_C, BLOCK_G, BLOCK_D)
        ok = gok[:, None] & (tl.arange(0, BLOCK_D) < D)[None, :]
        mu = tl.sum(mg, axis=1) / D  # D channels of nl positions each: equal counts
        dv = tl.where(ok, mg - mu[:, None], 0.0)
        q2 = tl.sum(qg + tl.cast(nl, ACC) * dv * dv, axis=1)
        tl.store(PT + (p * G + gg) * 2, mu, mask=gok)
        tl.store(PT + (p * G + gg) * 2 + 1, q2, mask=gok)
        if _publish(ARR + n) == S - 1:
            mu, m2, tot = _merge(PT + n * S * G * 2, S, G, S, Lc, D, L, D, ACC, BLOCK_M, BLOCK_G)
            tl.store(MEAN + n * G + gg, mu, mask=gok)
            tl.store(RS + n * G + gg, 1.0 / tl.sqrt(m2 / tot + eps), mask=gok)
            _publish(ARR + n)
    if p >= S:
        q = p - S
        m = q // S
        l0 = (q - m * S) * Lc
        nl = tl.minimum(Lc, L - l0)
        cc = tl.arange(0, BLOCK_C)
        cm = cc < C
        cg = tl.minimum(cc // D, G - 1)
        _wait(ARR + m, S + 1)
        mean = tl.load(MEAN + m * G + cg, cache_modifier=".cg")
        rstd = tl.load(RS + m * G + cg, cache_modifier=".cg")
        _leave(ARR + m, 2 * S)
        w, b = _affine(W, B, cc, cm, ACC, HAS_W, HAS_B)
        scale = (w * rstd)[None, :]
        shift = b[None, :]
        mean2 = mean[None, :]
        pp = tl.arange(0, BLOCK_P)
        xoff = pp[:, None] * sxl + cc[None, :] * sxc
        yoff = pp[:, None] * syl + cc[None, :] * syc
        px = X + m.to(tl.int64) * sxn + l0.to(tl.int64) * sxl
        py = Y + m.to(tl.int64) * syn + l0.to(tl.int64) * syl
        msk = (pp < nl)[:, None] & cm[None, :]
        x = tl.load(px + xoff, mask=msk, other=0.0)
        for lb in range(0, nl, BLOCK_P):
            px += BLOCK_P * sxl
            m1 = ((lb + BLOCK_P + pp) < nl)[:, None] & cm[None, :]
            xn = tl.load(px + xoff, mask=m1, other=0.0)
            msk = ((lb + pp) < nl)[:, None] & cm[None, :]
            y = (x.to(ACC) - mean2) * scale + shift
            if SILU:
                y = y / (1.0 + tl.exp(-y))
            tl.store(py + yoff, y.to(py.dtype.element_ty), mask=msk)
            py += BLOCK_P * syl
            x = xn


@triton.jit(do_not_specialize=["roff", "N"])
def _gn_bwd_cl_kernel(DY, X, DX, W, B, MEAN, RSTD, roff, WS, CNT, DW, DB, N, G, C, L, Lc, S, E,
                      sdn, sdc, sdl, sxn, sxc, sxl, sgn, sgc, sgl, D: tl.constexpr, ACC: tl.constexpr,
                      HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr, STORE_DW: tl.constexpr,
                      USE_GATHER: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_RR: tl.constexpr, BLOCK_CC: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_CT: tl.constexpr):
    """Backward, one row per sample. Workspace ``WS``: with ``STORE_DW`` ``PW`` and ``PB`` (``(N S, C)`` each) and
    their per-sample sums ``PWN`` and ``PBN`` (``(N, C)``), then ``(c1, c2)`` per ``(n, chunk, g)``, then per
    ``(n, g)``, then (without ``USE_GATHER``) one ``BLOCK_C`` scratch row per chunk."""
    p = _ticket(CNT, (N + 1) * S + E)
    ARR = CNT + 2
    RS = RSTD + roff
    Rw = N * S
    PW = WS
    PWN = WS + 2 * Rw * C
    PC = WS
    if STORE_DW:
        PC = PWN + 2 * N * C
    FIN = PC + Rw * G * 2
    # (index vectors are made inside each phase: live across the phases they would cost registers in all)
    if p < N * S:
        cc = tl.arange(0, BLOCK_C)
        cm = cc < C
        cg = tl.minimum(cc // D, G - 1)
        pp = tl.arange(0, BLOCK_P)
        doff = pp[:, None] * sdl + cc[None, :] * sdc
        xoff = pp[:, None] * sxl + cc[None, :] * sxc
        n = p // S
        l0 = (p - n * S) * Lc
        nl = tl.minimum(Lc, L - l0)
        mean = tl.load(MEAN + n * G + cg)[None, :]
        rstd = tl.load(RS + n * G + cg)[None, :]
        w, b = _affine(W, B, cc, cm, ACC, HAS_W, HAS_B)
        w2 = w[None, :]
        b2 = b[None, :]
        a1 = tl.full([BLOCK_P, BLOCK_C], 0.0, ACC)
        a2 = tl.full([BLOCK_P, BLOCK_C], 0.0, ACC)
        pd = DY + n.to(tl.int64) * sdn + l0.to(tl.int64) * sdl
        px = X + n.to(tl.int64) * sxn + l0.to(tl.int64) * sxl
        msk = (pp < nl)[:, None] & cm[None, :]
        dy = tl.load(pd + doff, mask=msk, other=0.0)
        x = tl.load(px + xoff, mask=msk, other=0.0)
        for lb in range(0, nl, BLOCK_P):
            pd += BLOCK_P * sdl
            px += BLOCK_P * sxl
            m1 = ((lb + BLOCK_P + pp) < nl)[:, None] & cm[None, :]
            dyn = tl.load(pd + doff, mask=m1, other=0.0)
            xn = tl.load(px + xoff, mask=m1, other=0.0)
            xhat = (x.to(ACC) - mean) * rstd
            dz = dy.to(ACC)
            if SILU:  # the gradient at the pre-activation z = xhat * w + b
                z = xhat * w2 + b2
                sg = 1.0 / (1.0 + tl.exp(-z))
                dz = dz * sg * (1.0 + z * (1.0 - sg))
            a1 += dz * xhat  # dz = 0 off the mask
            a2 += dz
            dy = dyn
            x = xn
        dwc = tl.sum(a1, axis=0)
        dbc = tl.sum(a2, axis=0)
        if STORE_DW:
            tl.store(PW + p.to(tl.int64) * C + cc, dwc, mask=cm)
            tl.store(PW + Rw * C + p.to(tl.int64) * C + cc, dbc, mask=cm)
        scratch = FIN + N * G * 2 + p.to(tl.int64) * BLOCK_C
        g1 = tl.sum(_regroup(dwc * w, scratch, G, D, USE_GATHER, BLOCK_C, BLOCK_G, BLOCK_D), axis=1)
        g2 = tl.sum(_regroup(dbc * w, scratch, G, D, USE_GATHER, BLOCK_C, BLOCK_G, BLOCK_D), axis=1)
        gg = tl.arange(0, BLOCK_G)
        gok = gg < G
        tl.store(PC + (p * G + gg) * 2, g1, mask=gok)
        tl.store(PC + (p * G + gg) * 2 + 1, g2, mask=gok)
        if _publish(ARR + n) == S - 1:
            t1, t2 = _sum_pairs(PC + n * S * G * 2, S, G, ACC, BLOCK_M, BLOCK_G)
            tl.store(FIN + (n * G + gg) * 2, t1, mask=gok)
            tl.store(FIN + (n * G + gg) * 2 + 1, t2, mask=gok)
            _publish(ARR + n)
    if (p >= S) & (p < (N + 1) * S):
        q = p - S
        m = q // S
        l0 = (q - m * S) * Lc
        nl = tl.minimum(Lc, L - l0)
        cc = tl.arange(0, BLOCK_C)
        cm = cc < C
        cg = tl.minimum(cc // D, G - 1)
        pp = tl.arange(0, BLOCK_P)
        _wait(ARR + m, S + 1)
        cnt = tl.cast(L * D, ACC)
        k1 = (tl.load(FIN + (m * G + cg) * 2, cache_modifier=".cg") / cnt)[None, :]
        k2 = (tl.load(FIN + (m * G + cg) * 2 + 1, cache_modifier=".cg") / cnt)[None, :]
        if STORE_DW:  # every chunk of the sample is in: sum a slice of the channels over its chunks
            pw = PW + m.to(tl.int64) * S * C
            pn = PWN + m.to(tl.int64) * C
            _dw_slice(pw, pw + Rw * C, pn, pn + N * C, S, C, C, q - m * S, S, HAS_W, HAS_B, BLOCK_RR, BLOCK_CC)
            _publish(CNT + 1)
        _leave(ARR + m, 2 * S)
        mean = tl.load(MEAN + m * G + cg)[None, :]
        rstd = tl.load(RS + m * G + cg)[None, :]
        w, b = _affine(W, B, cc, cm, ACC, HAS_W, HAS_B)
        w2 = w[None, :]
        b2 = b[None, :]
        doff = pp[:, None] * sdl + cc[None, :] * sdc
        xoff = pp[:, None] * sxl + cc[None, :] * sxc
        goff = pp[:, None] * sgl + cc[None, :] * sgc
        pd = DY + m.to(tl.int64) * sdn + l0.to(tl.int64) * sdl
        px = X + m.to(tl.int64) * sxn + l0.to(tl.int64) * sxl
        pg = DX + m.to(tl.int64) * sgn + l0.to(tl.int64) * sgl
        msk = (pp < nl)[:, None] & cm[None, :]
        dy = tl.load(pd + doff, mask=msk, other=0.0)
        x = tl.load(px + xoff, mask=msk, other=0.0)
        for lb in range(0, nl, BLOCK_P):
            pd += BLOCK_P * sdl
            px += BLOCK_P * sxl
            m1 = ((lb + BLOCK_P + pp) < nl)[:, None] & cm[None, :]
            dyn = tl.load(pd + doff, mask=m1, other=0.0)
            xn = tl.load(px + xoff, mask=m1, other=0.0)
            xhat = (x.to(ACC) - mean) * rstd
            dz = dy.to(ACC)
            if SILU:
                z = xhat * w2 + b2
                sg = 1.0 / (1.0 + tl.exp(-z))
                dz = dz * sg * (1.0 + z * (1.0 - sg))
            dx = rstd * (dz * w2 - (xhat * k1 + k2))
            tl.store(pg + goff, dx.to(pg.dtype.element_ty), mask=((lb + pp) < nl)[:, None] & cm[None, :])
            pg += BLOCK_P * sgl
            dy = dyn
            x = xn
    if STORE_DW:
        if p >= (N + 1) * S:
            _wait(CNT + 1, N * S)
            _tail_dwdb(PWN, DW, DB, N, C, p - (N + 1) * S, HAS_W, HAS_B, BLOCK_R, BLOCK_CT)
            _leave(CNT + 1, N * S + E - 1)
