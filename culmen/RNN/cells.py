"""``apex.RNN.cells``: the multiplicative LSTM cell (``mLSTMRNNCell`` / ``mLSTMCell``) and the step functions
of the standard cells (``LSTMCell``, ``GRUCell``, ``RNNReLUCell``, ``RNNTanhCell``; Apex took these from
``torch.nn._functions.rnn``, which PyTorch has since removed).

Every step function has the signature ``cell(input, hidden, w_ih, w_hh, b_ih=None, b_hh=None)`` with
``input (batch, input_size)``; the GEMMs run in cuBLAS (``F.linear``) and the LSTM / GRU pointwise part in
culmen's fused cell (``culmen.ops.rnn``: one Triton kernel on GPUs, the PyTorch formula on CPU).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from culmen.ops.rnn import gru_cell, lstm_cell
from culmen.RNN.RNNBackend import RNNCell


def LSTMCell(input: Tensor, hidden: tuple[Tensor, Tensor], w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
             b_hh: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One LSTM step: ``hidden = (hx, cx)`` -> ``(hy, cy)``, gates ``[i | f | g | o]`` of
    ``input W_ih^T + b_ih + hx W_hh^T + b_hh`` (``w_ih (4H, I)``, ``w_hh (4H, hx features)``)."""
    hx, cx = hidden
    return lstm_cell(F.linear(input, w_ih, b_ih) + F.linear(hx, w_hh, b_hh), cx)


def GRUCell(input: Tensor, hidden: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
            b_hh: Tensor | None = None) -> Tensor:
    """One GRU step: ``hidden (batch, H)`` -> the new hidden state (gates ``[r | z | n]``, PyTorch's GRU)."""
    return gru_cell(F.linear(input, w_ih, b_ih), F.linear(hidden, w_hh, b_hh), hidden)


def RNNReLUCell(input: Tensor, hidden: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
                b_hh: Tensor | None = None) -> Tensor:
    """One Elman step with ReLU: ``relu(input W_ih^T + b_ih + hidden W_hh^T + b_hh)``."""
    return F.relu(F.linear(input, w_ih, b_ih) + F.linear(hidden, w_hh, b_hh))


def RNNTanhCell(input: Tensor, hidden: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
                b_hh: Tensor | None = None) -> Tensor:
    """One Elman step with tanh: ``tanh(input W_ih^T + b_ih + hidden W_hh^T + b_hh)``."""
    return torch.tanh(F.linear(input, w_ih, b_ih) + F.linear(hidden, w_hh, b_hh))


def mLSTMCell(input: Tensor, hidden: tuple[Tensor, Tensor], w_ih: Tensor, w_hh: Tensor, w_mih: Tensor,
              w_mhh: Tensor, b_ih: Tensor | None = None, b_hh: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One multiplicative-LSTM step (Krause et al.): ``m = (input W_mih^T) * (hx W_mhh^T)`` replaces ``hx``
    in the recurrent GEMM: gates = ``input W_ih^T + b_ih + m W_hh^T + b_hh``, then the LSTM update.
    Returns ``(hy, cy)``."""
    hx, cx = hidden
    m = F.linear(input, w_mih) * F.linear(hx, w_mhh)
    return lstm_cell(F.linear(input, w_ih, b_ih) + F.linear(m, w_hh, b_hh), cx)


class mLSTMRNNCell(RNNCell):
    """The multiplicative LSTM layer: an ``RNNCell`` (4 gates, ``h`` and ``c``) with two more parameters,
    ``w_mih (output_size, input_size)`` and ``w_mhh (output_size, output_size)``.

    Args:
        input_size, hidden_size: features of the input and units of the cell.
        bias: add ``b_ih`` / ``b_hh``.
        output_size: project ``h`` to this many features with ``w_ho`` (default ``hidden_size``: none).
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool = False, output_size: int | None = None) -> None:
        super().__init__(4, input_size, hidden_size, mLSTMCell, n_hidden_states=2, bias=bias,
                         output_size=output_size)
        self.w_mih = nn.Parameter(torch.empty(self.output_size, self.input_size))
        self.w_mhh = nn.Parameter(torch.empty(self.output_size, self.output_size))
        self.reset_parameters()

    def forward(self, input: Tensor) -> tuple[Tensor, Tensor]:
        """One time step: ``input (batch, input_size)`` -> ``(h, c)``, hidden states created as in ``RNNCell``."""
        self.init_hidden(input.shape[0])
        self.hidden = list(self.cell(input, self.hidden, self.w_ih, self.w_hh, self.w_mih, self.w_mhh,
                                     b_ih=self.b_ih, b_hh=self.b_hh))
        if self.output_size != self.hidden_size:
            self.hidden[0] = F.linear(self.hidden[0], self.w_ho)
        return tuple(self.hidden)

    def new_like(self, new_input_size: int | None = None) -> mLSTMRNNCell:
        """A fresh ``mLSTMRNNCell`` with the same sizes, reading ``new_input_size`` features (default: the same)."""
        if new_input_size is None:
            new_input_size = self.input_size
        return type(self)(new_input_size, self.hidden_size, self.bias, self.output_size)
