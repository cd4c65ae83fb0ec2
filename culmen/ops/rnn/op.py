"""Entry points of the fused RNN cells: one-step cells and whole-sequence LSTM / GRU layers.

* ``lstm_cell(gates, cx)`` and ``gru_cell(xg, hg, hx)``: one time step, differentiable. The GEMMs that
  produce the gates are the caller's (cuBLAS through ``F.linear``); the cell fuses everything after them.
* ``lstm_sequence`` / ``gru_sequence``: one layer over a whole ``(T, B, I)`` sequence as one autograd node.
  The input projection of every time step is one GEMM; each step then costs one in-place ``addmm`` (the
  recurrent GEMM) and one fused cell launch. The backward walks the steps in reverse with one fused cell
  launch and one ``addmm`` per step, and computes the weight gradients and the input gradient as single
  GEMMs over all steps at the end (not one rank-``B`` update per step, as step-wise autograd would).

CUDA tensors run the Triton kernels; CPU tensors run the reference (``culmen.ops.backend``). The sequence
ops run their own backward loop on both, with the reference cells on CPU, so the CPU tests check the loop.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from culmen.ops.backend import register_op
from culmen.ops.common.launch import aligned_16
from culmen.ops.rnn.launch import cell_plan
from culmen.ops.rnn.reference import gru_cell_ref, lstm_cell_ref

register_op("rnn_lstm_cell", "rnn", "fused LSTM pointwise cell (gates + state update), forward and backward")
register_op("rnn_gru_cell", "rnn", "fused GRU pointwise cell (gates + state update), forward and backward")

_F32 = torch.float32


def _carry(dtype: torch.dtype) -> torch.dtype:
    """dtype of the LSTM cell-gradient carry: fp32 (fp64 for fp64), so 16-bit runs do not round it per step."""
    return dtype if dtype == torch.float64 else _F32


def _step_aligned(B: int, H: int, es: int, *bases: Tensor) -> bool:
    # Every step slice starts a whole number of (B, H) (or (B, 3H), (B, 4H)) blocks past its base.
    return (B * H * es) % 16 == 0 and aligned_16(*bases)


def _check_2d(name: str, t: Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != cols:
        raise ValueError(f"{name} must have shape ({rows}, {cols}), got {tuple(t.shape)}")


# ----------------------------------------------------------------------------------------- one step


class _LSTMCellFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gates: Tensor, cx: Tensor):
        B, H = cx.shape
        plan = cell_plan("lstm", B, H, gates.dtype, gates.dtype, gates.device)
        ws = torch.empty_like(gates)
        hy = torch.empty_like(cx)
        cy = torch.empty_like(cx)
        plan.lstm_fwd(plan.stream(), aligned_16(gates, ws, cx, hy, cy), gates, ws, cx, hy, cy)
        ctx.save_for_backward(ws, cx, cy)
        return hy, cy

    @staticmethod
    @once_differentiable
    def backward(ctx, dhy: Tensor, dcy: Tensor):
        ws, cx, cy = ctx.saved_tensors
        B, H = cx.shape
        plan = cell_plan("lstm", B, H, ws.dtype, ws.dtype, ws.device)
        dhy = dhy.to(ws.dtype).contiguous()
        dcy = dcy.to(ws.dtype).contiguous()
        dg = torch.empty_like(ws)
        dcx = torch.empty_like(cx)
        plan.lstm_bwd(plan.stream(), aligned_16(ws, cx, cy, dhy, dcy, dg, dcx), ws, cx, cy, dhy, dcy, None, dg, dcx)
        return dg, dcx


class _GRUCellFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xg: Tensor, hg: Tensor, hx: Tensor):
        B, H = hx.shape
        plan = cell_plan("gru", B, H, xg.dtype, xg.dtype, xg.device)
        ws = torch.empty_like(xg)
        hy = torch.empty_like(hx)
        plan.gru_fwd(plan.stream(), aligned_16(xg, hg, hx, ws, hy), xg, hg, hx, ws, hy)
        ctx.save_for_backward(ws, hg, hx)
        return hy

    @staticmethod
    @once_differentiable
    def backward(ctx, dhy: Tensor):
        ws, hg, hx = ctx.saved_tensors
        B, H = hx.shape
        plan = cell_plan("gru", B, H, ws.dtype, ws.dtype, ws.device)
        dhy = dhy.to(ws.dtype).contiguous()
        dxg, dhg, dhx = torch.empty_like(ws), torch.empty_like(ws), torch.empty_like(hx)
        plan.gru_bwd(plan.stream(), aligned_16(ws, hg, hx, dhy, dxg, dhg, dhx), ws, hg, hx, dhy, None, dxg, dhg, dhx)
        return dxg, dhg, dhx


def lstm_cell(gates: Tensor, cx: Tensor) -> tuple[Tensor, Tensor]:
    """One fused LSTM step: ``(hy, cy)`` from pre-activation gates and the previous cell state.

    Args:
        gates: ``(B, 4H)`` pre-activation gates in PyTorch's order ``[i | f | g | o]``
            (``x W_ih^T + b_ih + h W_hh^T + b_hh``), fp16 / bf16 / fp32 / fp64.
        cx: ``(B, H)`` previous cell state (cast to ``gates.dtype``).

    Returns:
        ``hy = o * tanh(cy)`` and ``cy = f * cx + i * g``, both ``(B, H)`` of ``gates.dtype``; differentiable
        in ``gates`` and ``cx`` (the math runs in fp32, fp64 for fp64 inputs).
    """
    if gates.dim() != 2 or cx.dim() != 2:
        raise ValueError(f"lstm_cell expects 2-D gates and cx, got gates {tuple(gates.shape)}, cx {tuple(cx.shape)}")
    _check_2d("gates", gates, cx.shape[0], 4 * cx.shape[1])
    cx = cx.to(gates.dtype)
    if cell_plan("lstm", cx.shape[0], cx.shape[1], gates.dtype, gates.dtype, gates.device).backend != "triton":
        return lstm_cell_ref(gates, cx)
    return _LSTMCellFn.apply(gates.contiguous(), cx.contiguous())


def gru_cell(xg: Tensor, hg: Tensor, hx: Tensor) -> Tensor:
    """One fused GRU step: ``hy = n + z * (hx - n)`` with ``r = sigmoid(xr + hr)``, ``z = sigmoid(xz + hz)``,
    ``n = tanh(xn + r * hn)``.

    Args:
        xg: ``(B, 3H)`` input gates ``x W_ih^T + b_ih`` in PyTorch's order ``[r | z | n]``.
        hg: ``(B, 3H)`` hidden gates ``hx W_hh^T + b_hh`` (same dtype as ``xg``).
        hx: ``(B, H)`` previous hidden state (cast to ``xg.dtype``).

    Returns:
        ``hy`` ``(B, H)`` of ``xg.dtype``, differentiable in all three inputs.
    """
    if hx.dim() != 2:
        raise ValueError(f"gru_cell expects a 2-D hx, got {tuple(hx.shape)}")
    B, H = hx.shape
    _check_2d("xg", xg, B, 3 * H)
    _check_2d("hg", hg, B, 3 * H)
    if hg.dtype != xg.dtype:
        raise TypeError(f"gru_cell: hg dtype {hg.dtype} differs from xg dtype {xg.dtype}")
    hx = hx.to(xg.dtype)
    if cell_plan("gru", B, H, xg.dtype, xg.dtype, xg.device).backend != "triton":
        return gru_cell_ref(xg, hg, hx)
    return _GRUCellFn.apply(xg.contiguous(), hg.contiguous(), hx.contiguous())


# ------------------------------------------------------------------------------------ whole sequence


def _orders(T: int, reverse: bool) -> tuple[range, int]:
    """Forward step order and the offset of a step's predecessor (the step whose state it reads)."""
    return (range(T - 1, -1, -1), 1) if reverse else (range(T), -1)


