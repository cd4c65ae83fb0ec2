"""``torch.compile(fullgraph=True)`` of ``culmen.contrib.conv_bias_relu`` and ``culmen.ops.conv_epilogue``: the
epilogue traces as the custom op ``culmen::conv_epilogue_fwd`` (no graph break), and the compiled forward and the
gradients of every differentiable input equal the eager call's and a float64 PyTorch formulation's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compile_checks import compile_keeping_graphs as _compile  # tests/contrib helper

from culmen.contrib.conv_bias_relu import ConvBiasMaskReLU, ConvBiasReLU, ConvFrozenScaleBiasReLU
from culmen.contrib.conv_bias_relu.conv_bias_relu import fused_conv_epilogue
from culmen.ops.backend import use_backend
from culmen.ops.conv_epilogue import conv_epilogue
from culmen.testing import randn
from culmen.testing.tolerance import assert_close_tolerance


def _run(fn, inputs):
    xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    y = fn(*xs)
    # drawn in float64 so that every dtype's run gets the same output gradient
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(y.device, y.dtype)
    grads = torch.autograd.grad(y, [t for t in xs if t.requires_grad], dy)
    return y, grads


def _check(fn, ref64, inputs):
    graphs: list = []
    eager = _run(fn, inputs)
    compiled = _run(_compile(fn, graphs), inputs)
    assert any("conv_epilogue_fwd" in g for g in graphs), graphs
    torch.testing.assert_close(compiled[0], eager[0])
    assert len(compiled[1]) == len(eager[1])
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b)
    # and against float64 PyTorch (the compiled graph runs the op's own body, not the eager route)
    exact = _run(ref64, [t.double() for t in inputs])
    assert_close_tolerance(compiled[0], exact[0], _run(ref64, inputs)[0])
    for a, b, lp in zip(compiled[1], exact[1], _run(ref64, inputs)[1]):
        assert_close_tolerance(a, b, lp)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_conv_bias_relu_compiled(backend):
    x = randn((2, 3, 7, 6), requires_grad=True)
    w = randn((5, 3, 3, 3), requires_grad=True)
    b = randn((1, 5, 1, 1), requires_grad=True)
    with use_backend(backend):
        _check(lambda x, w, b: ConvBiasReLU(x, w, b, 1, 2) * 1.5,
               lambda x, w, b: F.relu(F.conv2d(x, w, b.reshape(-1), 2, 1)) * 1.5, [x, w, b])


def test_conv_bias_mask_relu_compiled():
    x = randn((2, 4, 5, 5), requires_grad=True)
    w = randn((3, 4, 1, 1), requires_grad=True)
    b = randn((3,), requires_grad=True)
    mask = (torch.rand(2, 3, 5, 5) > 0.4).to(torch.int8)
    _check(lambda x, w, b: ConvBiasMaskReLU(x, w, b, mask, 0, 1),
           lambda x, w, b: F.relu(F.conv2d(x, w, b) * mask.to(x.dtype)), [x, w, b])


def test_frozen_scale_bias_relu_compiled():
    """Frozen factors get no gradient in the compiled graph either."""
    x = randn((1, 3, 6, 5), requires_grad=True)
    w = randn((4, 3, 3, 3), requires_grad=True)
    scale = (torch.rand(1, 4, 1, 1) + 0.5).requires_grad_()
    bias = randn((1, 4, 1, 1), requires_grad=True)
    graphs: list = []
    fn = _compile(lambda x, w: ConvFrozenScaleBiasReLU(x, w, scale, bias, 1, 1), graphs)
    y = fn(x, w)
    assert any("conv_epilogue_fwd" in g for g in graphs)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None and scale.grad is None and bias.grad is None

    def ref(x, w):
        return F.relu(F.conv2d(x, w, None, 1, 1) * scale.to(x.dtype).detach() + bias.to(x.dtype).detach())

    exact, lo = _run(ref, [x.double(), w.double()]), _run(ref, [x, w])
    assert_close_tolerance(y, exact[0], lo[0])
    # _run's output gradient is seeded random data; redo the compiled gradient with it
    _, (dx, dw) = _run(fn, [x, w])
    assert_close_tolerance(dx, exact[1][0], lo[1][0], name="dx")
    assert_close_tolerance(dw, exact[1][1], lo[1][1], name="dw")


def test_conv_epilogue_op_compiled_residual():
    """The op-level call with every operand: scale, bias, residual with its scale, bool mask, ReLU; gradients
    for ``c``, ``bias`` and ``res``."""
    c = randn((2, 6, 3, 5), requires_grad=True)
    bias = randn((6,), requires_grad=True)
    res = randn((2, 6, 3, 5), requires_grad=True)
    scale, rscale = torch.rand(6) + 0.5, torch.rand(6) + 0.5
    mask = torch.rand(2, 6, 3, 5) > 0.3

    def ref(c, bias, res):
        ch = (1, -1, 1, 1)
        return F.relu((c * scale.to(c.dtype).view(ch) + bias.view(ch) + res * rscale.to(c.dtype).view(ch))
                      * mask.to(c.dtype))

    _check(lambda c, bias, res: conv_epilogue(c, scale, bias, res, rscale, mask, True), ref, [c, bias, res])


def test_fused_conv_epilogue_compiled():
    """The bottleneck's last stage: conv, frozen factors, a 1x1 strided residual convolution, ReLU."""
    x = randn((2, 3, 6, 6), requires_grad=True)
    w = randn((4, 3, 3, 3), requires_grad=True)
    res = randn((2, 5, 6, 6), requires_grad=True)
    rw = randn((4, 5, 1, 1), requires_grad=True)
    scale, bias, rscale = torch.rand(4) + 0.5, randn((4,)), torch.rand(4) + 0.5

    def ref(x, w, res, rw):
        ch = (1, -1, 1, 1)
        c = F.conv2d(x, w, None, 2, 1)
        r = F.conv2d(res, rw, None, 2)
        return F.relu(c * scale.to(x.dtype).view(ch) + bias.to(x.dtype).view(ch) + r * rscale.to(x.dtype).view(ch))

    _check(lambda x, w, res, rw: fused_conv_epilogue(x, w, scale, bias, 1, 2, True, res, rw, rscale, 2), ref,
           [x, w, res, rw])


