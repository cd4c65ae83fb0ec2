"""Triton kernels of GroupNorm (+ optional fused SiLU), forward and backward, NCHW and channels-last.

The input is viewed as ``(N, C, L)`` (``L`` = the spatial dims, which must collapse into one stride)
with arbitrary strides ``(sn, sc, sl)``: NCHW has ``sl == 1``, channels-last has ``sc == 1``. The
same kernels serve both layouts without converting; the launcher picks tiles that keep the unit
stride inside a tile (``(BLOCK_D, BLOCK_L)`` tiles of a group's ``D = C / G`` channels by ``L``
positions). Group ``(n, g)`` holds ``D * L`` elements.

Two schedules:

* fused (one program per group, when there are enough groups to fill the GPU): the program reads
  its group once for the statistics and again to normalize. The second read comes from L2 (the
  group was just read by the same program), so DRAM sees one read and one write: the minimum.
  The backward likewise reads ``(x, dy)`` twice and writes ``dx`` once. The second read only hits
  L2 while (groups in flight) x (group bytes) fits in it, so for large groups the launcher caps the
  number of programs and each loops over several groups.
* split (few groups: small batches): each group is cut into ``S`` chunks of ``L``. A stats kernel
  writes a partial ``(mean, M2)`` per ``(n, g, chunk)``; the normalize kernel merges the ``S``
  partials of its group itself (Chan's parallel formula, exact) and normalizes its chunk. The
  backward's reduce kernel writes per-chunk partial sums, its dx kernel merges them.

Statistics: fp32 (fp64 for fp64 inputs) sums of ``x - K``, ``K`` the mean of the group's (chunk's)
first tile, which removes the cancellation of the plain sum-of-squares formula. The weight/bias
gradients are per-``(n, c)`` (per ``(n, chunk, c)`` when split) partial sums reduced over the rows by
``_gn_dwdb_kernel``, in a fixed order (bitwise reproducible; no atomics anywhere).

Pointers advance by small increments inside the loops, so no product of a loop index and a stride
overflows 32 bits however large the tensor; the per-group base offsets are computed in int64.
``tl.cast`` (not ``.to``) converts sizes such as ``L * D``: Triton turns an integer argument equal to 1
(``L`` of an ``(N, C)`` input) into a constant, which has no ``.to``.
"""

import triton
import triton.language as tl


@triton.jit
def _group_base(P, n, g, l0, sn, sc, sl, D: tl.constexpr):
    """Address of element ``(n, g * D, l0)``; ``n``, ``g``, ``l0`` are program-derived tensors."""
    return P + n.to(tl.int64) * sn + (g * D).to(tl.int64) * sc + l0.to(tl.int64) * sl


@triton.jit
def _group_stats(xp, sc, sl, length, D: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_L: tl.constexpr):
    """``(mean, M2)`` of the ``D x length`` block at ``xp`` (``M2`` = sum of squared deviations)."""
    dd = tl.arange(0, BLOCK_D)
    ll = tl.arange(0, BLOCK_L)
    voff = dd[:, None] * sc + ll[None, :] * sl
    m0 = (dd < D)[:, None] & (ll < length)[None, :]
    x0 = tl.load(xp + voff, mask=m0, other=0.0).to(ACC)
    n0 = tl.maximum(tl.minimum(length, BLOCK_L), 1) * (D if D < BLOCK_D else BLOCK_D)
    k = tl.sum(tl.sum(x0, axis=1), axis=0) / tl.cast(n0, ACC)
    acc1 = tl.zeros([BLOCK_D, BLOCK_L], dtype=ACC)
    acc2 = tl.zeros([BLOCK_D, BLOCK_L], dtype=ACC)
    pd = xp
    for d0 in range(0, D, BLOCK_D):
        dmask = (d0 + dd) < D
        p = pd
        for lb in range(0, length, BLOCK_L):
            m = dmask[:, None] & ((lb + ll) < length)[None, :]
            x = tl.load(p + voff, mask=m, other=0.0).to(ACC)
            dlt = tl.where(m, x - k, 0.0)
            acc1 += dlt
            acc2 += dlt * dlt
            p += BLOCK_L * sl
        pd += BLOCK_D * sc
    cnt = tl.cast(length * D, ACC)
    s1 = tl.sum(tl.sum(acc1, axis=1), axis=0)
    s2 = tl.sum(tl.sum(acc2, axis=1), axis=0)
    return k + s1 / cnt, tl.maximum(s2 - s1 * s1 / cnt, 0.0)


