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
The loops themselves are in ``loops.py``; on CUDA a layer's forward and backward loops are replayed as CUDA
graphs from a signature's second call on (``graphs.py``: one graph launch instead of ``2 T`` host launches).

Under ``torch.compile`` (``torch.compiler.is_compiling()``) the time loop is not traced step by step: each
sequence op is an opaque ``torch.library.custom_op`` pair (``culmen::lstm_sequence_fwd`` / ``_bwd``,
``culmen::gru_sequence_fwd`` / ``_bwd``) tied by ``register_autograd``, and the cells on the Triton
backend are ``culmen::lstm_cell_fwd`` / ``_bwd`` and ``culmen::gru_cell_fwd`` / ``_bwd``; fake
implementations give the real outputs' shapes and dtypes, and absent gradients are empty tensors. At run
time the bodies run the eager loops (never the CUDA-graph replay, whose outputs alias reused buffers: the
compiled graph may itself be captured). Cells on the reference backend trace the reference formulas.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from culmen.ops.backend import choose_backend, register_op
from culmen.ops.common.launch import aligned_16
from culmen.ops.rnn.graphs import STATS, graphs_allowed, layer_graphs
from culmen.ops.rnn.launch import cell_plan
from culmen.ops.rnn.loops import gru_bwd_loop, gru_fwd_loop, lstm_bwd_loop, lstm_fwd_loop
from culmen.ops.rnn.reference import gru_cell_ref, lstm_cell_ref

register_op("rnn_lstm_cell", "rnn", "fused LSTM pointwise cell (gates + state update), forward and backward")
register_op("rnn_gru_cell", "rnn", "fused GRU pointwise cell (gates + state update), forward and backward")

_F32 = torch.float32


def _carry(dtype: torch.dtype) -> torch.dtype:
    """dtype of the LSTM cell-gradient carry: fp32 (fp64 for fp64), so 16-bit runs do not round it per step."""
    return dtype if dtype == torch.float64 else _F32


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
    if torch.compiler.is_compiling():
        return _lstm_cell_compiled(gates, cx)
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
    if torch.compiler.is_compiling():
        return _gru_cell_compiled(xg, hg, hx)
    if cell_plan("gru", B, H, xg.dtype, xg.dtype, xg.device).backend != "triton":
        return gru_cell_ref(xg, hg, hx)
    return _GRUCellFn.apply(xg.contiguous(), hg.contiguous(), hx.contiguous())


# ------------------------------------------------------------------------------------ whole sequence


def _input_proj(x: Tensor, w_ih: Tensor, bias: Tensor | None, out: Tensor | None) -> Tensor:
    """``x W_ih^T + bias`` for every step as one GEMM ``(T, B, nH)``, into ``out`` when given."""
    T, B, In = x.shape
    x2 = x.reshape(T * B, In)
    o2 = out.view(T * B, -1) if out is not None else None
    if bias is not None:
        r = torch.addmm(bias, x2, w_ih.t(), out=o2)
    else:
        r = torch.mm(x2, w_ih.t(), out=o2)
    return r.view(T, B, -1)


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


def _graph_set(kind: str, x: Tensor, H: int, reverse: bool, bias: bool, plan, use_graph: bool | None):
    """The signature's ``LayerGraphs`` and a free buffer set, or ``(None, None)``: the eager loop."""
    if not graphs_allowed(x.device, use_graph) or (x.device.type == "cuda" and plan.backend != "triton"):
        STATS["eager_fwd"] += 1
        return None, None
    T, B, _ = x.shape
    lg = layer_graphs(kind, T, B, H, x.dtype, x.device, reverse, bias)
    s = lg.acquire()
    if s is None:
        STATS["eager_fwd"] += 1
        return None, None
    return lg, s


