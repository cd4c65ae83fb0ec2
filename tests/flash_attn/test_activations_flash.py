"""``culmen.flash_attn.ops.activations``: flash_attn's names, argument orders, dtypes and formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from culmen.flash_attn.ops import activations as A
from culmen.testing import assert_close_tolerance, randn

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
K0 = math.sqrt(2 / math.pi)


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


def _gelu_tanh_grad(x):
    t = torch.tanh(K0 * (x + 0.044715 * x**3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * K0 * (1 + 3 * 0.044715 * x * x)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gelu_family(backend, dtype):
    y = randn((5, 3, 40), dtype, scale=2.0)
    bias = randn(40, dtype, scale=0.5)
    g = randn(y.shape, dtype)
    h = y.double() + bias.double()
    out = A.bias_gelu(y, bias)
    assert out.dtype == dtype
    assert_close_tolerance(out, F.gelu(h, approximate="tanh"), F.gelu(y + bias, approximate="tanh"), name="bias_gelu")
    gy, gb = A.bias_gelu_back(g, y, bias)
    assert gy.dtype == dtype and gb.dtype == dtype and gb.shape == (40,)
    ref = g.double() * _gelu_tanh_grad(h)
    assert_close_tolerance(gy, ref, (g * _gelu_tanh_grad(y + bias)), name="bias_gelu_back dy")
    lo_b = (g * _gelu_tanh_grad(y + bias)).reshape(-1, 40).sum(0)
    assert_close_tolerance(gb, ref.reshape(-1, 40).sum(0), lo_b, name="dbias")
    assert_close_tolerance(A.gelu_fwd(y), F.gelu(y.double(), approximate="tanh"), F.gelu(y, approximate="tanh"),
                           name="gelu_fwd")
    assert_close_tolerance(A.gelu_bwd(g, y), g.double() * _gelu_tanh_grad(y.double()), g * _gelu_tanh_grad(y),
                           name="gelu_bwd")
    # The autograd functions: bias_gelu_impl(input, bias) and fast_gelu_impl(input).
    yl, bl = y.clone().requires_grad_(), bias.clone().requires_grad_()
    dy, db = torch.autograd.grad(A.bias_gelu_impl(yl, bl), [yl, bl], g)
    assert torch.equal(dy, gy) and torch.equal(db, gb)
    (dy2,) = torch.autograd.grad(A.fast_gelu_impl(yl), [yl], g)
    assert torch.equal(dy2, A.gelu_bwd(g, y))
    # Exact GELU (culmen addition).
    assert_close_tolerance(A.bias_gelu_erf_impl(y, bias), F.gelu(h), F.gelu(y + bias), name="erf")


def test_relu_sqrelu(backend):
    x = randn((4, 33))
    x[0, :5] = 0.0  # relu_bwd passes the gradient where x == 0 (x >= 0), as flash_attn's
    g = randn((4, 33))
    torch.testing.assert_close(A.relu_bwd(g, x), torch.where(x >= 0, g, 0.0), rtol=0, atol=0)
    assert torch.equal(A.relu_bwd(g, x)[0, :5], g[0, :5])
    torch.testing.assert_close(A.sqrelu_fwd(x), F.relu(x) ** 2)
    torch.testing.assert_close(A.sqrelu_bwd(g, x), 2 * g * F.relu(x))
    xb = x.to(BF16)
    assert A.sqrelu_fwd(xb).dtype == BF16 and A.relu_bwd(g.to(BF16), xb).dtype == BF16


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_swiglu(backend, dtype):
    x, y, g = randn((6, 50), dtype, scale=2.0), randn((6, 50), dtype), randn((6, 50), dtype)
    out = A.swiglu_fwd(x, y)
    assert out.dtype == dtype
    assert_close_tolerance(out, F.silu(x.double()) * y.double(), F.silu(x) * y, name="swiglu_fwd")
    dx, dy = A.swiglu_bwd(x, y, g)  # flash_attn's order: (x, y, g)
    def grads(x, y, g):
        s = torch.sigmoid(x)
        return g * y * s * (1 + x * (1 - s)), g * x * s

    hi, lo = grads(x.double(), y.double(), g.double()), grads(x, y, g)
    assert_close_tolerance(dx, hi[0], lo[0], name="dx")
    assert_close_tolerance(dy, hi[1], lo[1], name="dy")
    xl, yl = x.clone().requires_grad_(), y.clone().requires_grad_()
    gx, gy = torch.autograd.grad(A.swiglu(xl, yl), [xl, yl], g)
    assert torch.equal(gx, dx) and torch.equal(gy, dy)
    torch.testing.assert_close(A.geglu(x.float(), y.float()), F.gelu(x.float(), approximate="tanh") * y.float())
    torch.testing.assert_close(A.geglu(x.float(), y.float(), "none"), F.gelu(x.float()) * y.float())
    torch.testing.assert_close(A.swish(x.float()), F.silu(x.float()))


def test_errors():
    x = randn((3, 8))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        A.bias_gelu_back(x, x, randn(9))
    with pytest.raises(ValueError, match=r"g must have the shape of x \(3, 8\), got \(3, 7\)"):
        A.gelu_bwd(randn((3, 7)), x)
    with pytest.raises(ValueError, match=r"g must have the shape of x"):
        A.swiglu_bwd(x, x, randn((2, 8)))
    with pytest.raises(ValueError, match="approximate must be"):
        A.geglu(x, x, "erf")
