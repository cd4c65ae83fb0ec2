"""culmen.ops.rnn: the fused LSTM / GRU cells (Triton under the interpreter, and the reference) and the
whole-sequence ops (their own backward loop) against float64 autograd of the textbook formulas."""

from __future__ import annotations

import pytest
import torch

from culmen.ops.backend import use_backend
from culmen.ops.rnn import gru_cell, gru_cell_ref, gru_sequence, lstm_cell, lstm_cell_ref, lstm_sequence
from culmen.testing import make_noncontiguous
from culmen.testing.tolerance import assert_close_tolerance


def _leaves(*shapes, dtype=torch.float64, scale=1.0):
    return [(torch.randn(*s, dtype=torch.float64) * scale).to(dtype).requires_grad_(True) for s in shapes]


def _low(ts, dtype):
    return [t.detach().to(dtype).requires_grad_(True) for t in ts]


def _check(name, outs, grads, ref_outs, ref_grads, lo_outs=None, lo_grads=None):
    for i, (a, r) in enumerate(zip(outs, ref_outs)):
        assert_close_tolerance(a, r, None if lo_outs is None else lo_outs[i], name=f"{name} out{i}")
    for i, (a, r) in enumerate(zip(grads, ref_grads)):
        assert_close_tolerance(a, r, None if lo_grads is None else lo_grads[i], name=f"{name} grad{i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H", [(3, 5), (2, 130)])