class _LSTMSeqFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_ih: Tensor, bias: Tensor | None, w_hh: Tensor, h0: Tensor, c0: Tensor,
                reverse: bool, use_graph: bool | None):
        T, B, _ = x.shape
        H = w_hh.shape[1]
        plan = cell_plan("lstm", B, H, x.dtype, _carry(x.dtype), x.device)
        lg, s = _graph_set("lstm", x, H, reverse, True, plan, use_graph)
        if s is None:
            G = _input_proj(x, w_ih, bias, None)
            Y, CS = x.new_empty(T, B, H), x.new_empty(T, B, H)
            lstm_fwd_loop(plan, G, Y, CS, h0, c0, w_hh, reverse)
        else:
            G = s.G
            _input_proj(x, w_ih, bias, G)
            s.h0.copy_(h0)
            s.c0.copy_(c0)
            s.w_hh.copy_(w_hh)
            lg.run(s, "fwd", lambda: lstm_fwd_loop(plan, s.G, s.Y, s.CS, s.h0, s.c0, s.w_hh, reverse),
                   plan.warm(plan.fwd))
            # Aliases, not views: the caller may modify them in place; the set stays busy while they live.
            Y, CS = s.Y.detach(), s.CS.detach()
        ctx.reverse = reverse
        ctx.graphs = (lg, s)
        # Unused outputs arrive as None: no (T, B, H) zeros to make and add when only y (or only c) is used.
        ctx.set_materialize_grads(False)
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
        lg, s = ctx.graphs
        dh0 = dc0 = None
        if dY is None:
            dY = torch.zeros_like(Y)
        if s is not None and graphs_allowed(x.device, True):
            k = lg.bwd_buffers(dCS is not None)
            k.dY.copy_(dY)
            if dCS is not None:
                k.dCS.copy_(dCS)
            flag = dCS is not None
            lg.run(s, ("bwd", flag), lambda: lstm_bwd_loop(plan, s.G, s.CS, k.dY, k.dCS if flag else None, s.c0,
                                                           s.w_hh, reverse, k.dG, k.dc, k.dh_buf, k.dh0),
                   plan.warm(plan.bwd[flag]))
            dG = k.dG
            if ctx.needs_input_grad[4]:
                dh0 = k.dh0.clone()
            if ctx.needs_input_grad[5]:
                dc0 = k.dc.to(c0.dtype, copy=True)
        else:
            STATS["eager_bwd"] += 1
            dY = dY.to(x.dtype).contiguous()
            dCS = dCS.to(x.dtype).contiguous() if dCS is not None else None
            dG = torch.empty_like(G)
            dc = torch.empty(B, H, dtype=_carry(x.dtype), device=x.device)
            dh0 = x.new_empty(B, H) if ctx.needs_input_grad[4] else None
            lstm_bwd_loop(plan, G, CS, dY, dCS, c0, w_hh, reverse, dG, dc, x.new_empty(B, H), dh0)
            if ctx.needs_input_grad[5]:
                dc0 = dc.to(c0.dtype)
        dx, dw_ih, db = _input_grads(ctx, dG, x, w_ih)
        dw_hh = _dw_hh(dG, Y, h0, reverse) if ctx.needs_input_grad[3] else None
        return dx, dw_ih, db, dw_hh, dh0, dc0, None, None


