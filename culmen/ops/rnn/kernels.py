"""Triton kernels of the fused LSTM and GRU pointwise cells (one time step, forward and backward).

The GEMMs of a recurrent step stay in cuBLAS; what these kernels fuse is everything between them:
the gate nonlinearities and the state update (forward), and the whole chain rule back to the
pre-activation gates (backward), each in one pass over the ``(B, H)`` step instead of a dozen eager ops.

Layouts (every tensor is one time step, rows contiguous):

* LSTM gates ``G (B, 4H)`` in PyTorch's order ``[i | f | g | o]``, already holding
  ``x W_ih^T + b_ih + h W_hh^T + b_hh``. The forward writes the *activated* gates to ``WS (B, 4H)``
  (which may be ``G`` itself: each element is read before it is written by the same program) and
  ``h``, ``c`` ``(B, H)``. The backward reads ``WS``, ``c_prev``, ``c``, ``dh`` and the incoming cell
  gradient ``dc`` and writes the pre-activation gradient ``DG (B, 4H)`` and ``dc_prev`` (which may alias
  ``dc``: same element, same program).
* GRU input gates ``XG (B, 3H)`` (``x W_ih^T + b_ih``) and hidden gates ``HG (B, 3H)`` (``h W_hh^T + b_hh``),
  order ``[r | z | n]``: ``r = s(xr + hr)``, ``z = s(xz + hz)``, ``n = tanh(xn + r hn)``,
  ``h' = n + z (h - n)``. The forward writes ``r, z, n`` to ``WS (B, 3H)`` (may be ``XG``) and ``h'``.
  The backward writes ``DXG`` (gradient of ``XG``), ``DHG`` (of ``HG``; its ``n`` block is ``r`` times
  ``DXG``'s) and the direct part ``dh z`` of the gradient of ``h`` (plus an optional ``dy`` of the previous
  step, so the caller's GEMM adds the recurrent part in place).

Programs tile ``(BLOCK_B, BLOCK_H)`` of the ``(B, H)`` step; the math runs in fp32 (fp64 for fp64 tensors)
whatever the storage dtype, and stores cast to each output's own dtype (the sequence path keeps the
cell-gradient carry in fp32).
"""

import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflow gives 1, underflow -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _tile(B, H, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(1).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < B)[:, None] & (cols < H)[None, :]
    return rows[:, None], cols[None, :], mask