def _dw_hh(dG: Tensor, Y: Tensor, h0: Tensor, reverse: bool) -> Tensor:
    """``sum_t dG[t]^T h_prev(t)`` as one GEMM over the steps that read a previous output, plus ``h0``'s."""
    T = dG.shape[0]
    first = T - 1 if reverse else 0
    dw = torch.mm(dG[first].t(), h0)
    if T > 1:
        rest, prev = (dG[:-1], Y[1:]) if reverse else (dG[1:], Y[:-1])
        dw.addmm_(rest.reshape(-1, dG.shape[-1]).t(), prev.reshape(-1, Y.shape[-1]))
    return dw


def _input_grads(ctx, dG: Tensor, x: Tensor, w_ih: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    T, B, In = x.shape
    d2 = dG.reshape(T * B, -1)
    dx = torch.mm(d2, w_ih).view(T, B, In) if ctx.needs_input_grad[0] else None
    dw = torch.mm(d2.t(), x.reshape(T * B, In)) if ctx.needs_input_grad[1] else None
    db = d2.sum(0) if ctx.needs_input_grad[2] else None
    return dx, dw, db


class _LSTMSeqFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_ih: Tensor, bias: Tensor | None, w_hh: Tensor, h0: Tensor, c0: Tensor,
                reverse: bool):
        T, B, In = x.shape
        H = w_hh.shape[1]
        x2 = x.reshape(T * B, In)
        G = (torch.addmm(bias, x2, w_ih.t()) if bias is not None else torch.mm(x2, w_ih.t())).view(T, B, 4 * H)
        Y = x.new_empty(T, B, H)
        CS = x.new_empty(T, B, H)
        plan = cell_plan("lstm", B, H, x.dtype, _carry(x.dtype), x.device)
        stream = plan.stream()
        aligned = _step_aligned(B, H, x.element_size(), G, Y, CS, h0, c0)
        g_s, y_s, c_s = G.unbind(0), Y.unbind(0), CS.unbind(0)
        w_t = w_hh.t()
        order, _ = _orders(T, reverse)
        h_prev, c_prev = h0, c0
        fwd = plan.lstm_fwd
        for t in order:
            g = g_s[t]
            g.addmm_(h_prev, w_t)
            h, c = y_s[t], c_s[t]
            fwd(stream, aligned, g, g, c_prev, h, c)
            h_prev, c_prev = h, c
        ctx.reverse = reverse
        ctx.save_for_backward(x, w_ih, w_hh, h0, c0, G, Y, CS)
        return Y, CS

    @staticmethod
    @once_differentiable
    def backward(ctx, dY: Tensor, dCS: Tensor | None):
        x, w_ih, w_hh, h0, c0, G, Y, CS = ctx.saved_tensors
        reverse = ctx.reverse
        T, B, _ = x.shape
        H = w_hh.shape[1]
        plan = cell_plan("lstm", B, H, x.dtype, _carry(x.dtype), x.device)
        stream = plan.stream()
        dY = dY.to(x.dtype).contiguous()
        dCS = dCS.to(x.dtype).contiguous() if dCS is not None else None
        dG = torch.empty_like(G)
        dc = torch.zeros(B, H, dtype=_carry(x.dtype), device=x.device)
        dh_buf = torch.empty(B, H, dtype=x.dtype, device=x.device)
        aligned = _step_aligned(B, H, x.element_size(), G, Y, CS, h0, c0, dY, dG, dc, dh_buf,
                                dCS if dCS is not None else G)
        g_s, c_s, dy_s, dg_s = G.unbind(0), CS.unbind(0), dY.unbind(0), dG.unbind(0)
        dcs_s = dCS.unbind(0) if dCS is not None else None
        fwd_order, step = _orders(T, reverse)
        order = reversed(fwd_order)
        last = fwd_order[0]  # the step whose predecessor is the initial state
        dh = dy_s[fwd_order[-1]]
        dh0 = None
        bwd = plan.lstm_bwd
        for t in order:
            p = t + step
            c_prev = c0 if t == last else c_s[p]
            bwd(stream, aligned, g_s[t], c_prev, c_s[t], dh, dc, dcs_s[t] if dcs_s is not None else None, dg_s[t], dc)
            if t != last:
                dh = torch.addmm(dy_s[p], dg_s[t], w_hh, out=dh_buf)
            elif ctx.needs_input_grad[4]:
                dh0 = torch.mm(dg_s[t], w_hh)
        dx, dw_ih, db = _input_grads(ctx, dG, x, w_ih)
        dw_hh = _dw_hh(dG, Y, h0, reverse) if ctx.needs_input_grad[3] else None
        dc0 = dc.to(c0.dtype) if ctx.needs_input_grad[5] else None
        return dx, dw_ih, db, dw_hh, dh0, dc0, None