class _GRUSeqFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_ih: Tensor, b_ih: Tensor | None, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor,
                reverse: bool, use_graph: bool | None):
        T, B, _ = x.shape
        H = w_hh.shape[1]
        plan = cell_plan("gru", B, H, x.dtype, x.dtype, x.device)
        lg, s = _graph_set("gru", x, H, reverse, b_hh is not None, plan, use_graph)
        if s is None:
            XG = _input_proj(x, w_ih, b_ih, None)
            HG, Y = x.new_empty(T, B, 3 * H), x.new_empty(T, B, H)
            gru_fwd_loop(plan, XG, HG, Y, h0, w_hh, b_hh, reverse)
        else:
            XG, HG = s.XG, s.HG
            _input_proj(x, w_ih, b_ih, XG)
            s.h0.copy_(h0)
            s.w_hh.copy_(w_hh)
            if b_hh is not None:
                s.b_hh.copy_(b_hh)
            lg.run(s, "fwd", lambda: gru_fwd_loop(plan, s.XG, s.HG, s.Y, s.h0, s.w_hh, s.b_hh, reverse),
                   plan.warm(plan.fwd))
            Y = s.Y.detach()
        ctx.reverse = reverse
        ctx.graphs = (lg, s)
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
        lg, s = ctx.graphs
        if s is not None and graphs_allowed(x.device, True):
            k = lg.bwd_buffers(False)
            k.dY.copy_(dY)
            lg.run(s, ("bwd", False), lambda: gru_bwd_loop(plan, s.XG, s.HG, s.Y, k.dY, s.h0, s.w_hh, reverse,
                                                           k.dXG, k.dHG, k.dhd, k.dh_buf),
                   plan.warm(plan.bwd[True], plan.bwd[False]))
            dXG, dHG, dh = k.dXG, k.dHG, k.dh_buf
        else:
            STATS["eager_bwd"] += 1
            dY = dY.to(x.dtype).contiguous()
            dXG, dHG = torch.empty_like(WS), torch.empty_like(HG)
            dh = gru_bwd_loop(plan, WS, HG, Y, dY, h0, w_hh, reverse, dXG, dHG, x.new_empty(B, H), x.new_empty(B, H))
        dx, dw_ih, db_ih = _input_grads(ctx, dXG, x, w_ih)
        dw_hh = _dw_hh(dHG, Y, h0, reverse) if ctx.needs_input_grad[3] else None
        db_hh = dHG.reshape(T * B, -1).sum(0) if ctx.needs_input_grad[4] else None
        dh0 = dh.clone() if ctx.needs_input_grad[5] else None
        return dx, dw_ih, db_ih, dw_hh, db_hh, dh0, None, None


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
                  c0: Tensor, reverse: bool = False, cuda_graph: bool | None = None) -> tuple[Tensor, Tensor]:
    """One LSTM layer over a whole sequence (no output projection), as one autograd node.

    Args:
        x: ``(T, B, I)`` input (time first), fp16 / bf16 / fp32 / fp64.
        w_ih: ``(4H, I)``; w_hh: ``(4H, H)``; b_ih, b_hh: ``(4H,)`` or ``None``. Gate order ``[i | f | g | o]``.
        h0, c0: ``(B, H)`` initial states (cast to the compute dtype).
        reverse: walk the steps from ``T - 1`` down to ``0`` (outputs stay at their input's time index).
        cuda_graph: replay the time loop (forward and backward) as a CUDA graph where possible (``None``: the
            process-wide ``set_cuda_graphs`` switch, on by default; ``False``: the eager step loop). See
            ``culmen.ops.rnn.graphs``: the outputs may alias buffers the layer reuses once they are released.

    Returns:
        ``(y, c)``: every step's hidden state and cell state, both ``(T, B, H)``; the final states are
        ``y[-1], c[-1]`` (``y[0], c[0]`` when ``reverse``). Differentiable in every input. Under autocast
        the computation runs in the autocast dtype. On CUDA the cell is the fused Triton kernel.
    """
    x, (w_ih, b_ih, w_hh, b_hh), (h0, c0), off = _prepare("lstm_sequence", x, (w_ih, b_ih, w_hh, b_hh),
                                                         (("h0", h0), ("c0", c0)), 4)
    bias = b_ih + b_hh if (b_ih is not None and b_hh is not None) else (b_ih if b_ih is not None else b_hh)
    if torch.compiler.is_compiling():
        if off:
            with torch.autocast(x.device.type, enabled=False):
                return _lstm_seq_op(x, w_ih, bias, w_hh, h0, c0, bool(reverse))[:2]
        return _lstm_seq_op(x, w_ih, bias, w_hh, h0, c0, bool(reverse))[:2]
    if off:
        with torch.autocast(x.device.type, enabled=False):
            return _LSTMSeqFn.apply(x, w_ih, bias, w_hh, h0, c0, bool(reverse), cuda_graph)
    return _LSTMSeqFn.apply(x, w_ih, bias, w_hh, h0, c0, bool(reverse), cuda_graph)


