"""``culmen.contrib.conv_bias_relu`` (Apex's ``apex.contrib.conv_bias_relu``) and the op under it,
``culmen.ops.conv_epilogue``: outputs and the gradients of every input against float64 PyTorch, on the
Triton kernels (interpreter on CPU) and the reference path; channels-last and NCHW inputs; argument errors;
the ``apex.contrib.conv_bias_relu`` alias."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from culmen.contrib.conv_bias_relu import ConvBias, ConvBiasMaskReLU, ConvBiasReLU, ConvFrozenScaleBiasReLU
from culmen.contrib.conv_bias_relu.conv_bias_relu import ROUTING, ConvBias_, ConvBiasMaskReLU_, ConvBiasReLU_
from culmen.ops.backend import use_backend
from culmen.ops.conv_epilogue import conv_epilogue
from culmen.testing import randn
from culmen.testing.hostcost import assert_host_budget, fake_kernels
from culmen.testing.tensors import poisoned_allocations
from culmen.testing.tolerance import assert_close_tolerance

CL = torch.channels_last
BACKENDS = ["triton", "reference"]
# (backend, route): the Triton backend runs the fused autograd function when the output is large enough
# (ROUTING; "fused" lowers the bar to every size) and PyTorch's formulation below it; the reference backend
# always runs PyTorch's formulation.
ROUTES = [("triton", "fused"), ("triton", "torch"), ("reference", "torch")]


@contextlib.contextmanager
def _route(route):
    """Force the fused (every size) or the PyTorch formulation (no size) for calls recording autograd."""
    old = ROUTING["fused_grad_min_numel"]
    ROUTING["fused_grad_min_numel"] = 0 if route == "fused" else 1 << 62
    try:
        yield
    finally:
        ROUTING["fused_grad_min_numel"] = old


def _leaf(t, dtype=None):
    t = t.detach().to(dtype or t.dtype)
    return t.contiguous(memory_format=CL).requires_grad_() if t.dim() == 4 else t.clone().requires_grad_()


def _oracle(kind, x, w, v1, v2, mask, pad, stride):
    """The plain PyTorch formulation Apex's tests compare against, in the inputs' dtype."""
    c = F.conv2d(x, w, None, stride, pad)
    if kind == "frozen":
        return F.relu(c * v1.reshape(1, -1, 1, 1) + v2.reshape(1, -1, 1, 1))
    c = c + v1.reshape(1, -1, 1, 1)
    if kind == "bias":
        return c
    if kind == "mask":
        c = c * mask
    return F.relu(c)


def _run(kind, x, w, v1, v2, mask, pad, stride):
    if kind == "relu":
        return ConvBiasReLU(x, w, v1, pad, stride)
    if kind == "bias":
        return ConvBias(x, w, v1, pad, stride)
    if kind == "mask":
        return ConvBiasMaskReLU(x, w, v1, mask, pad, stride)
    return ConvFrozenScaleBiasReLU(x, w, v1, v2, pad, stride)


@pytest.mark.parametrize("backend,route", ROUTES)
@pytest.mark.parametrize("kind,shape,ksize,pad,stride,layout", [
    ("relu", (2, 3, 7, 6), 3, 1, 2, "cl"),
    ("bias", (3, 5, 5, 9), 1, 0, 1, "cl"),
    ("mask", (2, 4, 6, 5), 3, 1, 1, "cl"),
    ("frozen", (1, 6, 9, 7), 3, 0, 2, "nchw"),
])
def test_against_float64(backend, route, kind, shape, ksize, pad, stride, layout):
    K = 5
    x0 = randn(shape)
    if layout == "cl":
        x0 = x0.contiguous(memory_format=CL)
    w0 = randn((K, shape[1], ksize, ksize), scale=0.5)
    v1 = randn((1, K, 1, 1)) if kind != "frozen" else torch.rand(K) + 0.5
    v2 = randn(K) if kind == "frozen" else None
    ho = (shape[2] + 2 * pad - ksize) // stride + 1
    wo = (shape[3] + 2 * pad - ksize) // stride + 1
    mask = (torch.rand(shape[0], K, ho, wo) > 0.4).to(torch.int8) if kind == "mask" else None
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    b = v1.clone().requires_grad_(kind != "frozen")
    with use_backend(backend), _route(route), poisoned_allocations():
        y = _run(kind, x, w, b, v2, mask, pad, stride)
        dy = randn(y.shape)
        y.backward(dy)
    assert y.shape == (shape[0], K, ho, wo) and y.dtype == torch.float32
    assert y.is_contiguous(memory_format=CL)
    assert (type(y.grad_fn).__name__ == "_FusedBackward") == (route == "fused" and kind != "bias")
    hi = [t.detach().double().requires_grad_() for t in (x0, w0, v1)]
    lo = [t.detach().clone().requires_grad_() for t in (x0, w0, v1)]
    y_hi = _oracle(kind, *hi, None if v2 is None else v2.double(), mask, pad, stride)
    y_lo = _oracle(kind, *lo, v2, mask, pad, stride)
    y_hi.backward(dy.double())
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    assert_close_tolerance(x.grad, hi[0].grad, lo[0].grad, name="dx")
    assert_close_tolerance(w.grad, hi[1].grad, lo[1].grad, name="dweight")
    if kind == "frozen":
        assert b.grad is None  # Apex: frozen scale and bias get no gradient
    else:
        assert b.grad.shape == v1.shape
        assert_close_tolerance(b.grad, hi[2].grad, lo[2].grad, name="dbias")


def test_float64_and_no_grad_paths():
    x = randn((2, 3, 5, 4), torch.float64).contiguous(memory_format=CL)
    w = randn((4, 3, 3, 3), torch.float64)
    b = randn(4, torch.float64)
    with torch.no_grad():
        y = ConvBiasReLU(x, w, b, 1, 1)
    torch.testing.assert_close(y, F.relu(F.conv2d(x, w, b, 1, 1)), rtol=1e-12, atol=1e-12)
    # padding / stride as pairs, a bool mask.
    mask = torch.rand(2, 4, 3, 2) > 0.5
    y = ConvBiasMaskReLU(x, w, b, mask, (1, 0), (2, 1))
    torch.testing.assert_close(y, F.relu((F.conv2d(x, w, b, (2, 1), (1, 0))) * mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["relu", "mask", "frozen"])
def test_fused_forward_without_autograd(kind):
    """No autograd on the Triton backend: the convolution then the Triton epilogue (NCHW weight, odd sizes)."""
    x = randn((2, 5, 7, 6)).contiguous(memory_format=CL)
    w = randn((3, 5, 3, 3), scale=0.5)
    v1 = randn((1, 3, 1, 1)) if kind != "frozen" else torch.rand(3) + 0.5
    v2 = randn(3) if kind == "frozen" else None
    mask = (torch.rand(2, 3, 4, 2) > 0.4).to(torch.int8) if kind == "mask" else None
    with use_backend("triton"), poisoned_allocations(), torch.no_grad():
        y = _run(kind, x, w, v1, v2, mask, (1, 0), 2)
    hi = _oracle(kind, x.double(), w.double(), v1.double(), None if v2 is None else v2.double(), mask, (1, 0), 2)
    lo = _oracle(kind, x, w, v1, v2, mask, (1, 0), 2)
    assert y.is_contiguous(memory_format=CL) and y.grad_fn is None
    assert_close_tolerance(y, hi, lo, name="y")


def test_function_classes_apply():
    """``ConvBiasReLU_.apply`` / ``ConvBias_.apply`` / ``ConvBiasMaskReLU_.apply`` (Apex's autograd functions) run
    the fused formulation at any size."""
    x0 = randn((2, 3, 5, 6)).contiguous(memory_format=CL)
    w0, b0 = randn((4, 3, 3, 3), scale=0.5), randn((1, 4, 1, 1))
    mask = (torch.rand(2, 4, 5, 6) > 0.5).to(torch.int8)
    for fn, args, kind in ((ConvBiasReLU_.apply, (1, 1), "relu"), (ConvBias_.apply, (1, 1), "bias"),
                           (ConvBiasMaskReLU_.apply, (mask, 1, 1), "mask")):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        with use_backend("triton"):
            y = fn(x, w, b, *args)
        dy = randn(y.shape)
        y.backward(dy)
        hi = [t.double().requires_grad_() for t in (x0, w0, b0)]
        _oracle(kind, *hi, None, mask, 1, 1).backward(dy.double())
        assert type(y.grad_fn).__name__.startswith(fn.__self__.__name__)
        for name, got, ref in (("dx", x.grad, hi[0].grad), ("dw", w.grad, hi[1].grad), ("db", b.grad, hi[2].grad)):
            assert_close_tolerance(got, ref, None, atol=1e-4 * max(1.0, ref.abs().max().item()), name=name)


def test_cached_call_host_budget():
    """The cached eager path stays light: a no-autograd call (convolution + Triton epilogue) and a small call
    recording autograd (PyTorch's formulation) make few Python and torch calls from culmen's code."""
    x = randn((2, 4, 5, 5)).contiguous(memory_format=CL).requires_grad_()
    w = randn((4, 4, 3, 3)).contiguous(memory_format=CL).requires_grad_()
    b = randn((1, 4, 1, 1)).requires_grad_()
    with fake_kernels():
        def fwd():
            with torch.no_grad():
                ConvBiasReLU(x, w, b, 1, 1)
        n = assert_host_budget(fwd, python=14, c=12)
        assert "_fused_nograd" in n.py_names
        n = assert_host_budget(lambda: ConvBiasReLU(x, w, b, 1, 1), python=8, c=10)
        assert "_torch_form" in n.py_names


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_epilogue_op_every_piece(backend):
    """``act((c * scale + bias + res * res_scale) * mask)`` with NCHW res, an expanded dy and odd sizes."""
    c0 = randn((3, 7, 5, 3)).contiguous(memory_format=CL)
    r0 = randn((3, 7, 5, 3))  # NCHW: copied into channels-last by the plan
    s, rs = torch.rand(7) + 0.5, torch.rand(1, 7, 1, 1) + 0.5
    b0 = randn(7)
    m = (torch.rand(3, 7, 5, 3) > 0.3).to(torch.int8)
    c, b, r = c0.clone().requires_grad_(), b0.clone().requires_grad_(), r0.clone().requires_grad_()
    with use_backend(backend), poisoned_allocations():
        y = conv_epilogue(c, s, b, r, rs, m, relu=True)
        y.sum().backward()  # an expanded (stride-0) gradient
    hi = [t.double().requires_grad_() for t in (c0, b0, r0)]
    y_hi = torch.relu((hi[0] * s.double().view(1, -1, 1, 1) + hi[1].view(1, -1, 1, 1) + hi[2] * rs.double()) * m)
    y_hi.sum().backward()
    for name, got, ref in (("y", y, y_hi), ("dc", c.grad, hi[0].grad), ("dbias", b.grad, hi[1].grad),
                           ("dres", r.grad, hi[2].grad)):
        assert_close_tolerance(got, ref, None, atol=2e-5 * max(1.0, ref.abs().max().item()), name=name)


@pytest.mark.parametrize("call,exc,match", [
    (lambda x, w, b: ConvBiasReLU(x, w, b, -1, 1), ValueError, "padding must be >= 0"),
    (lambda x, w, b: ConvBiasReLU(x, w, b, 1, 0), ValueError, "stride must be >= 1"),
    (lambda x, w, b: ConvBiasReLU(x, w, b, 1.5, 1), TypeError, "padding must be an int"),
    (lambda x, w, b: ConvBias(x, w, b[:3], 0, 1), ValueError, r"bias must have one element per output channel \(4\)"),
    (lambda x, w, b: ConvBiasReLU(x[0], w, b, 0, 1), ValueError, "x must be 4-D"),
    (lambda x, w, b: ConvBiasReLU(x, w.double(), b, 0, 1), TypeError, "weight must have x's dtype"),
    (lambda x, w, b: ConvBiasReLU(x, w[:, :2], b, 0, 1), ValueError, "weight has 2 input channels, x has 3"),
    (lambda x, w, b: ConvBiasMaskReLU(x, w, b, torch.ones(2, 4, 2, 2, dtype=torch.int8), 1, 1), ValueError,
     r"mask must have the output's shape \(2, 4, 5, 4\)"),
    (lambda x, w, b: ConvFrozenScaleBiasReLU(x, w, torch.ones(5), b, 1, 1), ValueError, "scale must have one"),
    (lambda x, w, b: ConvBiasReLU(x, w, b, 0, 9), ValueError, None),
    (lambda x, w, b: ConvBiasReLU(x[:, :, :1, :1], w, b, 0, 1), ValueError, "does not fit"),
])
def test_bad_arguments(call, exc, match):
    x = randn((2, 3, 5, 4)).contiguous(memory_format=CL)
    w, b = randn((4, 3, 3, 3)), randn(4)
    if match is None:  # stride larger than the image is fine for Apex too: it gives a 1x1 output
        assert call(x, w, b).shape == (2, 4, 1, 1)
        return
    with pytest.raises(exc, match=match):
        call(x, w, b)


def test_apex_alias():
    import culmen.compat as compat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a real flash_attn in the environment is left alone: not our concern here
        compat.install()
    try:
        from apex.contrib.conv_bias_relu import ConvBiasReLU as Aliased
        from apex.contrib.conv_bias_relu import ConvFrozenScaleBiasReLU as Frozen

        assert Aliased is ConvBiasReLU and Frozen is ConvFrozenScaleBiasReLU
    finally:
        compat.uninstall()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["relu", "bias", "mask", "frozen"])
@pytest.mark.parametrize("route,amp", [("torch", torch.float16), ("fused", torch.float16), ("fused", torch.bfloat16)])
def test_gpu_fp16_resnet_shape(kind, route, amp):
    """fp16 channels-last at a ResNet-50 stage-2 shape under autocast (Apex casts to fp16 whatever the autocast
    dtype), on both routes of a call recording autograd."""
    dev = torch.device("cuda")
    x0 = randn((8, 64, 56, 56), device=dev).contiguous(memory_format=CL)
    w0 = randn((64, 64, 3, 3), device=dev, scale=0.05)
    v1 = randn((1, 64, 1, 1), device=dev) if kind != "frozen" else torch.rand(64, device=dev) + 0.5
    v2 = randn(64, device=dev) if kind == "frozen" else None
    mask = (torch.rand(8, 64, 56, 56, device=dev) > 0.5).to(torch.int8).contiguous(memory_format=CL)
    x, w, b = _leaf(x0), _leaf(w0), v1.clone().requires_grad_(kind != "frozen")
    with torch.autocast("cuda", dtype=amp), _route(route):
        y = _run(kind, x, w, b, v2, mask, 1, 1)
    assert (type(y.grad_fn).__name__ == "_FusedBackward") == (route == "fused" and kind != "bias")
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=CL)
    dy = randn(y.shape, torch.float16, dev)
    y.backward(dy)
    hi = [t.detach().half().double().requires_grad_() for t in (x0, w0, v1)]
    lo = [t.detach().half().requires_grad_() for t in (x0, w0, v1)]
    y_hi = _oracle(kind, *hi, None if v2 is None else v2.half().double(), mask, 1, 1)
    y_lo = _oracle(kind, *lo, None if v2 is None else v2.half(), mask, 1, 1)
    y_hi.backward(dy.double())
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    assert_close_tolerance(x.grad, hi[0].grad, lo[0].grad, name="dx")
    assert_close_tolerance(w.grad, hi[1].grad, lo[1].grad, name="dweight")
    if kind != "frozen":
        assert_close_tolerance(b.grad, hi[2].grad, lo[2].grad, name="dbias")
