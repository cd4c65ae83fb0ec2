"""The time loops of one LSTM / GRU layer, forward and backward, on caller-provided buffers.

Each loop is a straight sequence of per-step launches (one recurrent GEMM and one fused cell per step)
that reads and writes only the tensors it is handed and allocates nothing on the device. The same
function therefore serves the eager path (fresh tensors every call) and the CUDA-graph path
(``graphs.py`` captures it once on static buffers and replays it).

Host cost per step is what made the eager layer slow (T steps x a GEMM call and a kernel launch), so the
loops keep their step bodies minimal: every per-step tensor view is made up front by one ``unbind``, the
steps are walked with ``zip`` in the order they run, the launch is the plan's pre-bound callable (no
backend branch), every GEMM writes into its destination (in place or ``out=``), and the steps run under
``torch.inference_mode`` (the autograd and view-tracking dispatch layers are skipped: the loops run inside
an autograd node's forward or backward, never recorded).

Layouts (time first, every step a contiguous ``(B, n)`` slice):
* LSTM: ``G (T, B, 4H)`` holds ``x W_ih^T + b`` on entry and the activated gates ``[i, f, g, o]`` on exit;
  ``Y``, ``CS (T, B, H)`` every step's ``h`` and ``c``.
* GRU: ``XG (T, B, 3H)`` holds ``x W_ih^T + b_ih`` on entry and ``[r, z, n]`` on exit; ``HG (T, B, 3H)``
  gets ``h_prev W_hh^T + b_hh``; ``Y (T, B, H)``.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from culmen.ops.common.launch import aligned_16
from culmen.ops.rnn.launch import CellPlan


def step_aligned(B: int, H: int, es: int, *bases: Tensor) -> bool:
    """Whether every step slice of every base is 16-byte aligned: each starts a whole number of ``(B, H)``
    (or ``(B, 3H)``, ``(B, 4H)``) blocks past its base."""
    return (B * H * es) % 16 == 0 and aligned_16(*bases)


def _in_order(seq: tuple, reverse: bool, backward: bool) -> tuple:
    """``seq`` (indexed by time) in the order the loop visits it: forward walks ``0..T-1`` (``T-1..0`` when
    ``reverse``), backward the other way."""
    return seq[::-1] if reverse != backward else seq


def lstm_fwd_loop(plan: CellPlan, G: Tensor, Y: Tensor, CS: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor,
                  reverse: bool) -> None:
    """Run the LSTM recurrence: per step ``G[t] += h_prev W_hh^T`` then the fused cell (activated gates into
    ``G[t]``, ``h`` into ``Y[t]``, ``c`` into ``CS[t]``)."""
    _, B, H = Y.shape
    stream = plan.stream()
    aligned = step_aligned(B, H, Y.element_size(), G, Y, CS, h0, c0)
    fwd = plan.fwd
    w_t = w_hh.t()
    h_prev, c_prev = h0, c0
    with torch.inference_mode():
        for g, h, c in zip(_in_order(G.unbind(0), reverse, False), _in_order(Y.unbind(0), reverse, False),
                           _in_order(CS.unbind(0), reverse, False)):
            g.addmm_(h_prev, w_t)
            fwd(stream, aligned, g, g, c_prev, h, c, B, H)
            h_prev, c_prev = h, c


def lstm_bwd_loop(plan: CellPlan, G: Tensor, CS: Tensor, dY: Tensor, dCS: Tensor | None, c0: Tensor, w_hh: Tensor,
                  reverse: bool, dG: Tensor, dc: Tensor, dh_buf: Tensor, dh0: Tensor | None) -> None:
    """Walk the LSTM steps backwards: gate gradients into ``dG``; on return ``dc`` (the fp32 carry, zeroed
    here) holds the gradient of ``c0`` and ``dh0`` (when given) that of ``h0``. ``dCS``: gradients reaching
    every step's ``c`` from outside the recurrence, or ``None``. ``dh_buf`` ``(B, H)`` is scratch."""
    T, B, H = dY.shape
    stream = plan.stream()
    aligned = step_aligned(B, H, dY.element_size(), G, CS, dY, dG, dc, dh_buf, c0,
                           dCS if dCS is not None else dY)
    bwd = plan.bwd[dCS is not None]
    with torch.inference_mode():
        _lstm_bwd_steps(bwd, stream, aligned, B, H, G, CS, dY, dCS, c0, w_hh, reverse, dG, dc, dh_buf, dh0)


