"""``apex.RNN.models``: the factories ``LSTM``, ``GRU``, ``ReLU``, ``Tanh``, ``mLSTM`` and ``toRNNBackend``.

Each factory builds one cell and stacks it: a ``stackedRNN`` of ``num_layers`` cells, or a
``bidirectionalRNN`` (two such stacks) with ``bidirectional=True``. Inputs are time-first
``(seq_len, batch, input_size)``; ``batch_first`` is accepted and ignored, as in Apex. ``output_size``
(default ``hidden_size``) projects every step's ``h`` to ``output_size`` features (``w_ho``), and the
next layer and the recurrence read the projected state.
"""

from __future__ import annotations

from culmen.RNN.cells import GRUCell, LSTMCell, RNNReLUCell, RNNTanhCell, mLSTMCell, mLSTMRNNCell
from culmen.RNN.RNNBackend import RNNCell, bidirectionalRNN, stackedRNN

__all__ = ["GRU", "LSTM", "ReLU", "Tanh", "mLSTM", "toRNNBackend", "RNNCell", "bidirectionalRNN", "stackedRNN",
           "LSTMCell", "GRUCell", "RNNReLUCell", "RNNTanhCell", "mLSTMCell", "mLSTMRNNCell"]


def toRNNBackend(inputRNN: RNNCell, num_layers: int, bidirectional: bool = False, dropout: float = 0):
    """Stack ``inputRNN``: ``bidirectionalRNN(inputRNN, num_layers, dropout)`` when ``bidirectional``, else
    ``stackedRNN(inputRNN, num_layers, dropout)``."""
    if bidirectional:
        return bidirectionalRNN(inputRNN, num_layers, dropout=dropout)
    return stackedRNN(inputRNN, num_layers, dropout=dropout)


def LSTM(input_size: int, hidden_size: int, num_layers: int, bias: bool = True, batch_first: bool = False,
         dropout: float = 0, bidirectional: bool = False, output_size: int | None = None):
    """A stacked LSTM (gates ``[i | f | g | o]`` as in ``torch.nn.LSTM``); hidden states ``(h, c)``.

    Returns a ``stackedRNN`` (or ``bidirectionalRNN``) whose ``forward(input, collect_hidden=False)`` maps
    ``(seq_len, batch, input_size)`` to ``(output (seq_len, batch, output_size [x2]), hidden_states)``.
    On GPUs each layer without projection runs as one fused-sequence op (Triton cell, cuBLAS GEMMs).
    """
    inputRNN = RNNCell(4, input_size, hidden_size, LSTMCell, 2, bias, output_size)
    return toRNNBackend(inputRNN, num_layers, bidirectional, dropout=dropout)


def GRU(input_size: int, hidden_size: int, num_layers: int, bias: bool = True, batch_first: bool = False,
        dropout: float = 0, bidirectional: bool = False, output_size: int | None = None):
    """A stacked GRU (gates ``[r | z | n]`` as in ``torch.nn.GRU``); one hidden state.

    ``output_size`` other than ``hidden_size`` raises ``ValueError``: the GRU update mixes the previous
    state with ``hidden_size`` features, so a projected state cannot feed it (Apex failed in the first step).
    """
    if output_size is not None and output_size != hidden_size:
        raise ValueError(f"GRU cannot project its state: output_size={output_size!r} must be None or "
                         f"hidden_size={hidden_size!r}")
    inputRNN = RNNCell(3, input_size, hidden_size, GRUCell, 1, bias, output_size)
    return toRNNBackend(inputRNN, num_layers, bidirectional, dropout=dropout)


def ReLU(input_size: int, hidden_size: int, num_layers: int, bias: bool = True, batch_first: bool = False,
         dropout: float = 0, bidirectional: bool = False, output_size: int | None = None):
    """A stacked Elman RNN with ReLU: ``h' = relu(x W_ih^T + b_ih + h W_hh^T + b_hh)``; one hidden state."""
    inputRNN = RNNCell(1, input_size, hidden_size, RNNReLUCell, 1, bias, output_size)
    return toRNNBackend(inputRNN, num_layers, bidirectional, dropout=dropout)


def Tanh(input_size: int, hidden_size: int, num_layers: int, bias: bool = True, batch_first: bool = False,
         dropout: float = 0, bidirectional: bool = False, output_size: int | None = None):
    """A stacked Elman RNN with tanh: ``h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh)``; one hidden state."""
    inputRNN = RNNCell(1, input_size, hidden_size, RNNTanhCell, 1, bias, output_size)
    return toRNNBackend(inputRNN, num_layers, bidirectional, dropout=dropout)


def mLSTM(input_size: int, hidden_size: int, num_layers: int, bias: bool = True, batch_first: bool = False,
          dropout: float = 0, bidirectional: bool = False, output_size: int | None = None):
    """A stacked multiplicative LSTM (``mLSTMRNNCell``); hidden states ``(h, c)``."""
    inputRNN = mLSTMRNNCell(input_size, hidden_size, bias=bias, output_size=output_size)
    return toRNNBackend(inputRNN, num_layers, bidirectional, dropout=dropout)
