"""``culmen.mlp`` (Apex's ``MLP`` / ``mlp_function``) and the ``mlp_cuda`` extension shim.

Numerics follow the tolerance rule against an ``nn.Sequential`` of ``nn.Linear`` + activation run in
float64 (the oracle) and in the input dtype (PyTorch's own error), for the output and the gradient of
the input and of every weight and bias; on the reference path and on the Triton kernels (interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from culmen.mlp import MLP, MlpFunction, mlp_cuda, mlp_function
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
SIZES = [13, 33, 17, 5]


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


def _sequential(mlp: MLP, dtype: torch.dtype, act: str) -> nn.Sequential:
    layers = []
    for i in range(mlp.num_layers):
        lin = nn.Linear(mlp.mlp_sizes[i], mlp.mlp_sizes[i + 1], bias=bool(mlp.bias), dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(mlp.weights[i])
            if mlp.bias:
                lin.bias.copy_(mlp.biases[i])
        layers.append(lin)
        if act == "relu":
            layers.append(nn.ReLU())
        elif act == "sigmoid":
            layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


def _grads(model_params, out, x, g):
    return torch.autograd.grad(out, [x, *model_params], g)


@pytest.mark.parametrize("act,bias,dtype,noncontig", [
    ("relu", True, F32, False),
    ("relu", False, BF16, True),
    ("sigmoid", True, BF16, False),
    ("sigmoid", False, F32, True),
    ("none", True, F16, False),
    ("none", False, F32, False),
])
def test_mlp_matches_sequential(backend, act, bias, dtype, noncontig):
    mlp = MLP(SIZES, bias=bias, activation=act).to(dtype)
    x = randn((2, 7, SIZES[0]), dtype)
    if noncontig:
        x = make_noncontiguous(x)
    x.requires_grad_()
    y = mlp(x)
    assert y.shape == (2, 7, SIZES[-1]) and y.dtype == dtype
    g = randn(y.shape, dtype)
    params = [*mlp.weights, *mlp.biases]
    got = (y, *_grads(params, y, x, g))
    refs = {}
    for hi in (True, False):
        seq = _sequential(mlp, F64 if hi else dtype, act)
        xr = x.detach().to(F64 if hi else dtype).requires_grad_()
        yr = seq(xr)
        lins = [m for m in seq if isinstance(m, nn.Linear)]
        ps = [m.weight for m in lins] + ([m.bias for m in lins] if bias else [])
        refs[hi] = (yr, *_grads(ps, yr, xr, g.to(yr.dtype)))
    names = ["y", "dx"] + [f"dweight_{i}" for i in range(3)] + ([f"dbias_{i}" for i in range(3)] if bias else [])
    assert len(got) == len(names)
    for name, a, rh, rl in zip(names, got, refs[True], refs[False]):
        assert torch.isfinite(a).all(), name
        assert_close_tolerance(a, rh, rl, name=f"{name} [{act} bias={bias} {dtype}]")


def test_parameters_names_and_init():
    m = MLP([256, 512, 384], bias=True, activation="sigmoid")
    names = dict(m.named_parameters())
    assert set(names) == {"weight_0", "bias_0", "weight_1", "bias_1"}
    assert names["weight_0"] is m.weights[0] and names["bias_1"] is m.biases[1]
    assert m.weight_0.shape == (512, 256) and m.bias_0.shape == (512,)
    assert m.num_layers == 2 and m.bias == 1 and m.activation == 2
    for w in m.weights:
        expect = math.sqrt(2.0 / (w.shape[0] + w.shape[1]))
        assert abs(w.std().item() / expect - 1) < 0.05 and abs(w.mean().item()) < 0.1 * expect
    for b in m.biases:
        expect = math.sqrt(1.0 / b.shape[0])
        assert abs(b.std().item() / expect - 1) < 0.15
    assert "MLP sizes: [256, 512, 384], Bias=1, activation=2" in repr(m)
    assert [n for n, _ in MLP([4, 5], bias=False).named_parameters()] == ["weight_0"]


def test_to_keeps_parameter_lists():
    m = MLP([8, 6, 4]).to(torch.float64)
    assert all(w.dtype == F64 for w in m.weights) and m.weights[0] is m.weight_0 and m.biases[1] is m.bias_1
    y = m(torch.randn(3, 8, dtype=F64, requires_grad=True))
    y.sum().backward()
    assert m.weight_0.grad is not None and m.bias_1.grad is not None


def test_input_without_grad_and_no_grad_mode(backend):
    m = MLP([9, 11, 3])
    x = randn((4, 9))
    m(x).sum().backward()
    assert m.weight_0.grad is not None and m.bias_0.grad is not None
    with torch.no_grad():
        y = m(x)
    assert not y.requires_grad


def test_autocast_casts_to_autocast_dtype():
    m = MLP([9, 11, 3])
    x = randn((4, 9), requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        y = m(x)
    assert y.dtype == BF16
    y.float().sum().backward()
    assert x.grad.dtype == F32 and m.weight_0.grad.dtype == F32


def test_functional_and_extension_shim_agree(backend):
    torch.manual_seed(1)
    m = MLP([10, 12, 7], activation="relu")
    x = randn((5, 10), requires_grad=True)
    g = randn((5, 7))
    y = mlp_function(1, 1, x, *m.weights, *m.biases)
    got = torch.autograd.grad(y, [x, *m.weights, *m.biases], g)
    out, reserved = mlp_cuda.forward(1, 1, [x, *m.weights, *m.biases])
    assert torch.equal(out, y.detach()) and reserved.dim() == 1
    grads = mlp_cuda.backward(1, 1, g, [out, reserved], [x, *m.weights, *m.biases])
    assert len(grads) == 5
    for a, b in zip(grads, got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # Without bias and for an input that needs no grad: d_input is zeros, as Apex leaves it unused.
    xn = x.detach()
    out, res = mlp_cuda.forward(0, 0, [xn, *m.weights])
    grads = mlp_cuda.backward(0, 0, g, [out, res], [xn, *m.weights])
    assert len(grads) == 3 and torch.equal(grads[0], torch.zeros_like(xn))
    torch.testing.assert_close(grads[2], g.t() @ (xn @ m.weights[0].detach().t()))


def test_bad_arguments():
    with pytest.raises(TypeError, match="activation must be one of .*'tanh'"):
        MLP([4, 4], activation="tanh")
    with pytest.raises(ValueError, match="mlp_sizes must hold at least two"):
        MLP([4])
    m = MLP([6, 5, 3])
    with pytest.raises(ValueError, match=r"weight_0 must have shape \(out_features, 7\)"):
        m(torch.randn(2, 7))
    with pytest.raises(TypeError, match="one dtype: input is torch.float64"):
        m(torch.randn(2, 6, dtype=F64))
    with pytest.raises(ValueError, match="activation must be 0 .* got 5"):
        MlpFunction.apply(1, 5, torch.randn(2, 6), *m.weights, *m.biases)
    with pytest.raises(ValueError, match="as many biases as weights"):
        mlp_function(1, 1, torch.randn(2, 6), *m.weights, m.biases[0])


def test_torch_compile_fullgraph():
    m = MLP([9, 16, 4], activation="sigmoid")
    x = randn((6, 9), requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    got = torch.autograd.grad(y.square().sum(), [x, *m.weights, *m.biases])
    y_ref = m(x)
    ref = torch.autograd.grad(y_ref.square().sum(), [x, *m.weights, *m.biases])
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