def gru_sequence(x: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None, h0: Tensor,
                 reverse: bool = False, cuda_graph: bool | None = None) -> Tensor:
    """One GRU layer over a whole sequence, as one autograd node.

    Args:
        x: ``(T, B, I)`` input (time first).
        w_ih: ``(3H, I)``; w_hh: ``(3H, H)``; b_ih, b_hh: ``(3H,)`` or ``None``. Gate order ``[r | z | n]``.
        h0: ``(B, H)`` initial hidden state.
        reverse: walk the steps from ``T - 1`` down to ``0``.
        cuda_graph: as in ``lstm_sequence``.

    Returns:
        ``y`` ``(T, B, H)``: every step's hidden state; differentiable in every input.
    """
    x, (w_ih, b_ih, w_hh, b_hh), (h0,), off = _prepare("gru_sequence", x, (w_ih, b_ih, w_hh, b_hh),
                                                      (("h0", h0),), 3)
    if torch.compiler.is_compiling():
        if off:
            with torch.autocast(x.device.type, enabled=False):
                return _gru_seq_op(x, w_ih, b_ih, w_hh, b_hh, h0, bool(reverse))[0]
        return _gru_seq_op(x, w_ih, b_ih, w_hh, b_hh, h0, bool(reverse))[0]
    if off:
        with torch.autocast(x.device.type, enabled=False):
            return _GRUSeqFn.apply(x, w_ih, b_ih, w_hh, b_hh, h0, bool(reverse), cuda_graph)
    return _GRUSeqFn.apply(x, w_ih, b_ih, w_hh, b_hh, h0, bool(reverse), cuda_graph)


# ------------------------------------------------------------------------------------ torch.compile
# Absent tensors and gradients cross the custom-op boundary as empty tensors (custom ops return no None).


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def _opt(t: Tensor | None, like: Tensor) -> Tensor:
    return t if t is not None else _empty(like)