def test_opcheck():
    """The ops' schemas, fake implementations (shapes, strides, dtypes of the real outputs) and autograd
    registration hold (``torch.library.opcheck``)."""
    ops = torch.ops.culmen
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    c = randn((2, 5, 3, 4), requires_grad=True).contiguous(memory_format=torch.channels_last)
    bias, res = randn((5,), requires_grad=True), randn((2, 5, 3, 4), requires_grad=True)
    scale, mask = torch.rand(5) + 0.5, torch.rand(2, 5, 3, 4) > 0.3
    torch.library.opcheck(ops.conv_epilogue_fwd.default, (c, scale, bias, res, scale, mask, True), test_utils=checks)
    torch.library.opcheck(ops.conv_epilogue_fwd.default, (c, None, None, None, None, None, False), test_utils=checks)
    y = torch.relu(c.detach())
    for need in ((True, True, True), (True, False, False), (False, False, True)):
        torch.library.opcheck(ops.conv_epilogue_bwd.default, (randn((2, 5, 3, 4)), y, mask, scale, scale, True, *need),
                              test_utils=checks)
    # no ReLU, no mask, no scale: dc equals dy but must not alias it
    torch.library.opcheck(ops.conv_epilogue_bwd.default, (randn((2, 5, 3, 4)), None, None, None, None, False, True,
                                                          False, False), test_utils=checks)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compiled_gpu(dtype):
    """On a GPU the epilogue op launches the Triton kernel through ``wrap_triton`` and Inductor (the default
    backend) compiles the graph; forward and gradients equal the eager fused path's."""
    dev = "cuda"
    x = randn((8, 32, 28, 28), dtype, dev).contiguous(memory_format=torch.channels_last)
    w = randn((64, 32, 3, 3), dtype, dev, scale=0.1).contiguous(memory_format=torch.channels_last)
    b = randn((1, 64, 1, 1), dtype, dev)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    mask = (torch.rand(8, 64, 28, 28, device=dev) > 0.3).to(torch.int8)

    def fn(x, w, b):
        return ConvBiasMaskReLU(x, w, b, mask, 1, 1) + ConvBiasReLU(x, w, b, 1, 1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    eager = _run(fn, [x, w, b])
    comp = _run(compiled, [x, w, b])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(comp[0], eager[0], **tol)
    for a, e in zip(comp[1], eager[1]):
        torch.testing.assert_close(a, e, **tol)
