"""Fused LSTM / GRU pointwise cells in Triton, with a PyTorch reference (the ops behind ``culmen.RNN``).

Layers (DESIGN.md): Triton kernels in ``kernels.py``; the cached ``CellPlan`` (backend, tile, bound
launches) in ``launch.py``; the reference cells (the oracle and the CPU path) in ``reference.py``; the
one-step ops ``lstm_cell`` / ``gru_cell`` and the whole-layer ops ``lstm_sequence`` / ``gru_sequence``
(one autograd node per layer, GEMMs in cuBLAS) in ``op.py``; their time loops in ``loops.py``, replayed as
CUDA graphs by ``graphs.py`` (switch: ``set_cuda_graphs``).
"""

from culmen.ops.rnn.graphs import clear_cuda_graphs, cuda_graphs_enabled, set_cuda_graphs
from culmen.ops.rnn.op import gru_cell, gru_sequence, lstm_cell, lstm_sequence
from culmen.ops.rnn.reference import gru_cell_ref, lstm_cell_ref

__all__ = ["clear_cuda_graphs", "cuda_graphs_enabled", "gru_cell", "gru_cell_ref", "gru_sequence", "lstm_cell",
           "lstm_cell_ref", "lstm_sequence", "set_cuda_graphs"]
