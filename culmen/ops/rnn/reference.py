"""Pure-PyTorch LSTM / GRU cells: the oracle of the tests and the CPU path of the fused cells.

``lstm_cell_ref`` / ``gru_cell_ref`` are the textbook formulas, differentiable, computed in the inputs'
dtype (float64 in the tests). The ``*_fwd_ref`` / ``*_bwd_ref`` functions compute exactly what the Triton
kernels of ``kernels.py`` compute (fp32 math, or float64 for float64 inputs; outputs written into the
given tensors, which may alias the inputs the same way the kernels allow); the sequence and cell ops
call them on CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lstm_cell_ref(gates: Tensor, cx: Tensor) -> tuple[Tensor, Tensor]:
    """``(hy, cy)`` of one LSTM step from pre-activation ``gates (B, 4H)`` (order i, f, g, o) and ``cx (B, H)``."""
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    hy = torch.sigmoid(o) * torch.tanh(cy)
    return hy, cy


def gru_cell_ref(xg: Tensor, hg: Tensor, hx: Tensor) -> Tensor:
    """``hy`` of one GRU step from input gates ``xg (B, 3H)``, hidden gates ``hg (B, 3H)`` (order r, z, n,
    biases included) and ``hx (B, H)``."""
    xr, xz, xn = xg.chunk(3, 1)
    hr, hz, hn = hg.chunk(3, 1)
    r = torch.sigmoid(xr + hr)
    z = torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return n + z * (hx - n)


def _f(t: Tensor) -> Tensor:
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def lstm_fwd_ref(g: Tensor, ws: Tensor, c_prev: Tensor, h_out: Tensor, c_out: Tensor) -> None:
    """What ``_lstm_fwd_kernel`` does: activated gates into ``ws`` (may be ``g``), ``h`` and ``c`` into
    ``h_out`` / ``c_out``."""
    H = c_prev.shape[-1]
    gf = _f(g)
    i, f, gg, o = (torch.sigmoid(gf[:, :H]), torch.sigmoid(gf[:, H:2 * H]), torch.tanh(gf[:, 2 * H:3 * H]),
                   torch.sigmoid(gf[:, 3 * H:]))
    c = f * _f(c_prev) + i * gg
    h = o * torch.tanh(c)
    ws.copy_(torch.cat([i, f, gg, o], 1))
    c_out.copy_(c)
    h_out.copy_(h)


def lstm_bwd_ref(ws: Tensor, c_prev: Tensor, c: Tensor, dh: Tensor, dc: Tensor, dcx: Tensor | None, dg: Tensor,
                 dc_prev: Tensor) -> None:
    """What ``_lstm_bwd_kernel`` does (``dcx`` may be ``None``; ``dc_prev`` may alias ``dc``)."""
    H = c.shape[-1]
    w = _f(ws)
    i, f, g, o = w[:, :H], w[:, H:2 * H], w[:, 2 * H:3 * H], w[:, 3 * H:]
    dhf = _f(dh)
    d = _f(dc)
    if dcx is not None:
        d = d + _f(dcx)
    tc = torch.tanh(_f(c))
    d = d + dhf * o * (1.0 - tc * tc)
    dg.copy_(torch.cat([d * g * i * (1.0 - i), d * _f(c_prev) * f * (1.0 - f), d * i * (1.0 - g * g),
                        dhf * tc * o * (1.0 - o)], 1))
    dc_prev.copy_(d * f)


def gru_fwd_ref(xg: Tensor, hg: Tensor, h_prev: Tensor, ws: Tensor, h_out: Tensor) -> None:
    """What ``_gru_fwd_kernel`` does: ``r, z, n`` into ``ws`` (may be ``xg``), ``h'`` into ``h_out``."""
    H = h_prev.shape[-1]
    x, hh = _f(xg), _f(hg)
    r = torch.sigmoid(x[:, :H] + hh[:, :H])
    z = torch.sigmoid(x[:, H:2 * H] + hh[:, H:2 * H])
    n = torch.tanh(x[:, 2 * H:] + r * hh[:, 2 * H:])
    h = n + z * (_f(h_prev) - n)
    ws.copy_(torch.cat([r, z, n], 1))
    h_out.copy_(h)


def gru_bwd_ref(ws: Tensor, hg: Tensor, h_prev: Tensor, dh: Tensor, dy_prev: Tensor | None, dxg: Tensor,
                dhg: Tensor, dhd: Tensor) -> None:
    """What ``_gru_bwd_kernel`` does (``dy_prev`` may be ``None``)."""
    H = h_prev.shape[-1]
    w = _f(ws)
    r, z, n = w[:, :H], w[:, H:2 * H], w[:, 2 * H:]
    hn = _f(hg[:, 2 * H:])
    d = _f(dh)
    dn = d * (1.0 - z) * (1.0 - n * n)
    dz = d * (_f(h_prev) - n) * z * (1.0 - z)
    dr = dn * hn * r * (1.0 - r)
    dxg.copy_(torch.cat([dr, dz, dn], 1))
    dhg.copy_(torch.cat([dr, dz, dn * r], 1))
    out = d * z
    if dy_prev is not None:
        out = out + _f(dy_prev)
    dhd.copy_(out)
