"""``apex.RNN.RNNBackend``: the cell module ``RNNCell`` and its stacks ``stackedRNN`` / ``bidirectionalRNN``.

Everything is time-first: inputs are ``(seq_len, batch, features)`` (Apex's factories accept
``batch_first`` and ignore it; so does culmen). Cells keep their hidden state between calls, as Apex's
do: a forward continues from the state the previous forward left (a stateful language model), until
``reset_hidden`` zeroes it or ``detach_hidden`` cuts the graph behind it.

Apex steps every layer of the stack one time step at a time. culmen runs the stack layer by layer (the
same arithmetic): each layer's input projection for all steps is one GEMM, and LSTM / GRU layers without
an output projection run as one fused-sequence autograd node (``culmen.ops.rnn``): one recurrent GEMM
and one fused Triton cell per step, forward and backward. Cells with an overridden ``forward`` or a
cell function culmen does not know run step by step through ``forward``, exactly as in Apex.

Differences from Apex (its bugs, fixed):

* ``stackedRNN`` returns each hidden state as one ``(num_layers, batch, features)`` tensor, the layout
  its own docstring promises (Apex returned a list of per-layer tensors, which its ``bidirectionalRNN``
  then failed to concatenate). Indexing by layer gives the same tensors either way.
* With ``reverse=True`` the final hidden state is the state after the whole reversed pass (time step 0),
  not after its first step.
* ``dropout`` is applied between layers in training mode, like ``torch.nn.LSTM`` (Apex stored it and
  never used it).
* ``bidirectionalRNN.detach_hidden`` and ``init_inference`` work (Apex called methods that did not exist).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def is_iterable(maybe_iterable) -> bool:
    """Whether ``maybe_iterable`` is a list or a tuple."""
    return isinstance(maybe_iterable, (list, tuple))


def flatten_list(tens_list):
    """Stack a list / tuple of equally shaped tensors into one tensor along a new dim 0 (anything else
    is returned unchanged)."""
    if not is_iterable(tens_list):
        return tens_list
    return torch.stack(list(tens_list), 0)


def _check_input(module: nn.Module, input: Tensor, input_size: int) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"{type(module).__name__}: input must be a Tensor, got {type(input).__name__}")
    if input.dim() != 3 or input.shape[-1] != input_size:
        raise ValueError(f"{type(module).__name__}: input must be (seq_len, batch, {input_size}), "
                         f"got shape {tuple(input.shape)}")
    if input.shape[0] == 0 or input.shape[1] == 0:
        raise ValueError(f"{type(module).__name__}: input needs at least one step and one row, "
                         f"got shape {tuple(input.shape)}")


def _check_dropout(dropout) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise ValueError(f"dropout must be a number in [0, 1], got {dropout!r}")
    return float(dropout)


class _CellStack(nn.Module):
    """The hidden-state management shared by ``stackedRNN`` and ``bidirectionalRNN``: each call goes to every
    module of ``self.rnns`` (cells, or the two directions' stacks)."""

    rnns: nn.ModuleList

    def reset_parameters(self) -> None:
        """Re-draw every cell's parameters."""
        for rnn in self.rnns:
            rnn.reset_parameters()

    def init_hidden(self, bsz: int) -> None:
        """Create zero hidden states of batch ``bsz`` where a cell has none or another batch size."""
        for rnn in self.rnns:
            rnn.init_hidden(bsz)

    def detach_hidden(self) -> None:
        """Cut the autograd graph behind every cell's hidden state (truncated backpropagation)."""
        for rnn in self.rnns:
            rnn.detach_hidden()

    def reset_hidden(self, bsz: int) -> None:
        """Zero every cell's hidden state, for batch ``bsz``."""
        for rnn in self.rnns:
            rnn.reset_hidden(bsz)

    def init_inference(self, bsz: int) -> None:
        """Fresh zero hidden states of batch ``bsz`` (no graph), to start an inference run."""
        for rnn in self.rnns:
            rnn.init_inference(bsz)


class bidirectionalRNN(_CellStack):
    """Two independent ``stackedRNN`` of ``num_layers`` cells like ``inputRNN``: ``fwd`` reads the sequence
    forward, ``bckwrd`` backward; their outputs and hidden states are concatenated on the feature dim.

    As in Apex, each direction is a stack on its own (layer ``k + 1`` of a direction reads only layer ``k``
    of the same direction), unlike ``torch.nn.LSTM(bidirectional=True)``.
    """

    def __init__(self, inputRNN: RNNCell, num_layers: int = 1, dropout: float = 0) -> None:
        super().__init__()
        self.dropout = _check_dropout(dropout)
        self.fwd = stackedRNN(inputRNN, num_layers=num_layers, dropout=dropout)
        self.bckwrd = stackedRNN(inputRNN.new_like(), num_layers=num_layers, dropout=dropout)
        self.rnns = nn.ModuleList([self.fwd, self.bckwrd])

    def forward(self, input: Tensor, collect_hidden: bool = False):
        """Run both directions over ``input`` ``(seq_len, batch, input_size)``.

        Returns:
            ``(output, hiddens)``: ``output`` ``(seq_len, batch, 2 * output_size)`` (forward features first);
            ``hiddens`` a tuple with one entry per hidden state (``h`` then ``c`` for LSTMs) of
            ``(num_layers, batch, 2 * features)`` tensors, or with ``collect_hidden`` a list per state of
            ``seq_len`` such tensors (entry ``t`` is the state at input step ``t`` in both directions).
        """
        fwd_out, fwd_hiddens = self.fwd(input, collect_hidden=collect_hidden)
        bck_out, bck_hiddens = self.bckwrd(input, reverse=True, collect_hidden=collect_hidden)
        output = torch.cat([fwd_out, bck_out], -1)
        if collect_hidden:
            hiddens = tuple([torch.cat([a, b], -1) for a, b in zip(fs, bs)]
                            for fs, bs in zip(fwd_hiddens, bck_hiddens))
        else:
            hiddens = tuple(torch.cat([a, b], -1) for a, b in zip(fwd_hiddens, bck_hiddens))
        return output, hiddens


class stackedRNN(_CellStack):
    """``num_layers`` cells applied in sequence: layer ``k + 1`` reads layer ``k``'s output (``hidden[0]``).

    Args:
        inputRNN: an ``RNNCell`` (the first layer; the others are ``inputRNN.new_like(output_size)``) or a
            list of ``num_layers`` cells.
        num_layers: number of layers.
        dropout: dropout probability on every layer's output but the last, in training mode.
    """

    def __init__(self, inputRNN, num_layers: int = 1, dropout: float = 0) -> None:
        super().__init__()
        self.dropout = _check_dropout(dropout)
        if isinstance(inputRNN, RNNCell):
            if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
                raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
            rnns = [inputRNN]
            for _ in range(num_layers - 1):
                rnns.append(inputRNN.new_like(inputRNN.output_size))
        elif isinstance(inputRNN, list):
            if len(inputRNN) != num_layers:
                raise ValueError(f"RNN list length must be equal to num_layers: got {len(inputRNN)} cells "
                                 f"for num_layers={num_layers}")
            if not all(isinstance(r, RNNCell) for r in inputRNN):
                raise TypeError("stackedRNN: every entry of the inputRNN list must be an RNNCell")
            rnns = list(inputRNN)
        else:
            raise TypeError(f"stackedRNN: inputRNN must be an RNNCell or a list of them, got "
                            f"{type(inputRNN).__name__}")
        self.nLayers = len(rnns)
        self.rnns = nn.ModuleList(rnns)

    def forward(self, input: Tensor, collect_hidden: bool = False, reverse: bool = False):
        """Run the stack over ``input`` ``(seq_len, batch, input_size)``, continuing from the cells' states.

        Args:
            collect_hidden: also return every step's hidden states, not only the final ones.
            reverse: read the sequence from the last step to the first (outputs stay at their step's index).

        Returns:
            ``(output, hidden_states)``: ``output`` ``(seq_len, batch, output_size)``, the last layer's
            ``hidden[0]`` at every step; ``hidden_states`` a list with one entry per hidden state of the cell
            (``h``, then ``c`` for LSTMs): a ``(num_layers, batch, features)`` tensor of final states, or with
            ``collect_hidden`` a list of ``seq_len`` such tensors (entry ``t``: the states after step ``t``).
        """
        _check_input(self, input, self.rnns[0].input_size)
        prev = input
        per_layer = []
        last = self.nLayers - 1
        for k, rnn in enumerate(self.rnns):
            prev, states = rnn._forward_sequence(prev, reverse, collect_hidden)
            per_layer.append(states)
            if self.dropout and self.training and k < last:
                prev = F.dropout(prev, self.dropout, True)
        n_hid = len(per_layer[0])
        hidden_states = [torch.stack([states[i] for states in per_layer], 0) for i in range(n_hid)]
        if collect_hidden:
            # (layers, seq, batch, f) -> seq_len views of (layers, batch, f)
            hidden_states = [list(h.unbind(1)) for h in hidden_states]
        return prev, hidden_states


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class RNNCell(nn.Module):
    """One recurrent layer: parameters, hidden state, and one time step per ``forward``.

    Args:
        gate_multiplier: gates per hidden unit (4 for LSTM-like cells, 3 for GRU, 1 for plain RNNs).
        input_size: features of the input.
        hidden_size: units of the cell state.
        cell: the step function ``cell(input, hidden, w_ih, w_hh, b_ih=None, b_hh=None)`` returning the new
            hidden state (a tensor, or a tuple when ``n_hidden_states > 1``), e.g. ``culmen.RNN.cells.LSTMCell``.
        n_hidden_states: hidden tensors the cell carries (2 for LSTM: ``h`` and ``c``; 1 otherwise).
        bias: add ``b_ih`` and ``b_hh``.
        output_size: when not ``hidden_size``, ``hidden[0]`` is projected to ``output_size`` features by
            ``w_ho`` after every step (and the recurrence reads the projected state).

    Parameters: ``w_ih (gate_size, input_size)``, ``w_hh (gate_size, output_size)``, ``w_ho (output_size,
    hidden_size)`` when projecting, ``b_ih``, ``b_hh (gate_size,)`` with bias; ``gate_size = gate_multiplier *
    hidden_size``. All start uniform in ``+-1/sqrt(hidden_size)``. The hidden state ``self.hidden`` is a list:
    ``hidden[0]`` ``(batch, output_size)``, the others ``(batch, hidden_size)``, in the parameters' dtype.
    """

    def __init__(self, gate_multiplier: int, input_size: int, hidden_size: int, cell: Callable,
                 n_hidden_states: int = 2, bias: bool = False, output_size: int | None = None) -> None:
        super().__init__()
        self.gate_multiplier = _positive("gate_multiplier", gate_multiplier)
        self.input_size = _positive("input_size", input_size)
        self.hidden_size = _positive("hidden_size", hidden_size)
        if not callable(cell):
            raise TypeError(f"cell must be callable, got {type(cell).__name__}")
        self.cell = cell
        self.bias = bias
        self.output_size = hidden_size if output_size is None else _positive("output_size", output_size)
        self.gate_size = gate_multiplier * self.hidden_size
        self.n_hidden_states = _positive("n_hidden_states", n_hidden_states)

        self.w_ih = nn.Parameter(torch.empty(self.gate_size, self.input_size))
        self.w_hh = nn.Parameter(torch.empty(self.gate_size, self.output_size))
        if self.output_size != self.hidden_size:
            self.w_ho = nn.Parameter(torch.empty(self.output_size, self.hidden_size))
        self.b_ih = self.b_hh = None
        if self.bias:
            self.b_ih = nn.Parameter(torch.empty(self.gate_size))
            self.b_hh = nn.Parameter(torch.empty(self.gate_size))
        self.hidden: list[Tensor | None] = [None] * self.n_hidden_states
        self.reset_parameters()

    @property
    def _w_ho(self) -> Tensor | None:
        return self.w_ho if self.output_size != self.hidden_size else None

    def new_like(self, new_input_size: int | None = None) -> RNNCell:
        """A fresh cell of the same kind (new parameters), reading ``new_input_size`` features (default: the same)."""
        if new_input_size is None:
            new_input_size = self.input_size
        return type(self)(self.gate_multiplier, new_input_size, self.hidden_size, self.cell, self.n_hidden_states,
                          self.bias, self.output_size)

    def reset_parameters(self, gain: float = 1) -> None:
        """Draw every parameter uniformly in ``+-1/sqrt(hidden_size)`` (``gain`` is accepted and unused, as in Apex)."""
        stdev = 1.0 / math.sqrt(self.hidden_size)
        with torch.no_grad():
            for param in self.parameters():
                param.uniform_(-stdev, stdev)

    def init_hidden(self, bsz: int) -> None:
        """Give every hidden state that is missing, or of another batch size, zeros of ``(bsz, features)``
        in the parameters' dtype and device; states of batch ``bsz`` are kept (the recurrence continues),
        moved to the parameters' dtype and device if the module was converted since (Apex kept them as
        they were, and the next step failed on the mismatch)."""
        p = self.w_ih
        for i, h in enumerate(self.hidden):
            if h is None or h.shape[0] != bsz:
                size = self.output_size if i == 0 else self.hidden_size
                self.hidden[i] = torch.zeros(bsz, size, dtype=p.dtype, device=p.device)
            elif h.dtype != p.dtype or h.device != p.device:
                self.hidden[i] = h.to(device=p.device, dtype=p.dtype)

    def reset_hidden(self, bsz: int) -> None:
        """Zero the hidden state, for batch ``bsz``."""
        self.hidden = [None] * self.n_hidden_states
        self.init_hidden(bsz)

    def detach_hidden(self) -> None:
        """Cut the autograd graph behind the hidden state (truncated backpropagation through time).

        Raises ``RuntimeError`` when the hidden state was never initialized (as Apex does)."""
        if any(h is None for h in self.hidden):
            raise RuntimeError("Must initialize hidden state before you can detach it")
        self.hidden = [h.detach() for h in self.hidden]

    def init_inference(self, bsz: int) -> None:
        """Fresh zero hidden states of batch ``bsz``, outside any graph, to start an inference run."""
        self.reset_hidden(bsz)

    def forward(self, input: Tensor) -> tuple[Tensor, ...]:
        """One time step: ``input`` ``(batch, input_size)`` -> the new hidden state as a tuple
        (``hidden[0]`` ``(batch, output_size)`` first). Hidden states are created (zeros) on the first call
        and whenever the batch size changes."""
        self.init_hidden(input.shape[0])
        hidden_state = self.hidden[0] if self.n_hidden_states == 1 else self.hidden
        new = self.cell(input, hidden_state, self.w_ih, self.w_hh, b_ih=self.b_ih, b_hh=self.b_hh)
        self.hidden = list(new) if self.n_hidden_states > 1 else [new]
        if self.output_size != self.hidden_size:
            self.hidden[0] = F.linear(self.hidden[0], self.w_ho)
        return tuple(self.hidden)

    def _forward_sequence(self, input: Tensor, reverse: bool, collect: bool) -> tuple[Tensor, list[Tensor]]:
        """The layer over a whole ``(seq_len, batch, input_size)`` input, continuing from (and then updating)
        ``self.hidden``. Returns ``hidden[0]`` at every step and, per hidden state, every step's value
        ``(seq_len, batch, f)`` (``collect``) or the final one ``(batch, f)``."""
        from culmen.RNN._sequence import run_sequence

        return run_sequence(self, input, reverse, collect)
