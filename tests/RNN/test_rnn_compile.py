"""culmen.RNN and ``culmen.ops.rnn`` under ``torch.compile(fullgraph=True)``: the sequence ops are opaque custom
ops (``culmen::lstm_sequence_fwd`` / ``_bwd``, ``culmen::gru_sequence_fwd`` / ``_bwd``), so the time loop is
one graph node, and the Triton cells are ``culmen::lstm_cell_*`` / ``culmen::gru_cell_*``. Compiled calls
equal eager ones in the outputs and the gradients of every input (weights and initial states included)."""

from __future__ import annotations

import copy

import pytest
import torch

import culmen.RNN as RNN
from culmen.ops.rnn import gru_cell, gru_sequence, lstm_cell, lstm_sequence


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _leaves(*shapes, dtype=torch.float32):
    return [(torch.randn(s, dtype=dtype) * 0.5).requires_grad_(True) for s in shapes]


def _check_same(fn, inputs, n_out=1):
    """``fn(*inputs)`` eager and compiled: equal outputs and gradients of every input."""
    res = []
    for f in (fn, _compile(fn)):
        outs = f(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        assert len(outs) == n_out
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)
        res.append((*outs, *torch.autograd.grad(loss, inputs)))
    for i, (a, b) in enumerate(zip(res[1], res[0])):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        torch.testing.assert_close(a, b, msg=f"result {i}")


def _graph_targets(fn, inputs) -> list[str]:
    """The ``culmen::`` ops in the forward and backward aot graphs of ``fn``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def collect(g, _):
        seen.extend(str(n.target) for n in g.graph.nodes if "culmen" in str(n.target))
        return make_boxed_func(g)

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=collect, bw_compiler=collect))(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    return seen


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_layer_compiled_equals_eager(kind):
    """A two-layer culmen.RNN stack (fresh zero states) over a sequence: output and every parameter's gradient."""
    torch.manual_seed(0)
    model = (RNN.LSTM if kind == "lstm" else RNN.GRU)(3, 5, 2)
    twin, third = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(4, 2, 3, requires_grad=True)
    outs = []
    for m, f in ((model, model), (twin, _compile(twin))):
        y, hiddens = f(x)
        loss = (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum() + hiddens[-1].sum()
        outs.append((y, *hiddens, *torch.autograd.grad(loss, (x, *m.parameters()))))
    assert len(outs[0]) == len(outs[1])
    ops = _graph_targets(third, (x,))
    assert ops.count(f"culmen.{kind}_sequence_fwd.default") == 2, ops  # one node per layer
    for i, (a, b) in enumerate(zip(outs[1], outs[0])):
        torch.testing.assert_close(a, b, msg=f"result {i}")


@pytest.mark.parametrize("reverse", [False, True])
def test_lstm_sequence_compiled(reverse):
    T, B, In, H = 3, 2, 4, 5
    x, w_ih, w_hh, b_ih, b_hh, h0, c0 = _leaves((T, B, In), (4 * H, In), (4 * H, H), (4 * H,), (4 * H,), (B, H),
                                                (B, H))
    _check_same(lambda *a: lstm_sequence(*a, reverse=reverse), (x, w_ih, w_hh, b_ih, b_hh, h0, c0), n_out=2)


def test_gru_sequence_compiled():
    T, B, In, H = 4, 3, 2, 3
    x, w_ih, w_hh, b_ih, b_hh, h0 = _leaves((T, B, In), (3 * H, In), (3 * H, H), (3 * H,), (3 * H,), (B, H))
    _check_same(lambda *a: gru_sequence(*a, reverse=True), (x, w_ih, w_hh, b_ih, b_hh, h0))


def test_sequence_loop_is_one_node():
    """Forward and backward each hold the layer's custom op, not a traced step loop."""
    T, B, In, H = 5, 2, 3, 4
    x, w_ih, w_hh, h0, c0 = _leaves((T, B, In), (4 * H, In), (4 * H, H), (B, H), (B, H))
    ops = _graph_targets(lambda *a: lstm_sequence(a[0], a[1], a[2], None, None, a[3], a[4]), (x, w_ih, w_hh, h0, c0))
    assert ops.count("culmen.lstm_sequence_fwd.default") == 1, ops
    assert ops.count("culmen.lstm_sequence_bwd.default") == 1, ops
    x, w_ih, w_hh, h0 = _leaves((T, B, In), (3 * H, In), (3 * H, H), (B, H))
    ops = _graph_targets(lambda *a: gru_sequence(a[0], a[1], a[2], None, None, a[3]), (x, w_ih, w_hh, h0))
    assert ops == ["culmen.gru_sequence_fwd.default", "culmen.gru_sequence_bwd.default"], ops


def test_cells_compiled_triton(triton_backend):
    B, H = 3, 5
    gates, cx = _leaves((B, 4 * H), (B, H))
    _check_same(lstm_cell, (gates, cx), n_out=2)
    assert "culmen.lstm_cell_fwd.default" in _graph_targets(lstm_cell, (gates, cx))
    xg, hg, hx = _leaves((B, 3 * H), (B, 3 * H), (B, H))
    _check_same(gru_cell, (xg, hg, hx))
    assert "culmen.gru_cell_bwd.default" in _graph_targets(gru_cell, (xg, hg, hx))


def test_cells_compiled_reference(reference_backend):
    B, H = 2, 3
    _check_same(lstm_cell, tuple(_leaves((B, 4 * H), (B, H))), n_out=2)
    _check_same(gru_cell, tuple(_leaves((B, 3 * H), (B, 3 * H), (B, H))))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_layer_compiled_inductor_gpu(kind):
    torch.manual_seed(0)
    model = (RNN.LSTM if kind == "lstm" else RNN.GRU)(64, 128, 2).cuda()
    twin = copy.deepcopy(model)
    x = torch.randn(16, 8, 64, device="cuda", requires_grad=True)
    outs = []
    for m, f in ((model, model), (twin, torch.compile(twin, fullgraph=True))):
        y, _ = f(x)
        outs.append((y, *torch.autograd.grad(y.square().sum(), (x, *m.parameters()))))
    for i, (a, b) in enumerate(zip(outs[1], outs[0])):
        torch.testing.assert_close(a, b, msg=f"result {i}")