class _GRUSeqFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_ih: Tensor, b_ih: Tensor | None, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor,
                reverse: bool):
        T, B, In = x.shape
        H = w_hh.shape[1]
        x2 = x.reshape(T * B, In)
        XG = (torch.addmm(b_ih, x2, w_ih.t()) if b_ih is not None else torch.mm(x2, w_ih.t())).view(T, B, 3 * H)
        HG = x.new_empty(T, B, 3 * H)
        Y = x.new_empty(T, B, H)
        plan = cell_plan("gru", B, H, x.dtype, x.dtype, x.device)
        stream = plan.stream()
        aligned = _step_aligned(B, H, x.element_size(), XG, HG, Y, h0)
        xg_s, hg_s, y_s = XG.unbind(0), HG.unbind(0), Y.unbind(0)
        w_t = w_hh.t()
        order, _ = _orders(T, reverse)
        h_prev = h0
        fwd = plan.gru_fwd
        for t in order:
            hg = hg_s[t]
            if b_hh is not None:
                torch.addmm(b_hh, h_prev, w_t, out=hg)
            else:
                torch.mm(h_prev, w_t, out=hg)
            fwd(stream, aligned, xg_s[t], hg, h_prev, xg_s[t], y_s[t])
            h_prev = y_s[t]
        ctx.reverse = reverse
        ctx.save_for_backward(x, w_ih, w_hh, h0, XG, HG, Y)
        return Y

    @staticmethod
    @once_differentiable
    def backward(ctx, dY: Tensor):
        x, w_ih, w_hh, h0, WS, HG, Y = ctx.saved_tensors
        reverse = ctx.reverse
        T, B, _ = x.shape
        H = w_hh.shape[1]
        plan = cell_plan("gru", B, H, x.dtype, x.dtype, x.device)
        stream = plan.stream()
        dY = dY.to(x.dtype).contiguous()
        dXG, dHG = torch.empty_like(WS), torch.empty_like(HG)
        dhd = torch.empty(B, H, dtype=x.dtype, device=x.device)
        dh_buf = torch.empty_like(dhd)
        aligned = _step_aligned(B, H, x.element_size(), WS, HG, Y, h0, dY, dXG, dHG, dhd, dh_buf)
        ws_s, hg_s, y_s, dy_s = WS.unbind(0), HG.unbind(0), Y.unbind(0), dY.unbind(0)
        dxg_s, dhg_s = dXG.unbind(0), dHG.unbind(0)
        fwd_order, step = _orders(T, reverse)
        last = fwd_order[0]
        dh = dy_s[fwd_order[-1]]
        bwd = plan.gru_bwd
        for t in reversed(fwd_order):
            p = t + step
            first = t == last
            bwd(stream, aligned, ws_s[t], hg_s[t], h0 if first else y_s[p], dh, None if first else dy_s[p],
                dxg_s[t], dhg_s[t], dhd)
            dh = torch.addmm(dhd, dhg_s[t], w_hh, out=dh_buf)
        dx, dw_ih, db_ih = _input_grads(ctx, dXG, x, w_ih)
        dw_hh = _dw_hh(dHG, Y, h0, reverse) if ctx.needs_input_grad[3] else None
        db_hh = dHG.reshape(T * B, -1).sum(0) if ctx.needs_input_grad[4] else None
        dh0 = dh.clone() if ctx.needs_input_grad[5] else None
        return dx, dw_ih, db_ih, dw_hh, db_hh, dh0, None


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    dev = device.type
    if not torch.is_autocast_enabled(dev):
        return None
    get = getattr(torch, "get_autocast_dtype", None)
    return get(dev) if get is not None else torch.get_autocast_gpu_dtype()


