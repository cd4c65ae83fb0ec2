"""Float64 oracles for the culmen.RNN tests: a textbook step-by-step stack written from the formulas, and a
bridge to ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` (same gate layouts) for an independent second opinion."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor


def cell_params(cell, dtype=torch.float64) -> dict[str, Tensor]:
    """Leaf copies of a cell's parameters in ``dtype`` (the reference differentiates them)."""
    return {n: p.detach().to(dtype).clone().requires_grad_(True) for n, p in cell.named_parameters()}


def _step(kind: str, p: dict[str, Tensor], x: Tensor, h: Tensor, c: Tensor | None):
    b_ih, b_hh = p.get("b_ih"), p.get("b_hh")

    def lin(v, w, b=None):
        out = v @ w.t()
        return out if b is None else out + b

    if kind in ("lstm", "mlstm"):
        r = (lin(x, p["w_mih"]) * lin(h, p["w_mhh"])) if kind == "mlstm" else h
        g = lin(x, p["w_ih"], b_ih) + lin(r, p["w_hh"], b_hh)
        i, f, gg, o = g.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
        h = torch.sigmoid(o) * torch.tanh(c)
    elif kind == "gru":
        xr, xz, xn = lin(x, p["w_ih"], b_ih).chunk(3, 1)
        hr, hz, hn = lin(h, p["w_hh"], b_hh).chunk(3, 1)
        rr, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + rr * hn)
        h = (1 - z) * n + z * h
    else:
        pre = lin(x, p["w_ih"], b_ih) + lin(h, p["w_hh"], b_hh)
        h = torch.relu(pre) if kind == "relu" else torch.tanh(pre)
    if "w_ho" in p:
        h = h @ p["w_ho"].t()
    return h, c


def ref_stack(kind: str, params: list[dict[str, Tensor]], x: Tensor, states: list[list[Tensor]],
              reverse: bool = False):
    """Run layers ``params`` over ``x (T, B, I)`` from ``states[layer] = [h0, (c0)]``, step by step.

    Returns ``(output (T, B, f), per-layer lists of per-step states [[h_t...], [c_t...]])``.
    """
    T = x.shape[0]
    inp = x
    hist = []
    for p, st in zip(params, states):
        h = st[0]
        c = st[1] if len(st) > 1 else None
        hs, cs = [None] * T, [None] * T
        for t in (range(T - 1, -1, -1) if reverse else range(T)):
            h, c = _step(kind, p, inp[t], h, c)
            hs[t], cs[t] = h, c
        inp = torch.stack(hs)
        hist.append([hs, cs] if c is not None else [hs])
    return inp, hist


def torch_peer(kind: str, stack, bidirectional: bool = False) -> nn.Module:
    """A float64 ``torch.nn`` RNN holding the weights of culmen stack(s) ``stack`` (one-layer bidirectional or
    any-depth unidirectional; Apex's deeper bidirectional stacks have no torch.nn equivalent)."""
    stacks = [stack.fwd, stack.bckwrd] if bidirectional else [stack]
    cells = stacks[0].rnns
    c0 = cells[0]
    proj = c0.output_size if c0.output_size != c0.hidden_size else 0
    common = dict(num_layers=len(cells), bias=c0.bias, bidirectional=bidirectional, dtype=torch.float64)
    if kind == "lstm":
        peer = nn.LSTM(c0.input_size, c0.hidden_size, proj_size=proj, **common)
    elif kind == "gru":
        peer = nn.GRU(c0.input_size, c0.hidden_size, **common)
    else:
        peer = nn.RNN(c0.input_size, c0.hidden_size, nonlinearity="relu" if kind == "relu" else "tanh", **common)
    with torch.no_grad():
        for d, st in enumerate(stacks):
            sfx = "_reverse" if d else ""
            for k, cell in enumerate(st.rnns):
                getattr(peer, f"weight_ih_l{k}{sfx}").copy_(cell.w_ih)
                getattr(peer, f"weight_hh_l{k}{sfx}").copy_(cell.w_hh)
                if cell.bias:
                    getattr(peer, f"bias_ih_l{k}{sfx}").copy_(cell.b_ih)
                    getattr(peer, f"bias_hh_l{k}{sfx}").copy_(cell.b_hh)
                if proj:
                    getattr(peer, f"weight_hr_l{k}{sfx}").copy_(cell.w_ho)
    return peer