@torch.library.custom_op("culmen::lstm_cell_fwd", mutates_args=())
def lstm_cell_fwd_op(gates: Tensor, cx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(hy, cy, ws)`` of one fused LSTM step (contiguous ``gates (B, 4H)``, ``cx (B, H)``); ``ws`` holds the
    activated gates for the backward."""
    B, H = cx.shape
    plan = cell_plan("lstm", B, H, gates.dtype, gates.dtype, gates.device)
    ws, hy, cy = torch.empty_like(gates), torch.empty_like(cx), torch.empty_like(cx)
    plan.lstm_fwd(plan.stream(), aligned_16(gates, ws, cx, hy, cy), gates, ws, cx, hy, cy)
    return hy, cy, ws


@lstm_cell_fwd_op.register_fake
def _lstm_cell_fwd_fake(gates, cx):
    return torch.empty_like(cx), torch.empty_like(cx), torch.empty_like(gates)


@torch.library.custom_op("culmen::lstm_cell_bwd", mutates_args=())
def lstm_cell_bwd_op(ws: Tensor, cx: Tensor, cy: Tensor, dhy: Tensor, dcy: Tensor) -> tuple[Tensor, Tensor]:
    """``(dgates, dcx)`` of ``lstm_cell_fwd`` (contiguous gradients in the storage dtype)."""
    B, H = cx.shape
    plan = cell_plan("lstm", B, H, ws.dtype, ws.dtype, ws.device)
    dg, dcx = torch.empty_like(ws), torch.empty_like(cx)
    plan.lstm_bwd(plan.stream(), aligned_16(ws, cx, cy, dhy, dcy, dg, dcx), ws, cx, cy, dhy, dcy, None, dg, dcx)
    return dg, dcx


@lstm_cell_bwd_op.register_fake
def _lstm_cell_bwd_fake(ws, cx, cy, dhy, dcy):
    return torch.empty_like(ws), torch.empty_like(cx)


def _lstm_cell_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2], inputs[1], output[1])


def _lstm_cell_backward(ctx, dhy, dcy, dws):
    ws, cx, cy = ctx.saved_tensors
    dhy = torch.zeros_like(cx) if dhy is None else dhy.to(ws.dtype).contiguous()
    dcy = torch.zeros_like(cx) if dcy is None else dcy.to(ws.dtype).contiguous()
    return lstm_cell_bwd_op(ws, cx, cy, dhy, dcy)


torch.library.register_autograd("culmen::lstm_cell_fwd", _lstm_cell_backward, setup_context=_lstm_cell_setup)


def _lstm_cell_compiled(gates: Tensor, cx: Tensor) -> tuple[Tensor, Tensor]:
    if choose_backend(gates.device) != "triton":
        return lstm_cell_ref(gates, cx)
    hy, cy, _ = lstm_cell_fwd_op(gates.contiguous(), cx.contiguous())
    return hy, cy


@torch.library.custom_op("culmen::gru_cell_fwd", mutates_args=())
def gru_cell_fwd_op(xg: Tensor, hg: Tensor, hx: Tensor) -> tuple[Tensor, Tensor]:
    """``(hy, ws)`` of one fused GRU step (contiguous ``xg``, ``hg (B, 3H)``, ``hx (B, H)``); ``ws`` holds
    ``[r | z | n]`` for the backward."""
    B, H = hx.shape
    plan = cell_plan("gru", B, H, xg.dtype, xg.dtype, xg.device)
    ws, hy = torch.empty_like(xg), torch.empty_like(hx)
    plan.gru_fwd(plan.stream(), aligned_16(xg, hg, hx, ws, hy), xg, hg, hx, ws, hy)
    return hy, ws


@gru_cell_fwd_op.register_fake
def _gru_cell_fwd_fake(xg, hg, hx):
    return torch.empty_like(hx), torch.empty_like(xg)


@torch.library.custom_op("culmen::gru_cell_bwd", mutates_args=())
def gru_cell_bwd_op(ws: Tensor, hg: Tensor, hx: Tensor, dhy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dxg, dhg, dhx)`` of ``gru_cell_fwd``."""
    B, H = hx.shape
    plan = cell_plan("gru", B, H, ws.dtype, ws.dtype, ws.device)
    dxg, dhg, dhx = torch.empty_like(ws), torch.empty_like(ws), torch.empty_like(hx)
    plan.gru_bwd(plan.stream(), aligned_16(ws, hg, hx, dhy, dxg, dhg, dhx), ws, hg, hx, dhy, None, dxg, dhg, dhx)
    return dxg, dhg, dhx


@gru_cell_bwd_op.register_fake
def _gru_cell_bwd_fake(ws, hg, hx, dhy):
    return torch.empty_like(ws), torch.empty_like(ws), torch.empty_like(hx)


def _gru_cell_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[1], inputs[2])


def _gru_cell_backward(ctx, dhy, dws):
    ws, hg, hx = ctx.saved_tensors
    return gru_cell_bwd_op(ws, hg, hx, dhy.to(ws.dtype).contiguous())


torch.library.register_autograd("culmen::gru_cell_fwd", _gru_cell_backward, setup_context=_gru_cell_setup)


def _gru_cell_compiled(xg: Tensor, hg: Tensor, hx: Tensor) -> Tensor:
    if choose_backend(xg.device) != "triton":
        return gru_cell_ref(xg, hg, hx)
    return gru_cell_fwd_op(xg.contiguous(), hg.contiguous(), hx.contiguous())[0]