def _prepare(name: str, x: Tensor, weights: tuple, states: tuple, gate_mult: int):
    """Validate one layer's arguments; return the compute dtype's tensors (autocast casts them, as
    ``F.linear`` would) and whether autocast must be switched off around the sequence."""
    if x.dim() != 3:
        raise ValueError(f"{name}: input must be (T, B, input_size), got shape {tuple(x.shape)}")
    w_ih, bias_ih, w_hh, bias_hh = weights
    T, B, In = x.shape
    if T == 0 or B == 0:
        raise ValueError(f"{name}: input must have at least one time step and one row, got shape {tuple(x.shape)}")
    G, H = w_hh.shape
    if G != gate_mult * H:
        raise ValueError(f"{name}: w_hh must be ({gate_mult} * H, H), got {tuple(w_hh.shape)}")
    _check_2d("w_ih", w_ih, G, In)
    for bname, b in (("b_ih", bias_ih), ("b_hh", bias_hh)):
        if b is not None and tuple(b.shape) != (G,):
            raise ValueError(f"{name}: {bname} must be ({G},), got {tuple(b.shape)}")
    for sname, s in states:
        _check_2d(sname, s, B, H)
    cast = _autocast_dtype(x.device)
    dtype = cast if cast is not None else x.dtype
    if not dtype.is_floating_point:
        raise TypeError(f"{name}: input must be floating point, got {x.dtype}")
    ws = tuple(w if w is None else w.to(dtype) for w in weights)
    if cast is None:
        for wname, w in zip(("w_ih", "b_ih", "w_hh", "b_hh"), weights):
            if w is not None and w.dtype != dtype:
                raise TypeError(f"{name}: {wname} dtype {w.dtype} differs from the input dtype {dtype}")
    st = tuple(s.to(dtype).contiguous() for _, s in states)
    return x.to(dtype), ws, st, cast is not None


