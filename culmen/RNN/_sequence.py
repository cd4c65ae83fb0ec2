"""How an ``RNNCell`` runs a whole sequence: the fast paths of the known cells, and the step-by-step fallback.

Known cells (the step functions of ``culmen.RNN.cells`` in a cell whose ``forward`` is not overridden)
compute the input projection of every step as one GEMM, then:

* LSTM / GRU without output projection: ``culmen.ops.rnn.lstm_sequence`` / ``gru_sequence`` (one autograd
  node per layer: per step one recurrent GEMM and one fused cell kernel, forward and backward);
* LSTM with projection, mLSTM, ReLU / tanh RNNs: a step loop with one recurrent GEMM (``addmm`` onto the
  precomputed input gates) and the fused LSTM cell where there is one.

Any other cell runs ``cell(input[t])`` step by step: exactly Apex's computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.ops.rnn import gru_sequence, lstm_cell, lstm_sequence
from culmen.RNN.cells import GRUCell, LSTMCell, RNNReLUCell, RNNTanhCell, mLSTMCell, mLSTMRNNCell
from culmen.RNN.RNNBackend import RNNCell


def _steps(T: int, reverse: bool) -> range:
    return range(T - 1, -1, -1) if reverse else range(T)


def _finish(cell: RNNCell, seqs: list[Tensor], reverse: bool, collect: bool) -> list[Tensor]:
    """Store the final states in ``cell.hidden``; return what ``_forward_sequence`` returns for the states."""
    last = 0 if reverse else -1
    cell.hidden = [s[last] for s in seqs]
    return seqs if collect else list(cell.hidden)


def _input_gates(cell: RNNCell, x: Tensor) -> Tensor:
    """``x W_ih^T + b_ih + b_hh`` for every step at once ``(T, B, gate_size)``: both biases ride on the GEMM."""
    b = cell.b_ih
    if b is not None and cell.b_hh is not None:
        b = b + cell.b_hh
    elif b is None:
        b = cell.b_hh
    return F.linear(x, cell.w_ih, b)


def _lstm_fused(cell: RNNCell, x: Tensor, reverse: bool, collect: bool):
    h0, c0 = cell.hidden
    y, cs = lstm_sequence(x, cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh, h0, c0, reverse)
    return y, _finish(cell, [y, cs], reverse, collect)


def _gru_fused(cell: RNNCell, x: Tensor, reverse: bool, collect: bool):
    y = gru_sequence(x, cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh, cell.hidden[0], reverse)
    return y, _finish(cell, [y], reverse, collect)


def _lstm_like_steps(cell: RNNCell, x: Tensor, reverse: bool, collect: bool, multiplicative: bool):
    """LSTM with a projection, or mLSTM (either projected or not): one step loop on precomputed input gates."""
    T = x.shape[0]
    xg = _input_gates(cell, x).unbind(0)
    xm = F.linear(x, cell.w_mih).unbind(0) if multiplicative else None
    w_hh_t = cell.w_hh.t()
    w_mhh, w_ho = (cell.w_mhh if multiplicative else None), cell._w_ho
    h, c = cell.hidden
    hs: list[Tensor | None] = [None] * T
    cs: list[Tensor | None] = [None] * T
    for t in _steps(T, reverse):
        r = xm[t] * F.linear(h, w_mhh) if multiplicative else h
        h, c = lstm_cell(torch.addmm(xg[t], r, w_hh_t), c)
        if w_ho is not None:
            h = F.linear(h, w_ho)
        hs[t], cs[t] = h, c
    y = torch.stack(hs)
    return y, _finish(cell, [y, torch.stack(cs)], reverse, collect)


def _elman_steps(cell: RNNCell, x: Tensor, reverse: bool, collect: bool, act):
    T = x.shape[0]
    xg = _input_gates(cell, x).unbind(0)
    w_hh_t, w_ho = cell.w_hh.t(), cell._w_ho
    h = cell.hidden[0]
    hs: list[Tensor | None] = [None] * T
    for t in _steps(T, reverse):
        h = act(torch.addmm(xg[t], h, w_hh_t))
        if w_ho is not None:
            h = F.linear(h, w_ho)
        hs[t] = h
    y = torch.stack(hs)
    return y, _finish(cell, [y], reverse, collect)


def _generic_steps(cell: RNNCell, x: Tensor, reverse: bool, collect: bool):
    """Any cell: its own ``forward`` once per step (Apex's computation)."""
    T = x.shape[0]
    per_state: list[list[Tensor | None]] = [[None] * T for _ in range(cell.n_hidden_states)]
    for t in _steps(T, reverse):
        outs = cell(x[t])
        for i, o in enumerate(outs):
            per_state[i][t] = o
    seqs = [torch.stack(s) for s in per_state]
    return seqs[0], (seqs if collect else list(cell.hidden))


def run_sequence(cell: RNNCell, x: Tensor, reverse: bool, collect: bool) -> tuple[Tensor, list[Tensor]]:
    """``cell`` over ``x`` ``(T, B, input_size)`` from ``cell.hidden`` (created / resized first); see
    ``RNNCell._forward_sequence``."""
    cell.init_hidden(x.shape[1])
    fn, own = cell.cell, type(cell).forward
    projected = cell.output_size != cell.hidden_size
    if own is RNNCell.forward:
        if fn is LSTMCell:
            if projected:
                return _lstm_like_steps(cell, x, reverse, collect, multiplicative=False)
            return _lstm_fused(cell, x, reverse, collect)
        if fn is GRUCell and not projected:
            return _gru_fused(cell, x, reverse, collect)
        if fn is RNNReLUCell:
            return _elman_steps(cell, x, reverse, collect, F.relu)
        if fn is RNNTanhCell:
            return _elman_steps(cell, x, reverse, collect, torch.tanh)
    elif own is mLSTMRNNCell.forward and fn is mLSTMCell:
        return _lstm_like_steps(cell, x, reverse, collect, multiplicative=True)
    return _generic_steps(cell, x, reverse, collect)