@torch.library.custom_op("culmen::lstm_sequence_fwd", mutates_args=())
def _lstm_seq_op(x: Tensor, w_ih: Tensor, bias: Tensor | None, w_hh: Tensor, h0: Tensor, c0: Tensor,
                 reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, c, gates)`` of one LSTM layer (``lstm_sequence``'s prepared arguments, ``bias = b_ih + b_hh``);
    ``gates (T, B, 4H)`` are the activated gates the backward reads. The eager time loop."""
    T, B, _ = x.shape
    H = w_hh.shape[1]
    plan = cell_plan("lstm", B, H, x.dtype, _carry(x.dtype), x.device)
    G = _input_proj(x, w_ih, bias, None)
    Y, CS = x.new_empty(T, B, H), x.new_empty(T, B, H)
    lstm_fwd_loop(plan, G, Y, CS, h0.contiguous(), c0.contiguous(), w_hh, reverse)
    return Y, CS, G


@_lstm_seq_op.register_fake
def _lstm_seq_fake(x, w_ih, bias, w_hh, h0, c0, reverse):
    T, B, _ = x.shape
    H = w_hh.shape[1]
    return x.new_empty(T, B, H), x.new_empty(T, B, H), x.new_empty(T, B, 4 * H)


@torch.library.custom_op("culmen::lstm_sequence_bwd", mutates_args=())
def _lstm_seq_bwd_op(dY: Tensor, dCS: Tensor | None, x: Tensor, w_ih: Tensor, w_hh: Tensor, h0: Tensor, c0: Tensor,
                     G: Tensor, Y: Tensor, CS: Tensor, reverse: bool,
                     needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dw_ih, dbias, dw_hh, dh0, dc0)`` of ``lstm_sequence_fwd`` for ``needs`` (one flag per gradient;
    an unneeded one is an empty tensor)."""
    T, B, _ = x.shape
    H = w_hh.shape[1]
    plan = cell_plan("lstm", B, H, x.dtype, _carry(x.dtype), x.device)
    dY = dY.to(x.dtype).contiguous()
    dCS = dCS.to(x.dtype).contiguous() if dCS is not None else None
    dG = torch.empty_like(G)
    dc = torch.empty(B, H, dtype=_carry(x.dtype), device=x.device)
    dh0 = x.new_empty(B, H) if needs[4] else None
    lstm_bwd_loop(plan, G, CS, dY, dCS, c0.contiguous(), w_hh, reverse, dG, dc, x.new_empty(B, H), dh0)
    dx, dw_ih, db = _input_grads_for(needs, dG, x, w_ih)
    dw_hh = _dw_hh(dG, Y, h0, reverse) if needs[3] else None
    dc0 = dc.to(c0.dtype) if needs[5] else None
    return tuple(_opt(t, x) for t in (dx, dw_ih, db, dw_hh, dh0, dc0))


@_lstm_seq_bwd_op.register_fake
def _lstm_seq_bwd_fake(dY, dCS, x, w_ih, w_hh, h0, c0, G, Y, CS, reverse, needs):
    full = (x, w_ih, w_ih.new_empty(w_ih.shape[0]), w_hh, h0, c0)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if n else _empty(x)
                 for t, n in zip(full, needs))


def _input_grads_for(needs, dG: Tensor, x: Tensor, w_ih: Tensor):
    T, B, In = x.shape
    d2 = dG.reshape(T * B, -1)
    dx = torch.mm(d2, w_ih).view(T, B, In) if needs[0] else None
    dw = torch.mm(d2.t(), x.reshape(T * B, In)) if needs[1] else None
    db = d2.sum(0) if needs[2] else None
    return dx, dw, db


def _lstm_seq_setup(ctx, inputs, output):
    x, w_ih, bias, w_hh, h0, c0, reverse = inputs
    Y, CS, G = output
    ctx.reverse = reverse
    ctx.save_for_backward(x, w_ih, w_hh, h0, c0, G, Y, CS)


def _lstm_seq_backward(ctx, dY, dCS, dG):
    x, w_ih, w_hh, h0, c0, G, Y, CS = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:6])
    if dY is None:
        dY = torch.zeros_like(Y)
    grads = _lstm_seq_bwd_op(dY, dCS, x, w_ih, w_hh, h0, c0, G, Y, CS, ctx.reverse, needs)
    return (*(g if n else None for g, n in zip(grads, needs)), None)


