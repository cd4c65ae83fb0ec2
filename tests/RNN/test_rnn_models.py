"""culmen.RNN (Apex's apex.RNN): the factories against a float64 step-by-step reference and torch.nn's RNNs,
gradients of inputs, weights and initial hidden states, bidirectional stacks, output projection, mLSTM,
the hidden-state API, dropout, Apex's parameter names, bad arguments, and the ``apex.RNN`` alias."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from rnn_ref import cell_params, ref_stack, torch_peer

import culmen.RNN as RNN
from culmen.ops.backend import use_backend
from culmen.RNN.RNNBackend import RNNCell, stackedRNN
from culmen.testing.tolerance import assert_close_tolerance

ROOT = Path(__file__).resolve().parents[2]
FACTORY = {"lstm": RNN.LSTM, "gru": RNN.GRU, "relu": RNN.ReLU, "tanh": RNN.Tanh, "mlstm": RNN.mLSTM}


def _with_initial_states(stack, B, dtype=torch.float64):
    """Random initial states (leaves) put into every cell; returns them per layer."""
    states = []
    for cell in stack.rnns:
        sizes = [cell.output_size] + [cell.hidden_size] * (cell.n_hidden_states - 1)
        st = [torch.randn(B, s, dtype=torch.float64).mul_(0.5).to(dtype).requires_grad_(True) for s in sizes]
        cell.hidden = list(st)
        states.append(st)
    return states


def _compare_stack(kind, stack, T=5, B=3, dtype=torch.float64, backend=None, reverse=False, collect=False):
    """Run ``stack`` (a stackedRNN) in ``dtype`` and the float64 reference; compare outputs, final states and
    the gradients of the input, every parameter and every initial state."""
    In = stack.rnns[0].input_size
    params = [cell_params(c) for c in stack.rnns]
    x64 = torch.randn(T, B, In, dtype=torch.float64, requires_grad=True)
    st64 = _with_initial_states(stack, B)
    ref_out, hist = ref_stack(kind, params, x64, st64, reverse)
    stack.to(dtype)
    x = x64.detach().to(dtype).requires_grad_(True)
    st = _with_initial_states(stack, B, dtype)
    for cell_st, s64 in zip(st, st64):
        for a, b in zip(cell_st, s64):
            a.data.copy_(b.detach())
    with use_backend(backend or "auto"):
        out, hidden = stack(x, collect_hidden=collect, reverse=reverse)
    assert out.dtype == dtype
    assert_close_tolerance(out, ref_out, None, name="output", atol=3e-5 if dtype == torch.float32 else None)
    last = 0 if reverse else -1
    for i, h in enumerate(hidden):
        if collect:
            assert len(h) == T
            for t in (0, T - 1):
                ref_t = torch.stack([layer[i][t] for layer in hist])
                assert_close_tolerance(h[t], ref_t, None, name=f"state{i} step{t}", atol=3e-5)
        else:
            ref_h = torch.stack([layer[i][last] for layer in hist])
            assert_close_tolerance(h, ref_h, None, name=f"hidden{i}", atol=3e-5)
    # The cells keep the final state for the next call.
    assert_close_tolerance(stack.rnns[-1].hidden[0], hist[-1][0][last], None, name="kept state", atol=3e-5)
    dy = torch.randn_like(ref_out)
    leaves64 = [x64] + [p for ps in params for p in ps.values()] + [s for ss in st64 for s in ss]
    leaves = [x] + [p for c in stack.rnns for p in c.parameters()] + [s for ss in st for s in ss]
    ref_g = torch.autograd.grad((ref_out * dy).sum(), leaves64)
    g = torch.autograd.grad((out * dy.to(dtype)).sum(), leaves)
    for i, (a, r) in enumerate(zip(g, ref_g)):
        assert_close_tolerance(a, r, None, name=f"grad {i}", atol=1e-4 if dtype == torch.float32 else None)


@pytest.mark.parametrize("kind", ["lstm", "gru", "relu", "tanh", "mlstm"])
def test_every_factory_two_layers_float64(kind):
    _compare_stack(kind, FACTORY[kind](4, 5, 2))


@pytest.mark.parametrize("kind", ["lstm", "mlstm", "relu"])
def test_output_projection(kind):
    stack = FACTORY[kind](3, 6, 2, output_size=4)
    assert tuple(stack.rnns[0].w_ho.shape) == (4, 6) and tuple(stack.rnns[1].w_ih.shape[1:]) == (4,)
    _compare_stack(kind, stack, reverse=kind == "lstm")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fused_layers_on_the_triton_kernels_fp32(kind):
    _compare_stack(kind, FACTORY[kind](3, 5, 2, bias=kind == "lstm"), T=4, B=2, dtype=torch.float32,
                   backend="triton")


def test_reverse_and_collect_hidden():
    _compare_stack("lstm", RNN.LSTM(3, 4, 2), reverse=True, collect=True)
    _compare_stack("gru", RNN.GRU(3, 4, 1), collect=True)


@pytest.mark.parametrize("kind", ["lstm", "gru", "tanh"])
def test_matches_torch_nn_unidirectional_and_projection(kind):
    stack = FACTORY[kind](6, 5, 2, output_size=3 if kind == "lstm" else None).double()
    peer = torch_peer(kind, stack)
    x = torch.randn(7, 4, 6, dtype=torch.float64)
    stack.reset_hidden(4)
    out, hidden = stack(x)
    pout, phid = peer(x)
    assert_close_tolerance(out, pout, None, name="output")
    assert_close_tolerance(hidden[0], phid[0] if kind == "lstm" else phid, None, name="h_n")
    if kind == "lstm":
        assert_close_tolerance(hidden[1], phid[1], None, name="c_n")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_bidirectional_one_layer_matches_torch_nn(kind):
    model = FACTORY[kind](4, 5, 1, bidirectional=True).double()
    peer = torch_peer(kind, model, bidirectional=True)
    x = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    out, hiddens = model(x)
    assert isinstance(hiddens, tuple) and out.shape == (6, 3, 10)
    pout, phid = peer(x)
    assert_close_tolerance(out, pout, None, name="output")
    ph = phid[0] if kind == "lstm" else phid
    # torch.nn: (directions, B, H); Apex: (layers, B, 2H), forward features first.
    assert_close_tolerance(hiddens[0][0], torch.cat([ph[0], ph[1]], -1), None, name="h_n")
    dy = torch.randn_like(out)
    g = torch.autograd.grad((out * dy).sum(), (x, model.bckwrd.rnns[0].w_hh))
    pg = torch.autograd.grad((pout * dy).sum(), (x, peer.weight_hh_l0_reverse))
    for a, b in zip(g, pg):
        assert_close_tolerance(a, b, None, name="grad")


def test_bidirectional_two_layers_are_two_independent_stacks():
    model = RNN.mLSTM(3, 4, 2, bidirectional=True, output_size=2).double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    out, hid = model(x, collect_hidden=True)
    model.reset_hidden(2)
    f_out, f_hid = model.fwd(x)
    b_out, b_hid = model.bckwrd(x, reverse=True)
    assert torch.equal(out, torch.cat([f_out, b_out], -1))
    assert len(hid) == 2 and len(hid[0]) == 5 and hid[0][4].shape == (2, 2, 4) and hid[1][0].shape == (2, 2, 8)
    # Step 4 of the forward direction is its final state; step 0 of the backward direction is its final state.
    assert torch.allclose(hid[0][4][..., :2], f_hid[0]) and torch.allclose(hid[0][0][..., 2:], b_hid[0])


def test_hidden_state_carries_over_and_api():
    model = RNN.LSTM(3, 4, 2).double()
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    model.reset_hidden(2)
    full, _ = model(x)
    model.reset_hidden(2)
    a, _ = model(x[:4])
    b, hid = model(x[4:])  # continues from the state the first call left
    assert torch.allclose(torch.cat([a, b]), full)
    # detach_hidden: the next call's gradient stops at the kept state.
    model.reset_hidden(2)
    x1 = x[:3].clone().requires_grad_(True)
    model(x1)
    assert all(h.grad_fn is not None for c in model.rnns for h in c.hidden)
    model.detach_hidden()
    assert all(h.grad_fn is None for c in model.rnns for h in c.hidden)
    out, _ = model(x[3:])
    out.sum().backward()
    assert x1.grad is None
    # reset_hidden zeroes; a new batch size re-creates the state; init_inference starts fresh.
    model.reset_hidden(5)
    assert all(h.shape[0] == 5 and not h.any() for c in model.rnns for h in c.hidden)
    model(torch.randn(2, 3, 3, dtype=torch.float64))
    assert all(h.shape[0] == 3 for c in model.rnns for h in c.hidden)
    model.float()  # kept states follow a dtype conversion of the module
    out32, _ = model(torch.randn(2, 3, 3))
    assert out32.dtype == torch.float32 and all(h.dtype == torch.float32 for c in model.rnns for h in c.hidden)
    model.init_inference(2)
    assert all(h.shape[0] == 2 and not h.any() and h.grad_fn is None for c in model.rnns for h in c.hidden)
    bi = RNN.GRU(3, 4, 1, bidirectional=True)
    bi.init_hidden(2)
    bi(torch.randn(2, 2, 3))
    bi.detach_hidden()
    assert all(h.grad_fn is None for s in bi.rnns for c in s.rnns for h in c.hidden)
    with pytest.raises(RuntimeError, match="initialize hidden"):
        RNN.LSTM(3, 4, 1).detach_hidden()


def test_single_step_cell_api_and_custom_cell_fallback():
    cell = RNN.models.RNNCell(4, 3, 5, RNN.cells.LSTMCell, 2, True, None).double()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    stepped = [cell(x[t])[0] for t in range(4)]
    cell.reset_hidden(2)
    seq, _ = stackedRNN(cell, 1)(x)
    assert torch.allclose(torch.stack(stepped), seq)

    class Scaled(RNNCell):  # an overridden forward must be honoured (the fast path is skipped)
        def forward(self, input):
            out = super().forward(input)
            self.hidden[0] = out[0] * 2
            return tuple(self.hidden)

    sc = Scaled(4, 3, 5, RNN.cells.LSTMCell, 2, True, None).double()
    sc.load_state_dict(cell.state_dict())
    out, _ = stackedRNN(sc, 1)(x)
    sc.reset_hidden(2)
    manual = [sc(x[t])[0] for t in range(4)]
    assert torch.allclose(out, torch.stack(manual)) and not torch.allclose(out, seq)


def test_dropout_between_layers_only_in_training():
    model = RNN.LSTM(3, 4, 2, dropout=1.0).double()
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    model.reset_hidden(2)
    out, _ = model(x)  # p = 1 drops every feature reaching layer 2
    model.reset_hidden(2)
    out_zero, _ = model.rnns[1]._forward_sequence(torch.zeros(3, 2, 4, dtype=torch.float64), False, False)
    assert torch.allclose(out, out_zero)
    model.eval()
    model.reset_hidden(2)
    out_eval, _ = model(x)
    assert not torch.allclose(out_eval, out)


def test_apex_parameter_names_and_shapes():
    keys = list(RNN.LSTM(3, 4, 2, bidirectional=True, output_size=2).state_dict())
    assert keys[:5] == ["fwd.rnns.0.w_ih", "fwd.rnns.0.w_hh", "fwd.rnns.0.w_ho", "fwd.rnns.0.b_ih", "fwd.rnns.0.b_hh"]
    assert "bckwrd.rnns.1.w_ih" in keys and "rnns.0.rnns.0.w_ih" in keys
    m = RNN.mLSTM(3, 4, 1, bias=False)
    assert list(m.state_dict()) == ["rnns.0.w_ih", "rnns.0.w_hh", "rnns.0.w_mih", "rnns.0.w_mhh"]
    assert tuple(m.rnns[0].w_mhh.shape) == (4, 4)
    bound = 1 / 4 ** 0.5
    assert all(p.abs().max() <= bound for p in m.parameters())


def test_bad_arguments():
    with pytest.raises(ValueError, match="output_size"):
        RNN.GRU(3, 4, 1, output_size=2)
    with pytest.raises(ValueError, match="dropout"):
        RNN.LSTM(3, 4, 2, dropout=1.5)
    with pytest.raises(ValueError, match="num_layers"):
        RNN.LSTM(3, 4, 0)
    with pytest.raises(ValueError, match="hidden_size"):
        RNN.Tanh(3, 0, 1)
    with pytest.raises(TypeError, match="inputRNN"):
        stackedRNN("lstm")
    with pytest.raises(ValueError, match="num_layers"):
        stackedRNN([RNN.cells.mLSTMRNNCell(3, 4)], num_layers=2)
    with pytest.raises(ValueError, match=r"\(seq_len, batch, 3\)"):
        RNN.LSTM(3, 4, 1)(torch.randn(5, 2, 4))


def test_import_through_the_apex_alias():
    code = """
        import culmen.compat as compat
        compat.install()
        import apex.RNN
        from apex.RNN import LSTM, mLSTM
        from apex.RNN.models import toRNNBackend, LSTMCell
        from apex.RNN.RNNBackend import RNNCell, stackedRNN, bidirectionalRNN, flatten_list
        from apex.RNN.cells import mLSTMRNNCell, mLSTMCell
        import culmen.RNN
        assert apex.RNN is culmen.RNN and LSTM is culmen.RNN.LSTM and apex.RNN.__all__ == ["models"]
        import torch
        out, hid = mLSTM(3, 4, 2, bidirectional=True)(torch.randn(2, 1, 3))
        assert out.shape == (2, 1, 8) and hid[1].shape == (2, 1, 8)
        print("OK")
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,bidirectional", [("lstm", False), ("gru", True), ("mlstm", False)])
def test_gpu_models_against_float64(kind, bidirectional, dtype):
    """Real shapes on the GPU: culmen in ``dtype`` vs the float64 step reference on the same (rounded)
    weights, within twice the error of the same reference run in ``dtype``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    T, B, In, H = 48, 33, 96, 160
    model = FACTORY[kind](In, H, 2 if not bidirectional else 1, bidirectional=bidirectional).cuda().to(dtype)
    stacks = [model.fwd, model.bckwrd] if bidirectional else [model]
    x = torch.randn(T, B, In, device="cuda").to(dtype)
    model.reset_hidden(B)
    out, _ = model(x)
    refs, los = [], []
    for d, st in enumerate(stacks):
        zeros = [[torch.zeros(B, s, device="cuda", dtype=torch.float64) for s in
                  [c.output_size] + [c.hidden_size] * (c.n_hidden_states - 1)] for c in st.rnns]
        hi, _ = ref_stack(kind, [cell_params(c) for c in st.rnns], x.double(), zeros, reverse=bool(d))
        lo, _ = ref_stack(kind, [cell_params(c, dtype) for c in st.rnns], x, [[z.to(dtype) for z in zz]
                                                                            for zz in zeros], reverse=bool(d))
        refs.append(hi)
        los.append(lo)
    assert_close_tolerance(out, torch.cat(refs, -1), torch.cat(los, -1), name=f"{kind} output")