@triton.jit
def _affine(WP, BP, ch, dmask, ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """Per-channel weight (1 without) and bias (0 without) of channels ``ch`` of the group."""
    w = tl.full(ch.shape, 1.0, ACC)
    b = tl.zeros(ch.shape, ACC)
    if HAS_W:
        w = tl.load(WP + ch, mask=dmask, other=0.0).to(ACC)
    if HAS_B:
        b = tl.load(BP + ch, mask=dmask, other=0.0).to(ACC)
    return w, b


@triton.jit
def _normalize(xp, yp, WP, BP, sxc, sxl, syc, syl, mean, rstd, length, D: tl.constexpr, ACC: tl.constexpr,
               HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_L: tl.constexpr):
    """``y = silu?((x - mean) * rstd * w + b)`` over the ``D x length`` block at ``xp`` / ``yp``."""
    dd = tl.arange(0, BLOCK_D)
    ll = tl.arange(0, BLOCK_L)
    xoff = dd[:, None] * sxc + ll[None, :] * sxl
    yoff = dd[:, None] * syc + ll[None, :] * syl
    pxd = xp
    pyd = yp
    for d0 in range(0, D, BLOCK_D):
        ch = d0 + dd
        dmask = ch < D
        w, b = _affine(WP, BP, ch, dmask, ACC, HAS_W, HAS_B)
        scale = (w * rstd)[:, None]
        shift = b[:, None]
        px = pxd
        py = pyd
        for lb in range(0, length, BLOCK_L):
            m = dmask[:, None] & ((lb + ll) < length)[None, :]
            x = tl.load(px + xoff, mask=m, other=0.0).to(ACC)
            y = (x - mean) * scale + shift
            if SILU:
                y = y / (1.0 + tl.exp(-y))
            tl.store(py + yoff, y.to(py.dtype.element_ty), mask=m)
            px += BLOCK_L * sxl
            py += BLOCK_L * syl
        pxd += BLOCK_D * sxc
        pyd += BLOCK_D * syc


@triton.jit
def _dz(dy, xhat, w, b, SILU: tl.constexpr):
    """Gradient at the pre-activation ``z = xhat * w + b`` (``dy`` itself without SiLU)."""
    if SILU:
        z = xhat * w[:, None] + b[:, None]
        sg = 1.0 / (1.0 + tl.exp(-z))
        dy = dy * sg * (1.0 + z * (1.0 - sg))
    return dy


@triton.jit
def _bwd_sums(dyp, xp, WP, BP, PW, PB, sdc, sdl, sxc, sxl, mean, rstd, length, D: tl.constexpr,
              ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
              STORE_DW: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Pass 1 of the backward over the ``D x length`` block: per-channel ``sum(dz * xhat)`` and ``sum(dz)``
    (stored to ``PW`` / ``PB`` with ``STORE_DW``) and the block's ``c1 = sum(dz * w * xhat)``,
    ``c2 = sum(dz * w)``."""
    dd = tl.arange(0, BLOCK_D)
    ll = tl.arange(0, BLOCK_L)
    doff = dd[:, None] * sdc + ll[None, :] * sdl
    xoff = dd[:, None] * sxc + ll[None, :] * sxl
    c1 = tl.zeros([BLOCK_D], dtype=ACC)
    c2 = tl.zeros([BLOCK_D], dtype=ACC)
    pdd = dyp
    pxd = xp
    for d0 in range(0, D, BLOCK_D):
        ch = d0 + dd
        dmask = ch < D
        w, b = _affine(WP, BP, ch, dmask, ACC, HAS_W, HAS_B)
        a1 = tl.zeros([BLOCK_D, BLOCK_L], dtype=ACC)
        a2 = tl.zeros([BLOCK_D, BLOCK_L], dtype=ACC)
        pd = pdd
        px = pxd
        for lb in range(0, length, BLOCK_L):
            m = dmask[:, None] & ((lb + ll) < length)[None, :]
            dy = tl.load(pd + doff, mask=m, other=0.0).to(ACC)
            x = tl.load(px + xoff, mask=m, other=0.0).to(ACC)
            xhat = (x - mean) * rstd
            dz = _dz(dy, xhat, w, b, SILU)
            a1 += dz * xhat
            a2 += dz
            pd += BLOCK_L * sdl
            px += BLOCK_L * sxl
        dwc = tl.sum(a1, axis=1)
        dbc = tl.sum(a2, axis=1)
        if STORE_DW:
            tl.store(PW + ch, dwc, mask=dmask)
            tl.store(PB + ch, dbc, mask=dmask)
        c1 += tl.where(dmask, dwc * w, 0.0)
        c2 += tl.where(dmask, dbc * w, 0.0)
        pdd += BLOCK_D * sdc
        pxd += BLOCK_D * sxc
    return tl.sum(c1, axis=0), tl.sum(c2, axis=0)


@triton.jit
def _bwd_dx(dyp, xp, dxp, WP, BP, sdc, sdl, sxc, sxl, sgc, sgl, mean, rstd, c1, c2, cnt, length,
            D: tl.constexpr, ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Pass 2: ``dx = rstd * (dz * w - (xhat * c1 + c2) / cnt)`` over the ``D x length`` block."""
    dd = tl.arange(0, BLOCK_D)
    ll = tl.arange(0, BLOCK_L)
    doff = dd[:, None] * sdc + ll[None, :] * sdl
    xoff = dd[:, None] * sxc + ll[None, :] * sxl
    goff = dd[:, None] * sgc + ll[None, :] * sgl
    k1 = c1 / cnt
    k2 = c2 / cnt
    pdd = dyp
    pxd = xp
    pgd = dxp
    for d0 in range(0, D, BLOCK_D):
        ch = d0 + dd
        dmask = ch < D
        w, b = _affine(WP, BP, ch, dmask, ACC, HAS_W, HAS_B)
        pd = pdd
        px = pxd
        pg = pgd
        for lb in range(0, length, BLOCK_L):
            m = dmask[:, None] & ((lb + ll) < length)[None, :]
            dy = tl.load(pd + doff, mask=m, other=0.0).to(ACC)
            x = tl.load(px + xoff, mask=m, other=0.0).to(ACC)
            xhat = (x - mean) * rstd
            dz = _dz(dy, xhat, w, b, SILU)
            dx = rstd * (dz * w[:, None] - (xhat * k1 + k2))
            tl.store(pg + goff, dx.to(pg.dtype.element_ty), mask=m)
            pd += BLOCK_L * sdl
            px += BLOCK_L * sxl
            pg += BLOCK_L * sgl
        pdd += BLOCK_D * sdc
        pxd += BLOCK_D * sxc
        pgd += BLOCK_D * sgc


@triton.jit
def _merge(PART, row, S, Lc, L, D: tl.constexpr, ACC: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the ``S`` chunk partials ``(mean, M2)`` of one group (row ``row`` of ``PART``): Chan's formula."""
    ss = tl.arange(0, BLOCK_S)
    ok = ss < S
    base = PART + row.to(tl.int64) * S * 2
    m = tl.load(base + ss * 2, mask=ok, other=0.0)
    q = tl.load(base + ss * 2 + 1, mask=ok, other=0.0)
    cnt = tl.where(ok, tl.minimum(Lc, L - ss * Lc) * D, 0).to(ACC)
    tot = tl.sum(cnt, axis=0)
    mean = tl.sum(m * cnt, axis=0) / tot
    dm = tl.where(ok, m - mean, 0.0)
    return mean, tl.sum(q + cnt * dm * dm, axis=0), tot


@triton.jit
def _gn_fwd_fused_kernel(X, Y, W, B, MEAN, RSTD, NG, G, L, sxn, sxc, sxl, syn, syc, syl, eps,
                         D: tl.constexpr, ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                         SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``p`` handles groups ``p, p + P, ...`` of the ``NG = N * G``: statistics of group ``(n, g)``,
    then its normalized (+ SiLU) output."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for t in range(0, tl.cdiv(NG - pid, nprog)):
        grp = pid + t * nprog  # a tensor (a loop index would be an int under the interpreter)
        n = grp // G
        g = grp - n * G
        zero = grp * 0
        xp = _group_base(X, n, g, zero, sxn, sxc, sxl, D)
        mean, m2 = _group_stats(xp, sxc, sxl, L, D, ACC, BLOCK_D, BLOCK_L)
        rstd = 1.0 / tl.sqrt(m2 / tl.cast(L * D, ACC) + eps)
        tl.store(MEAN + grp, mean)
        tl.store(RSTD + grp, rstd)
        _normalize(xp, _group_base(Y, n, g, zero, syn, syc, syl, D), W + g * D, B + g * D, sxc, sxl, syc, syl,
                   mean, rstd, L, D, ACC, HAS_W, HAS_B, SILU, BLOCK_D, BLOCK_L)


@triton.jit
def _gn_stats_kernel(X, PART, G, L, Lc, sxn, sxc, sxl, D: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``(n * G + g, s)``: ``(mean, M2)`` of chunk ``s`` (positions ``[s Lc, (s+1) Lc)``) of group
    ``(n, g)``."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    n = pid // G
    g = pid - n * G
    l0 = s * Lc
    mean, m2 = _group_stats(_group_base(X, n, g, l0, sxn, sxc, sxl, D), sxc, sxl, tl.minimum(Lc, L - l0), D, ACC,
                            BLOCK_D, BLOCK_L)
    out = PART + (pid.to(tl.int64) * S + s) * 2
    tl.store(out, mean)
    tl.store(out + 1, m2)


@triton.jit
def _gn_fwd_split_kernel(X, Y, W, B, PART, MEAN, RSTD, G, L, Lc, sxn, sxc, sxl, syn, syc, syl, eps,
                         D: tl.constexpr, ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                         SILU: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``(n * G + g, s)``: merge the group's partials, normalize chunk ``s``; chunk 0 stores the stats."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    n = pid // G
    g = pid - n * G
    mean, m2, tot = _merge(PART, pid, S, Lc, L, D, ACC, BLOCK_S)
    rstd = 1.0 / tl.sqrt(m2 / tot + eps)
    if s == 0:
        tl.store(MEAN + pid, mean)
        tl.store(RSTD + pid, rstd)
    l0 = s * Lc
    _normalize(_group_base(X, n, g, l0, sxn, sxc, sxl, D), _group_base(Y, n, g, l0, syn, syc, syl, D), W + g * D,
               B + g * D, sxc, sxl, syc, syl, mean, rstd, tl.minimum(Lc, L - l0), D, ACC, HAS_W, HAS_B, SILU,
               BLOCK_D, BLOCK_L)


@triton.jit
def _gn_bwd_fused_kernel(DY, X, DX, W, B, MEAN, RSTD, PW, PLANE, NG, G, L, C, sdn, sdc, sdl, sxn, sxc, sxl, sgn, sgc,
                         sgl, D: tl.constexpr, ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                         SILU: tl.constexpr, STORE_DW: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``p`` handles groups ``p, p + P, ...``: the backward of group ``(n, g)``: pass 1 reduces (and
    stores the per-channel partials ``PW[n, c]`` and ``PB[n, c]`` = ``PW[PLANE + n * C + c]``), pass 2 writes
    ``dx``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for t in range(0, tl.cdiv(NG - pid, nprog)):
        grp = pid + t * nprog
        n = grp // G
        g = grp - n * G
        zero = grp * 0
        mean = tl.load(MEAN + grp)
        rstd = tl.load(RSTD + grp)
        dyp = _group_base(DY, n, g, zero, sdn, sdc, sdl, D)
        xp = _group_base(X, n, g, zero, sxn, sxc, sxl, D)
        prow = n.to(tl.int64) * C + g * D
        c1, c2 = _bwd_sums(dyp, xp, W + g * D, B + g * D, PW + prow, PW + PLANE + prow, sdc, sdl, sxc, sxl, mean,
                           rstd, L, D, ACC, HAS_W, HAS_B, SILU, STORE_DW, BLOCK_D, BLOCK_L)
        _bwd_dx(dyp, xp, _group_base(DX, n, g, zero, sgn, sgc, sgl, D), W + g * D, B + g * D, sdc, sdl, sxc, sxl,
                sgc, sgl, mean, rstd, c1, c2, tl.cast(L * D, ACC), L, D, ACC, HAS_W, HAS_B, SILU, BLOCK_D, BLOCK_L)


@triton.jit
def _gn_bwd_reduce_kernel(DY, X, W, B, MEAN, RSTD, PW, PLANE, PC, G, L, Lc, C, sdn, sdc, sdl, sxn, sxc, sxl,
                          D: tl.constexpr, ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                          SILU: tl.constexpr, STORE_DW: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``(n * G + g, s)``: pass 1 over chunk ``s``: per-channel partials to row ``n * S + s`` of
    ``PW`` (and ``PB`` = ``PW + PLANE``) and the chunk's ``(c1, c2)`` to ``PC``."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    n = pid // G
    g = pid - n * G
    l0 = s * Lc
    mean = tl.load(MEAN + pid)
    rstd = tl.load(RSTD + pid)
    prow = (n.to(tl.int64) * S + s) * C + g * D
    c1, c2 = _bwd_sums(_group_base(DY, n, g, l0, sdn, sdc, sdl, D), _group_base(X, n, g, l0, sxn, sxc, sxl, D),
                       W + g * D, B + g * D, PW + prow, PW + PLANE + prow, sdc, sdl, sxc, sxl, mean, rstd,
                       tl.minimum(Lc, L - l0), D, ACC, HAS_W, HAS_B, SILU, STORE_DW, BLOCK_D, BLOCK_L)
    out = PC + (pid.to(tl.int64) * S + s) * 2
    tl.store(out, c1)
    tl.store(out + 1, c2)


@triton.jit
def _gn_bwd_dx_kernel(DY, X, DX, W, B, MEAN, RSTD, PC, G, L, Lc, sdn, sdc, sdl, sxn, sxc, sxl, sgn, sgc, sgl,
                      D: tl.constexpr, ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                      SILU: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``(n * G + g, s)``: sum the group's ``S`` partial ``(c1, c2)``, write ``dx`` of chunk ``s``."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    n = pid // G
    g = pid - n * G
    ss = tl.arange(0, BLOCK_S)
    base = PC + pid.to(tl.int64) * S * 2
    c1 = tl.sum(tl.load(base + ss * 2, mask=ss < S, other=0.0), axis=0)
    c2 = tl.sum(tl.load(base + ss * 2 + 1, mask=ss < S, other=0.0), axis=0)
    l0 = s * Lc
    mean = tl.load(MEAN + pid)
    rstd = tl.load(RSTD + pid)
    _bwd_dx(_group_base(DY, n, g, l0, sdn, sdc, sdl, D), _group_base(X, n, g, l0, sxn, sxc, sxl, D),
            _group_base(DX, n, g, l0, sgn, sgc, sgl, D), W + g * D, B + g * D, sdc, sdl, sxc, sxl, sgc, sgl, mean,
            rstd, c1, c2, tl.cast(L * D, ACC), tl.minimum(Lc, L - l0), D, ACC, HAS_W, HAS_B, SILU, BLOCK_D, BLOCK_L)


@triton.jit
def _gn_dwdb_kernel(PW, DW, DB, R, C, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """``DW[c] = sum_r PW[r, c]`` and ``DB[c] = sum_r PB[r, c]`` over the ``R`` partial rows, in row order
    (``PB`` is the plane after ``PW``: ``PW + R * C``)."""
    PB = PW + R * C
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < C
    rr = tl.arange(0, BLOCK_R)
    aw = tl.zeros([BLOCK_R, BLOCK_C], dtype=PW.dtype.element_ty)
    ab = tl.zeros([BLOCK_R, BLOCK_C], dtype=PW.dtype.element_ty)
    for r in range(0, R, BLOCK_R):
        rows = r + rr
        m = (rows < R)[:, None] & ok[None, :]
        off = rows.to(tl.int64)[:, None] * C + cols[None, :]
        if HAS_W:
            aw += tl.load(PW + off, mask=m, other=0.0)
        if HAS_B:
            ab += tl.load(PB + off, mask=m, other=0.0)
    if HAS_W:
        tl.store(DW + cols, tl.sum(aw, axis=0).to(DW.dtype.element_ty), mask=ok)
    if HAS_B:
        tl.store(DB + cols, tl.sum(ab, axis=0).to(DB.dtype.element_ty), mask=ok)