def lstm_sequence(x: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None, h0: Tensor,
                  c0: Tensor, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """One LSTM layer over a whole sequence (no output projection), as one autograd node.

    Args:
        x: ``(T, B, I)`` input (time first), fp16 / bf16 / fp32 / fp64.
        w_ih: ``(4H, I)``; w_hh: ``(4H, H)``; b_ih, b_hh: ``(4H,)`` or ``None``. Gate order ``[i | f | g | o]``.
        h0, c0: ``(B, H)`` initial states (cast to the compute dtype).
        reverse: walk the steps from ``T - 1`` down to ``0`` (outputs stay at their input's time index).

    Returns:
        ``(y, c)``: every step's hidden state and cell state, both ``(T, B, H)``; the final states are
        ``y[-1], c[-1]`` (``y[0], c[0]`` when ``reverse``). Differentiable in every input. Under autocast
        the computation runs in the autocast dtype. On CUDA the cell is the fused Triton kernel.
    """
    x, (w_ih, b_ih, w_hh, b_hh), (h0, c0), off = _prepare("lstm_sequence", x, (w_ih, b_ih, w_hh, b_hh),
                                                         (("h0", h0), ("c0", c0)), 4)
    bias = b_ih + b_hh if (b_ih is not None and b_hh is not None) else (b_ih if b_ih is not None else b_hh)
    if off:
        with torch.autocast(x.device.type, enabled=False):
            return _LSTMSeqFn.apply(x, w_ih, bias, w_hh, h0, c0, bool(reverse))
    return _LSTMSeqFn.apply(x, w_ih, bias, w_hh, h0, c0, bool(reverse))


def gru_sequence(x: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None, h0: Tensor,
                 reverse: bool = False) -> Tensor:
    """One GRU layer over a whole sequence, as one autograd node.

    Args:
        x: ``(T, B, I)`` input (time first).
        w_ih: ``(3H, I)``; w_hh: ``(3H, H)``; b_ih, b_hh: ``(3H,)`` or ``None``. Gate order ``[r | z | n]``.
        h0: ``(B, H)`` initial hidden state.
        reverse: walk the steps from ``T - 1`` down to ``0``.

    Returns:
        ``y`` ``(T, B, H)``: every step's hidden state; differentiable in every input.
    """
    x, (w_ih, b_ih, w_hh, b_hh), (h0,), off = _prepare("gru_sequence", x, (w_ih, b_ih, w_hh, b_hh),
                                                      (("h0", h0),), 3)
    if off:
        with torch.autocast(x.device.type, enabled=False):
            return _GRUSeqFn.apply(x, w_ih, b_ih, w_hh, b_hh, h0, bool(reverse))
    return _GRUSeqFn.apply(x, w_ih, b_ih, w_hh, b_hh, h0, bool(reverse))