def test_lstm_cell_kernel_matches_float64(triton_backend, dtype, B, H):
    g64, c64 = _leaves((B, 4 * H), (B, H), scale=2.0)
    dh, dc = torch.randn(B, H, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64)

    def run(fn, g, c):
        h, cy = fn(g, c)
        return (h, cy), torch.autograd.grad((h * dh.to(h.dtype)).sum() + (cy * dc.to(h.dtype)).sum(), (g, c))

    ref_o, ref_g = run(lstm_cell_ref, g64, c64)
    lo_o, lo_g = run(lstm_cell_ref, *_low((g64, c64), dtype))
    out, grads = run(lstm_cell, *_low((g64, c64), dtype))
    assert out[0].dtype == dtype and grads[0].dtype == dtype
    _check("lstm_cell", out, grads, ref_o, ref_g, lo_o, lo_g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gru_cell_kernel_matches_float64(triton_backend, dtype):
    B, H = 5, 7
    xs = _leaves((B, 3 * H), (B, 3 * H), (B, H), scale=2.0)
    dh = torch.randn(B, H, dtype=torch.float64)

    def run(fn, *ins):
        h = fn(*ins)
        return (h,), torch.autograd.grad((h * dh.to(h.dtype)).sum(), ins)

    ref_o, ref_g = run(gru_cell_ref, *xs)
    lo_o, lo_g = run(gru_cell_ref, *_low(xs, dtype))
    out, grads = run(gru_cell, *_low(xs, dtype))
    _check("gru_cell", out, grads, ref_o, ref_g, lo_o, lo_g)


def test_cells_in_float64_are_exact_on_the_kernel(triton_backend):
    """fp64 tensors run the kernels in fp64: agreement to rounding, not to fp32."""
    g, c = _leaves((4, 24), (4, 6))
    h1, c1 = lstm_cell(g, c)
    h2, c2 = lstm_cell_ref(g, c)
    assert (h1 - h2).abs().max() < 1e-13 and (c1 - c2).abs().max() < 1e-13


def _ref_lstm_seq(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse):
    T = x.shape[0]
    h, c, ys, cs = h0, c0, [None] * T, [None] * T
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        g = x[t] @ w_ih.t() + h @ w_hh.t()
        if b_ih is not None:
            g = g + b_ih + b_hh
        h, c = lstm_cell_ref(g, c)
        ys[t], cs[t] = h, c
    return torch.stack(ys), torch.stack(cs)


def _ref_gru_seq(x, w_ih, w_hh, b_ih, b_hh, h0, reverse):
    T = x.shape[0]
    h, ys = h0, [None] * T
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        xg, hg = x[t] @ w_ih.t(), h @ w_hh.t()
        if b_ih is not None:
            xg, hg = xg + b_ih, hg + b_hh
        h = gru_cell_ref(xg, hg, h)
        ys[t] = h
    return torch.stack(ys)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_sequence_grads_of_every_input(backend, reverse, bias):
    T, B, In, H = 5, 3, 7, 6
    shapes = [(T, B, In), (4 * H, In), (4 * H, H), (4 * H,), (4 * H,), (B, H), (B, H)]
    leaves = _leaves(*shapes, scale=0.7)
    if not bias:
        leaves[3] = leaves[4] = None
    dy, dc = torch.randn(T, B, H, dtype=torch.float64), torch.randn(T, B, H, dtype=torch.float64)
    live = [t for t in leaves if t is not None]

    def loss(y, c):
        return (y * dy.to(y.dtype)).sum() + (c * dc.to(c.dtype)).sum()

    ry, rc = _ref_lstm_seq(*leaves, reverse)
    rg = torch.autograd.grad(loss(ry, rc), live)
    low = [None if t is None else t.detach().float().requires_grad_(True) for t in leaves]
    with use_backend(backend):
        y, c = lstm_sequence(*low, reverse=reverse)
        g = torch.autograd.grad(loss(y, c), [t for t in low if t is not None])
    assert y.dtype == torch.float32
    _check("lstm_sequence", (y, c), g, (ry, rc), rg)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("reverse", [False, True])
def test_gru_sequence_grads_of_every_input(backend, reverse):
    T, B, In, H = 4, 5, 3, 9
    leaves = _leaves((T, B, In), (3 * H, In), (3 * H, H), (3 * H,), (3 * H,), (B, H), scale=0.7)
    dy = torch.randn(T, B, H, dtype=torch.float64)
    ry = _ref_gru_seq(*leaves, reverse)
    rg = torch.autograd.grad((ry * dy).sum(), leaves)
    low = _low(leaves, torch.float32)
    with use_backend(backend):
        y = gru_sequence(*low, reverse=reverse)
        g = torch.autograd.grad((y * dy.float()).sum(), low)
    _check("gru_sequence", (y,), g, (ry,), rg)


def test_sequence_bf16_within_torch_error(triton_backend):
    """bf16: at most twice PyTorch's own bf16 step-by-step error (the carry of dc is kept in fp32)."""
    T, B, In, H = 6, 4, 8, 8
    leaves = _leaves((T, B, In), (4 * H, In), (4 * H, H), (4 * H,), (4 * H,), (B, H), (B, H), scale=0.5)
    dy = torch.randn(T, B, H, dtype=torch.float64)
    ry, rc = _ref_lstm_seq(*leaves, False)
    rg = torch.autograd.grad((ry * dy).sum(), leaves)
    lo = _low(leaves, torch.bfloat16)
    ly, lc = _ref_lstm_seq(*lo, False)
    lg = torch.autograd.grad((ly * dy.bfloat16()).sum(), lo)
    ku = _low(leaves, torch.bfloat16)
    y, c = lstm_sequence(*ku)
    g = torch.autograd.grad((y * dy.bfloat16()).sum(), ku)
    _check("lstm_sequence bf16", (y, c), g, (ry, rc), rg, (ly, lc), lg)


def test_sequence_noncontiguous_inputs_and_no_grad():
    T, B, In, H = 3, 2, 5, 4
    x, w_ih, w_hh, h0, c0 = _leaves((T, B, In), (4 * H, In), (4 * H, H), (B, H), (B, H))
    ref = _ref_lstm_seq(x, w_ih, w_hh, None, None, h0, c0, False)[0]
    xn, h0n = make_noncontiguous(x.detach()), make_noncontiguous(h0.detach())
    assert not xn.is_contiguous()
    with torch.no_grad():
        y, _ = lstm_sequence(xn, w_ih, w_hh, None, None, h0n, c0)
    assert not y.requires_grad
    assert_close_tolerance(y, ref, None, name="y")


def test_sequence_under_cpu_autocast_runs_in_bf16():
    T, B, In, H = 3, 2, 4, 4
    x, w_ih, w_hh, h0, c0 = (t.float() for t in _leaves((T, B, In), (4 * H, In), (4 * H, H), (B, H), (B, H)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, c = lstm_sequence(x, w_ih, w_hh, None, None, h0, c0)
    assert y.dtype == torch.bfloat16
    ref = _ref_lstm_seq(x.double(), w_ih.double(), w_hh.double(), None, None, h0.double(), c0.double(), False)[0]
    assert (y.double() - ref).abs().max() < 0.05


def test_bad_arguments_name_the_argument():
    x = torch.randn(3, 2, 4)
    w_ih, w_hh, h0 = torch.randn(8, 4), torch.randn(8, 2), torch.randn(2, 2)
    with pytest.raises(ValueError, match="input"):
        lstm_sequence(x[0], w_ih, w_hh, None, None, h0, h0)
    with pytest.raises(ValueError, match="w_hh"):
        lstm_sequence(x, w_ih, torch.randn(7, 2), None, None, h0, h0)
    with pytest.raises(ValueError, match="w_ih"):
        lstm_sequence(x, torch.randn(8, 5), w_hh, None, None, h0, h0)
    with pytest.raises(ValueError, match="c0"):
        lstm_sequence(x, w_ih, w_hh, None, None, h0, torch.randn(3, 2))
    with pytest.raises(ValueError, match="b_ih"):
        gru_sequence(x, torch.randn(6, 4), torch.randn(6, 2), torch.randn(5), None, h0)
    with pytest.raises(TypeError, match="w_hh"):
        lstm_sequence(x, w_ih, w_hh.double(), None, None, h0, h0)
    with pytest.raises(ValueError, match="gates"):
        lstm_cell(torch.randn(2, 7), h0)
    with pytest.raises(ValueError, match="hg"):
        gru_cell(torch.randn(2, 6), torch.randn(2, 5), h0)


def _gpu_leaves(dev, shapes, scales):
    return [(torch.randn(*s, dtype=torch.float64, device=dev) * c).requires_grad_(True) for s, c in zip(shapes, scales)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sequence_gpu_real_shapes(dtype):
    dev = "cuda"
    T, B, In, H = 64, 37, 200, 256
    # Weights at the init scale 1/sqrt(fan_in): larger ones saturate the gates and blow the gradients up
    # past fp16's range in every implementation, torch's included.
    leaves = _gpu_leaves(dev, [(T, B, In), (4 * H, In), (4 * H, H), (4 * H,), (4 * H,), (B, H), (B, H)],
                         [1.0, In ** -0.5, H ** -0.5, 0.1, 0.1, 0.5, 0.5])
    dy = torch.randn(T, B, H, dtype=torch.float64, device=dev)
    for reverse in (False, True):
        ry, rc = _ref_lstm_seq(*leaves, reverse)
        rg = torch.autograd.grad((ry * dy).sum(), leaves)
        lo = _low(leaves, dtype)
        ly, lc = _ref_lstm_seq(*lo, reverse)
        lg = torch.autograd.grad((ly * dy.to(dtype)).sum(), lo)
        ku = _low(leaves, dtype)
        y, c = lstm_sequence(*ku, reverse=reverse)
        g = torch.autograd.grad((y * dy.to(dtype)).sum(), ku)
        _check(f"lstm gpu {dtype} rev={reverse}", (y, c), g, (ry, rc), rg, (ly, lc), lg)
    gl = _gpu_leaves(dev, [(T, B, In), (3 * H, In), (3 * H, H), (3 * H,), (3 * H,), (B, H)],
                     [1.0, In ** -0.5, H ** -0.5, 0.1, 0.1, 0.5])
    ry = _ref_gru_seq(*gl, False)
    rg = torch.autograd.grad((ry * dy).sum(), gl)
    lo = _low(gl, dtype)
    ly = _ref_gru_seq(*lo, False)
    lg = torch.autograd.grad((ly * dy.to(dtype)).sum(), lo)
    ku = _low(gl, dtype)
    y = gru_sequence(*ku)
    g = torch.autograd.grad((y * dy.to(dtype)).sum(), ku)
    _check(f"gru gpu {dtype}", (y,), g, (ry,), rg, (ly,), lg)