@triton.jit(do_not_specialize=["B"])
def _lstm_fwd_kernel(G, WS, C_PREV, H_OUT, C_OUT, B, H, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """One LSTM step: activated gates to ``WS``, ``c = f c_prev + i g`` and ``h = o tanh(c)``."""
    r, j, mask = _tile(B, H, BLOCK_B, BLOCK_H)
    cd: tl.constexpr = tl.float64 if G.dtype.element_ty == tl.float64 else tl.float32
    g_off = r * (4 * H) + j
    s_off = r * H + j
    gi = tl.load(G + g_off, mask=mask, other=0.0).to(cd)
    gf = tl.load(G + g_off + H, mask=mask, other=0.0).to(cd)
    gg = tl.load(G + g_off + 2 * H, mask=mask, other=0.0).to(cd)
    go = tl.load(G + g_off + 3 * H, mask=mask, other=0.0).to(cd)
    cp = tl.load(C_PREV + s_off, mask=mask, other=0.0).to(cd)
    i = _sigmoid(gi)
    f = _sigmoid(gf)
    g = _tanh(gg)
    o = _sigmoid(go)
    c = f * cp + i * g
    h = o * _tanh(c)
    dt = WS.dtype.element_ty
    tl.store(WS + g_off, i.to(dt), mask=mask)
    tl.store(WS + g_off + H, f.to(dt), mask=mask)
    tl.store(WS + g_off + 2 * H, g.to(dt), mask=mask)
    tl.store(WS + g_off + 3 * H, o.to(dt), mask=mask)
    tl.store(C_OUT + s_off, c.to(C_OUT.dtype.element_ty), mask=mask)
    tl.store(H_OUT + s_off, h.to(H_OUT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B"])
def _lstm_bwd_kernel(WS, C_PREV, C, DH, DC, DCX, DG, DC_PREV, B, H, HAS_DCX: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """Backward of one LSTM step.

    ``dc = DC + DCX + dh o (1 - tanh(c)^2)`` (``DCX``: a gradient reaching this step's ``c`` from outside
    the recurrence), then the pre-activation gate gradients into ``DG`` and ``dc f`` into ``DC_PREV``.
    """
    r, j, mask = _tile(B, H, BLOCK_B, BLOCK_H)
    cd: tl.constexpr = tl.float64 if WS.dtype.element_ty == tl.float64 else tl.float32
    g_off = r * (4 * H) + j
    s_off = r * H + j
    i = tl.load(WS + g_off, mask=mask, other=0.0).to(cd)
    f = tl.load(WS + g_off + H, mask=mask, other=0.0).to(cd)
    g = tl.load(WS + g_off + 2 * H, mask=mask, other=0.0).to(cd)
    o = tl.load(WS + g_off + 3 * H, mask=mask, other=0.0).to(cd)
    cp = tl.load(C_PREV + s_off, mask=mask, other=0.0).to(cd)
    c = tl.load(C + s_off, mask=mask, other=0.0).to(cd)
    dh = tl.load(DH + s_off, mask=mask, other=0.0).to(cd)
    dc = tl.load(DC + s_off, mask=mask, other=0.0).to(cd)
    if HAS_DCX:
        dc += tl.load(DCX + s_off, mask=mask, other=0.0).to(cd)
    tc = _tanh(c)
    dc += dh * o * (1.0 - tc * tc)
    dt = DG.dtype.element_ty
    tl.store(DG + g_off, (dc * g * i * (1.0 - i)).to(dt), mask=mask)
    tl.store(DG + g_off + H, (dc * cp * f * (1.0 - f)).to(dt), mask=mask)
    tl.store(DG + g_off + 2 * H, (dc * i * (1.0 - g * g)).to(dt), mask=mask)
    tl.store(DG + g_off + 3 * H, (dh * tc * o * (1.0 - o)).to(dt), mask=mask)
    tl.store(DC_PREV + s_off, (dc * f).to(DC_PREV.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B"])
def _gru_fwd_kernel(XG, HG, H_PREV, WS, H_OUT, B, H, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """One GRU step: ``r, z, n`` to ``WS`` and ``h' = n + z (h - n)`` to ``H_OUT``."""
    r_, j, mask = _tile(B, H, BLOCK_B, BLOCK_H)
    cd: tl.constexpr = tl.float64 if XG.dtype.element_ty == tl.float64 else tl.float32
    g_off = r_ * (3 * H) + j
    s_off = r_ * H + j
    xr = tl.load(XG + g_off, mask=mask, other=0.0).to(cd)
    xz = tl.load(XG + g_off + H, mask=mask, other=0.0).to(cd)
    xn = tl.load(XG + g_off + 2 * H, mask=mask, other=0.0).to(cd)
    hr = tl.load(HG + g_off, mask=mask, other=0.0).to(cd)
    hz = tl.load(HG + g_off + H, mask=mask, other=0.0).to(cd)
    hn = tl.load(HG + g_off + 2 * H, mask=mask, other=0.0).to(cd)
    hp = tl.load(H_PREV + s_off, mask=mask, other=0.0).to(cd)
    r = _sigmoid(xr + hr)
    z = _sigmoid(xz + hz)
    n = _tanh(xn + r * hn)
    h = n + z * (hp - n)
    dt = WS.dtype.element_ty
    tl.store(WS + g_off, r.to(dt), mask=mask)
    tl.store(WS + g_off + H, z.to(dt), mask=mask)
    tl.store(WS + g_off + 2 * H, n.to(dt), mask=mask)
    tl.store(H_OUT + s_off, h.to(H_OUT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B"])
def _gru_bwd_kernel(WS, HG, H_PREV, DH, DY_PREV, DXG, DHG, DHD, B, H, HAS_DY_PREV: tl.constexpr,
                    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """Backward of one GRU step: ``DXG``, ``DHG`` and ``DHD = dh z (+ DY_PREV)``, the part of the previous
    hidden state's gradient that does not go through ``HG``."""
    r_, j, mask = _tile(B, H, BLOCK_B, BLOCK_H)
    cd: tl.constexpr = tl.float64 if WS.dtype.element_ty == tl.float64 else tl.float32
    g_off = r_ * (3 * H) + j
    s_off = r_ * H + j
    r = tl.load(WS + g_off, mask=mask, other=0.0).to(cd)
    z = tl.load(WS + g_off + H, mask=mask, other=0.0).to(cd)
    n = tl.load(WS + g_off + 2 * H, mask=mask, other=0.0).to(cd)
    hn = tl.load(HG + g_off + 2 * H, mask=mask, other=0.0).to(cd)
    hp = tl.load(H_PREV + s_off, mask=mask, other=0.0).to(cd)
    dh = tl.load(DH + s_off, mask=mask, other=0.0).to(cd)
    dn = dh * (1.0 - z) * (1.0 - n * n)
    dz = dh * (hp - n) * z * (1.0 - z)
    dr = dn * hn * r * (1.0 - r)
    dt = DXG.dtype.element_ty
    tl.store(DXG + g_off, dr.to(dt), mask=mask)
    tl.store(DXG + g_off + H, dz.to(dt), mask=mask)
    tl.store(DXG + g_off + 2 * H, dn.to(dt), mask=mask)
    dt2 = DHG.dtype.element_ty
    tl.store(DHG + g_off, dr.to(dt2), mask=mask)
    tl.store(DHG + g_off + H, dz.to(dt2), mask=mask)
    tl.store(DHG + g_off + 2 * H, (dn * r).to(dt2), mask=mask)
    dhd = dh * z
    if HAS_DY_PREV:
        dhd += tl.load(DY_PREV + s_off, mask=mask, other=0.0).to(cd)
    tl.store(DHD + s_off, dhd.to(DHD.dtype.element_ty), mask=mask)