def _lstm_bwd_steps(bwd, stream, aligned, B, H, G, CS, dY, dCS, c0, w_hh, reverse, dG, dc, dh_buf, dh0) -> None:
    dc.zero_()
    g_s = _in_order(G.unbind(0), reverse, True)
    c_s = _in_order(CS.unbind(0), reverse, True)
    dy_s = _in_order(dY.unbind(0), reverse, True)
    dg_s = _in_order(dG.unbind(0), reverse, True)
    dcx_s = _in_order(dCS.unbind(0), reverse, True) if dCS is not None else itertools.repeat(dc)
    # Step k of the backward walk reads the state and output gradient of step k + 1 (its predecessor in
    # time); the last one reads the initial state.
    dh = dy_s[0]
    for g, c_prev, c, dcx, dg, dy_prev in zip(g_s, c_s[1:], c_s, dcx_s, dg_s, dy_s[1:]):
        bwd(stream, aligned, g, c_prev, c, dh, dc, dcx, dg, dc, B, H)
        dh = torch.addmm(dy_prev, dg, w_hh, out=dh_buf)
    dcx = dc if dCS is None else dcx_s[-1]
    bwd(stream, aligned, g_s[-1], c0, c_s[-1], dh, dc, dcx, dg_s[-1], dc, B, H)
    if dh0 is not None:
        torch.mm(dg_s[-1], w_hh, out=dh0)


def gru_fwd_loop(plan: CellPlan, XG: Tensor, HG: Tensor, Y: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
                 reverse: bool) -> None:
    """Run the GRU recurrence: per step ``HG[t] = h_prev W_hh^T + b_hh`` then the fused cell (``r, z, n`` into
    ``XG[t]``, ``h`` into ``Y[t]``)."""
    _, B, H = Y.shape
    stream = plan.stream()
    aligned = step_aligned(B, H, Y.element_size(), XG, HG, Y, h0)
    fwd = plan.fwd
    w_t = w_hh.t()
    with torch.inference_mode():
        _gru_fwd_steps(fwd, stream, aligned, B, H, XG, HG, Y, h0, w_t, b_hh, reverse)


def _gru_fwd_steps(fwd, stream, aligned, B, H, XG, HG, Y, h0, w_t, b_hh, reverse) -> None:
    h_prev = h0
    steps = zip(_in_order(XG.unbind(0), reverse, False), _in_order(HG.unbind(0), reverse, False),
                _in_order(Y.unbind(0), reverse, False))
    if b_hh is None:
        for xg, hg, h in steps:
            torch.mm(h_prev, w_t, out=hg)
            fwd(stream, aligned, xg, hg, h_prev, xg, h, B, H)
            h_prev = h
    else:
        for xg, hg, h in steps:
            torch.addmm(b_hh, h_prev, w_t, out=hg)
            fwd(stream, aligned, xg, hg, h_prev, xg, h, B, H)
            h_prev = h


def gru_bwd_loop(plan: CellPlan, WS: Tensor, HG: Tensor, Y: Tensor, dY: Tensor, h0: Tensor, w_hh: Tensor,
                 reverse: bool, dXG: Tensor, dHG: Tensor, dhd: Tensor, dh_buf: Tensor) -> Tensor:
    """Walk the GRU steps backwards (``WS``: the ``r, z, n`` the forward left in ``XG``): gradients of the
    input and hidden gates into ``dXG`` / ``dHG``. Returns ``dh_buf``, which then holds the gradient of
    ``h0``; ``dhd`` ``(B, H)`` is scratch."""
    _, B, H = dY.shape
    stream = plan.stream()
    aligned = step_aligned(B, H, dY.element_size(), WS, HG, Y, h0, dY, dXG, dHG, dhd, dh_buf)
    with torch.inference_mode():
        _gru_bwd_steps(plan.bwd[True], plan.bwd[False], stream, aligned, B, H, WS, HG, Y, dY, h0, w_hh, reverse,
                       dXG, dHG, dhd, dh_buf)
    return dh_buf


def _gru_bwd_steps(bwd_mid, bwd_first, stream, aligned, B, H, WS, HG, Y, dY, h0, w_hh, reverse, dXG, dHG, dhd,
                   dh_buf) -> None:
    ws_s = _in_order(WS.unbind(0), reverse, True)
    hg_s = _in_order(HG.unbind(0), reverse, True)
    y_s = _in_order(Y.unbind(0), reverse, True)
    dy_s = _in_order(dY.unbind(0), reverse, True)
    dxg_s = _in_order(dXG.unbind(0), reverse, True)
    dhg_s = _in_order(dHG.unbind(0), reverse, True)
    dh = dy_s[0]
    for ws, hg, h_prev, dy_prev, dxg, dhg in zip(ws_s, hg_s, y_s[1:], dy_s[1:], dxg_s, dhg_s):
        bwd_mid(stream, aligned, ws, hg, h_prev, dh, dy_prev, dxg, dhg, dhd, B, H)
        dh = torch.addmm(dhd, dhg, w_hh, out=dh_buf)
    bwd_first(stream, aligned, ws_s[-1], hg_s[-1], h0, dh, dh, dxg_s[-1], dhg_s[-1], dhd, B, H)
    torch.addmm(dhd, dhg_s[-1], w_hh, out=dh_buf)
