"""``apex.RNN``: stacked and bidirectional LSTM, GRU, ReLU / tanh RNN and multiplicative LSTM layers with
an optional output projection and hidden states kept across calls (``init_hidden``, ``reset_hidden``,
``detach_hidden``, ``init_inference``).

Modules as in Apex: ``models`` (the factories ``LSTM``, ``GRU``, ``ReLU``, ``Tanh``, ``mLSTM``),
``RNNBackend`` (``RNNCell``, ``stackedRNN``, ``bidirectionalRNN``) and ``cells`` (``mLSTMRNNCell`` and
the step functions). Apex removed this package in 2025; culmen keeps it, on fused Triton cells
(``culmen.ops.rnn``) with a PyTorch path on CPU. See ``RNNBackend``'s docstring for where culmen
differs from Apex (the bugs it fixes).

On CUDA, from a layer signature's second call on, each LSTM / GRU layer replays its forward and backward
time loops as CUDA graphs (one launch per layer instead of two per time step; outputs are not copied and
never overwritten while referenced). ``set_cuda_graphs(False)`` (or ``CULMEN_RNN_CUDA_GRAPHS=0``) runs the
eager step loop instead; ``clear_cuda_graphs()`` frees the cached graphs and buffers. Graphs are never used
on CPU, inside an outer CUDA-graph capture or under ``torch.compile``. See ``culmen.ops.rnn.graphs``.

Under ``torch.compile`` (``fullgraph=True`` works) each LSTM / GRU layer is one opaque custom op forward and
one backward (``culmen::lstm_sequence_fwd`` / ``_bwd``, ``culmen::gru_sequence_fwd`` / ``_bwd``) that run
the eager step loop: Dynamo never traces the time loop step by step. See ``culmen.ops.rnn.op``.
"""

from culmen.ops.rnn.graphs import clear_cuda_graphs, cuda_graphs_enabled, set_cuda_graphs  # noqa: F401
from culmen.RNN import RNNBackend, cells, models  # noqa: F401
from culmen.RNN.models import GRU, LSTM, ReLU, Tanh, mLSTM  # noqa: F401  (Apex's package namespace)

# Apex's __all__: a star import of apex.RNN gives the ``models`` module; the factories are attributes.
__all__ = ["models"]
