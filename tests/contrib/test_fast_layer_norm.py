"""culmen.contrib.layer_norm (Apex's FastLayerNorm) against Apex's API and a float64 reference."""

from __future__ import annotations

import inspect

import pytest
import torch

from culmen.contrib.layer_norm import FastLayerNorm
from culmen.contrib.layer_norm.layer_norm import FastLayerNormFN, _fast_layer_norm
from culmen.ops.layer_norm.reference import layer_norm_ref
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

BACKENDS = ["reference", "triton"]
_EMPTY = inspect.Parameter.empty


def _params(obj):
    return [(n, p.default) for n, p in inspect.signature(obj).parameters.items() if n != "self"]


def test_signatures_match_apex():
    assert _params(FastLayerNorm)[:3] == [("hidden_size", _EMPTY), ("eps", 1e-5), ("memory_efficient", False)]
    assert [n for n, _ in _params(_fast_layer_norm)] == ["x", "weight", "bias", "epsilon", "memory_efficient"]
    assert _params(FastLayerNormFN.apply) == [("x", _EMPTY), ("gamma", _EMPTY), ("beta", _EMPTY),
                                              ("epsilon", _EMPTY), ("memory_efficient", False)]


def test_module_attributes():
    m = FastLayerNorm(257, eps=1e-3, memory_efficient=True)
    assert m.epsilon == 1e-3 and m.memory_efficient
    assert torch.equal(m.weight, torch.ones(257)) and torch.equal(m.bias, torch.zeros(257))
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    assert FastLayerNorm(8, dtype=torch.bfloat16).weight.dtype == torch.bfloat16


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype, shape, noncontig, mem_eff",
    [
        (torch.float32, (3, 63), False, False),
        (torch.bfloat16, (2, 5, 40), True, True),
        (torch.float16, (4, 257), False, True),  # 257 is not one of Apex's compiled hidden sizes
    ],
)
def test_forward_backward_matches_float64(request, backend, dtype, shape, noncontig, mem_eff):
    request.getfixturevalue(f"{backend}_backend")
    n = shape[-1]
    m = FastLayerNorm(n, eps=1e-5, memory_efficient=mem_eff, dtype=dtype)
    w = (torch.rand(n) + 0.5).to(dtype)
    b = (randn(n) * 0.2).to(dtype)
    with torch.no_grad():
        m.weight.copy_(w)
        m.bias.copy_(b)
    x = randn(shape, dtype)
    g = randn(shape)
    xin = make_noncontiguous(x).requires_grad_(True) if noncontig else _leaf(x)
    y = m(xin)
    assert y.dtype == dtype and y.shape == shape
    y.backward(g.to(dtype))

    def ref(dt, gg):
        xx, ww, bb = _leaf(x, dt), _leaf(w, dt), _leaf(b, dt)
        out = layer_norm_ref(xx, ww, bb, eps=1e-5)
        out.backward(gg.to(out.dtype))
        return out, xx.grad, ww.grad, bb.grad

    hi, lo = ref(torch.float64, g.double()), ref(dtype, g)
    for name, got, h, low in zip(("y", "dx", "dweight", "dbias"), (y, xin.grad, m.weight.grad, m.bias.grad), hi, lo):
        assert_close_tolerance(got, h, low, name=name)


def test_output_dtype_is_parameter_dtype_like_apex():
    m = FastLayerNorm(40)  # fp32 parameters
    x = randn((2, 40), torch.bfloat16, requires_grad=True)
    y = m(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    expect = layer_norm_ref(x.detach().double(), m.weight.double(), m.bias.double(), eps=1e-5)
    assert_close_tolerance(y, expect, None, name="y")
    fn = FastLayerNormFN.apply(x.detach(), m.weight, m.bias, 1e-5)
    torch.testing.assert_close(fn, y)


def test_cpu_autocast_casts_input_and_parameters():
    m = FastLayerNorm(40)
    x = randn((2, 40), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32


def test_bad_inputs():
    m = FastLayerNorm(40)
    with pytest.raises(ValueError, match="hidden_size 40"):
        m(randn((2, 41)))
    with pytest.raises(TypeError, match="floating-point"):
        m(torch.ones(2, 40, dtype=torch.int64))
    with pytest.raises(TypeError, match="bias dtype"):
        _fast_layer_norm(randn((2, 40)), torch.ones(40), torch.zeros(40, dtype=torch.float16), 1e-5)