torch.library.register_autograd("culmen::lstm_sequence_fwd", _lstm_seq_backward, setup_context=_lstm_seq_setup)


@torch.library.custom_op("culmen::gru_sequence_fwd", mutates_args=())
def _gru_seq_op(x: Tensor, w_ih: Tensor, b_ih: Tensor | None, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor,
                reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, ws, hg)`` of one GRU layer (``gru_sequence``'s prepared arguments): ``ws (T, B, 3H)`` holds
    ``[r | z | n]`` and ``hg (T, B, 3H)`` the hidden gates, for the backward. The eager time loop."""
    T, B, _ = x.shape
    H = w_hh.shape[1]
    plan = cell_plan("gru", B, H, x.dtype, x.dtype, x.device)
    XG = _input_proj(x, w_ih, b_ih, None)
    HG, Y = x.new_empty(T, B, 3 * H), x.new_empty(T, B, H)
    gru_fwd_loop(plan, XG, HG, Y, h0.contiguous(), w_hh, b_hh, reverse)
    return Y, XG, HG


@_gru_seq_op.register_fake
def _gru_seq_fake(x, w_ih, b_ih, w_hh, b_hh, h0, reverse):
    T, B, _ = x.shape
    H = w_hh.shape[1]
    return x.new_empty(T, B, H), x.new_empty(T, B, 3 * H), x.new_empty(T, B, 3 * H)


@torch.library.custom_op("culmen::gru_sequence_bwd", mutates_args=())
def _gru_seq_bwd_op(dY: Tensor, x: Tensor, w_ih: Tensor, w_hh: Tensor, h0: Tensor, WS: Tensor, HG: Tensor, Y: Tensor,
                    reverse: bool, needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dw_ih, db_ih, dw_hh, db_hh, dh0)`` of ``gru_sequence_fwd`` for ``needs`` (empty when unneeded)."""
    T, B, _ = x.shape
    H = w_hh.shape[1]
    plan = cell_plan("gru", B, H, x.dtype, x.dtype, x.device)
    dY = dY.to(x.dtype).contiguous()
    dXG, dHG = torch.empty_like(WS), torch.empty_like(HG)
    dh = gru_bwd_loop(plan, WS, HG, Y, dY, h0.contiguous(), w_hh, reverse, dXG, dHG, x.new_empty(B, H),
                      x.new_empty(B, H))
    dx, dw_ih, db_ih = _input_grads_for(needs, dXG, x, w_ih)
    dw_hh = _dw_hh(dHG, Y, h0, reverse) if needs[3] else None
    db_hh = dHG.reshape(T * B, -1).sum(0) if needs[4] else None
    dh0 = dh.clone() if needs[5] else None
    return tuple(_opt(t, x) for t in (dx, dw_ih, db_ih, dw_hh, db_hh, dh0))


@_gru_seq_bwd_op.register_fake
def _gru_seq_bwd_fake(dY, x, w_ih, w_hh, h0, WS, HG, Y, reverse, needs):
    b = w_ih.new_empty(w_ih.shape[0])
    full = (x, w_ih, b, w_hh, b, h0)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if n else _empty(x)
                 for t, n in zip(full, needs))


def _gru_seq_setup(ctx, inputs, output):
    x, w_ih, b_ih, w_hh, b_hh, h0, reverse = inputs
    Y, WS, HG = output
    ctx.reverse = reverse
    ctx.save_for_backward(x, w_ih, w_hh, h0, WS, HG, Y)


def _gru_seq_backward(ctx, dY, dWS, dHG):
    x, w_ih, w_hh, h0, WS, HG, Y = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:6])
    if dY is None:
        dY = torch.zeros_like(Y)
    grads = _gru_seq_bwd_op(dY, x, w_ih, w_hh, h0, WS, HG, Y, ctx.reverse, needs)
    return (*(g if n else None for g, n in zip(grads, needs)), None)


torch.library.register_autograd("culmen::gru_sequence_fwd", _gru_seq_backward, setup_context=_gru_seq_setup)
