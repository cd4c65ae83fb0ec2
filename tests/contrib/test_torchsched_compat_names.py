"""Behaviour of the torchsched names added for Apex's API: the layer-norm op functions (values and gradients
vs a float64 reference), the symbolic CUDA events, the pattern pre-grad pass, and the clear errors of the
Inductor / cuDNN-frontend internals culmen does not implement."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from culmen.contrib.torchsched import config
from culmen.contrib.torchsched.backend import DecompositionsWrapper, enable_multi_stream_scheduling, get_backend
from culmen.contrib.torchsched.inductor import patch_graph_lowering
from culmen.contrib.torchsched.inductor.event import CudaEventFactory, CudaEventSym
from culmen.contrib.torchsched.inductor.scheduler import MultiCudaStreamScheduler
from culmen.contrib.torchsched.inductor.wrapper import EnterCudaStreamContextLine, MultiStreamWrapperCodegen
from culmen.contrib.torchsched.ops import layer_norm as ln
from culmen.contrib.torchsched.passes import pre_grad_passes as pgp
from culmen.testing.tolerance import assert_close_tolerance


def _ref(x, shape, w, b, eps):
    x64 = x.double()
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    mean = x64.mean(dims, keepdim=True)
    var = x64.var(dims, unbiased=False, keepdim=True)
    inv = (var + eps).rsqrt()
    return (x64 - mean) * inv * w.double() + b.double(), mean, inv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 3, 4, 6)])
def test_layer_norm_op_values_and_backward(dtype, shape):
    torch.manual_seed(0)
    normalized = list(shape[-2:]) if len(shape) == 4 else [shape[-1]]
    x = torch.randn(shape, dtype=dtype) * 2 + 0.5
    w = torch.randn(normalized, dtype=dtype)
    b = torch.randn(normalized, dtype=dtype)
    y, mean, inv = ln.layer_norm(x, normalized, w, b, 1e-5)
    y_ref, mean_ref, inv_ref = _ref(x, normalized, w, b, 1e-5)
    m = x.numel() // w.numel()
    assert mean.shape == (m, 1, 1, 1) and mean.dtype == torch.float32 and y.dtype == dtype
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
    y_lo = F.layer_norm(xl, normalized, wl, bl, 1e-5)  # PyTorch in the low precision: the error baseline
    assert_close_tolerance(y, y_ref, y_lo.detach(), name="y")
    torch.testing.assert_close(mean.double().flatten(), mean_ref.flatten(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inv.double().flatten(), inv_ref.flatten(), rtol=1e-4, atol=1e-5)
    dy = torch.randn_like(x)
    dx, dw, db = ln.layer_norm_backward(dy, mean, inv, x, normalized, w, b)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    _ref(x64, normalized, w64, b64, 1e-5)[0].backward(dy.double())
    y_lo.backward(dy)
    cases = (("dx", dx, x64.grad, xl.grad), ("dw", dw, w64.grad, wl.grad), ("db", db, b64.grad, bl.grad))
    for nm, got, want, lo in cases:
        assert got.dtype == dtype
        assert_close_tolerance(got, want, lo, name=nm)
    fake = ln.layer_norm_fake(x, normalized, w, b)
    assert [t.shape for t in fake] == [y.shape, mean.shape, inv.shape]


def test_layer_norm_autograd_helpers_and_errors():
    torch.manual_seed(1)
    x, w, b = torch.randn(4, 6), torch.randn(6), torch.randn(6)

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(x, normalized_shape, weight, bias, eps):
            return ln.layer_norm(x, normalized_shape, weight, bias, eps)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ln.layer_norm_setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx, dy, dmean, dinv):
            return ln.layer_norm_backward_wrapper(ctx, dy, dmean, dinv)

    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    Fn.apply(xs, [6], ws, bs, 1e-5)[0].sum().backward()
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    F.layer_norm(xr, [6], wr, br, 1e-5).sum().backward()
    for got, want in ((xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="normalized_shape"):
        ln.layer_norm(x, [5], w[:5], b[:5])
    with pytest.raises(NotImplementedError, match="cuDNN frontend"):
        ln.get_cudnn_manager()
    with pytest.raises(NotImplementedError, match="cuDNN frontend"):
        ln.CuDNNManager()
    with pytest.raises(NotImplementedError, match="cuDNN frontend"):
        ln.LayerNormGraphFactory.get_forward_graph(4, 6, torch.float32, torch.float32)


class _Buf:
    def __init__(self):
        self.lines = []

    def writeline(self, line):
        self.lines.append(line)


def test_cuda_event_symbols(monkeypatch):
    monkeypatch.setattr(config, "reuse_cuda_event", True)
    f = CudaEventFactory()
    e1, e2 = f.get_sym_event(1), f.get_sym_event(2)
    assert e1 < e2 and e1 != e2 and len({e1, e2, f.get_entrance_event()}) == 3
    assert f.get_entrance_event().materialized_event == "event0"
    other = CudaEventFactory().get_sym_event(1)
    assert e1 != other
    with pytest.raises(TypeError):
        _ = e1 < other
    w1 = e1.wait(0)  # waits are counted before the record is generated
    buf = _Buf()
    e1.record(1).codegen(buf)
    e2.record(2).codegen(buf)  # no waiter: not materialized
    w1.codegen(buf)
    e3 = f.get_sym_event(1)
    w3 = e3.wait(2)
    e3.record(1).codegen(buf)  # reuses event1's name
    w3.codegen(buf)
    assert buf.lines == ["event1 = torch.cuda.Event()", "event1.record(stream1)", "event1.wait(stream0)",
                         "event1.record(stream1)", "event1.wait(stream2)"]
    with pytest.raises(ValueError, match="own event"):
        e1.wait(1)
    assert isinstance(e1, CudaEventSym)


def test_pattern_pass_and_backend_object():
    class M(torch.nn.Module):
        def forward(self, x, w, b):
            return F.layer_norm(x, (8,), w, b, 1e-5) * 2

    gm = fx.symbolic_trace(M())
    for n in gm.graph.nodes:  # dynamo's graphs pass the optional arguments positionally
        if n.op == "call_function" and n.target is F.layer_norm:
            n.args, n.kwargs = tuple(n.args) + tuple(n.kwargs.values()), {}
    gm.recompile()
    calls = []

    def replacement(x, normalized_shape, weight, bias, eps):
        calls.append(1)
        return pgp.replace_layer_norm(x, normalized_shape, weight, bias, eps)

    assert pgp.run_pre_grad_pass("t", gm.graph, F.layer_norm, replacement) == 1
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    torch.testing.assert_close(gm(x, w, b), F.layer_norm(x, (8,), w, b, 1e-5) * 2)
    assert calls
    pgp.register_pattern("compat_test_pattern", F.layer_norm, pgp.replace_layer_norm)
    try:
        with pytest.raises(ValueError, match="already registered"):
            pgp.register_pattern("compat_test_pattern", F.layer_norm, pgp.replace_layer_norm)
    finally:
        pgp.PRE_GRAD_PASSES.pop("compat_test_pattern")
    wrapper = get_backend("torchsched")
    assert isinstance(wrapper, DecompositionsWrapper) and wrapper.mode == "default"
    assert wrapper.options == {"allow_buffer_reuse": False, "inplace_buffers": False}
    assert DecompositionsWrapper(wrapper.decompositions) == wrapper  # culmen's earlier one-dict form
    with pytest.raises(TypeError, match="mode"):
        DecompositionsWrapper(3, None, False, {})


def test_inductor_internals_raise_clear_errors():
    patch_graph_lowering(False)  # restoring the default is a no-op
    for call in (lambda: patch_graph_lowering(True), lambda: MultiCudaStreamScheduler([]),
                 lambda: MultiStreamWrapperCodegen(), lambda: EnterCudaStreamContextLine(None, 1, set(), set(), set()),
                 lambda: enable_multi_stream_scheduling(lambda *a: None)):
        with pytest.raises(NotImplementedError, match="backend='torchsched'"):
            call()
