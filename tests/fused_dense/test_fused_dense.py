"""``culmen.fused_dense`` (Apex's ``FusedDense`` / ``FusedDenseGeluDense``) and the ``fused_dense_cuda`` /
``fused_dense_lib`` extension shims, against float64 oracles with the tolerance rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from culmen.fused_dense import (
    DenseNoBiasFunc,
    FusedDense,
    FusedDenseFunc,
    FusedDenseGeluDense,
    FusedDenseGeluDenseFunc,
    dense_no_bias_function,
    fused_dense_function,
    fused_dense_gelu_dense_function,
)
from culmen.fused_dense import fused_dense_cuda as ext
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


def _check(got, fn, inputs, g, label):
    """``got`` = (y, *grads); ``fn(*inputs)`` run on float64 copies (oracle) and in the input dtype."""
    refs = {}
    for hi in (True, False):
        cp = [t.detach().to(F64 if hi else t.dtype).requires_grad_() for t in inputs]
        y = fn(*cp)
        refs[hi] = (y, *torch.autograd.grad(y, cp, g.to(y.dtype)))
    for i, (a, rh, rl) in enumerate(zip(got, refs[True], refs[False])):
        assert torch.isfinite(a).all(), f"{label} output {i}"
        assert a.dtype == (inputs[i - 1].dtype if i else inputs[0].dtype)
        assert_close_tolerance(a, rh, rl, name=f"{label} output {i}")


@pytest.mark.parametrize("bias,dtype", [(True, F32), (True, BF16), (False, F16)])
def test_fused_dense(backend, bias, dtype):
    m = FusedDense(13, 7, bias=bias).to(dtype)
    assert (m.bias is not None) == bias and m.weight.shape == (7, 13)
    x = make_noncontiguous(randn((3, 5, 13), dtype)).requires_grad_()
    y = m(x)
    assert y.shape == (3, 5, 7)
    g = randn(y.shape, dtype)
    params = [m.weight] + ([m.bias] if bias else [])
    got = (y, *torch.autograd.grad(y, [x, *params], g))
    _check(got, lambda x, w, *b: F.linear(x, w, b[0] if b else None), [x, *params], g, f"FusedDense {dtype}")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_dense_gelu_dense(backend, dtype):
    m = FusedDenseGeluDense(13, 37, 6).to(dtype)
    x = randn((4, 13), dtype, scale=2.0).requires_grad_()
    y = m(x)
    assert y.shape == (4, 6) and y.dtype == dtype
    g = randn(y.shape, dtype)
    ps = [m.weight1, m.bias1, m.weight2, m.bias2]
    got = (y, *torch.autograd.grad(y, [x, *ps], g))

    def ref(x, w1, b1, w2, b2):  # exact GELU, what Apex's test compares against
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    _check(got, ref, [x, *ps], g, f"FusedDenseGeluDense {dtype}")


def test_functionals_and_functions():
    x = randn((4, 6), F64, requires_grad=True)
    w = randn((5, 6), F64, requires_grad=True)
    b = randn(5, F64, requires_grad=True)
    for y in (fused_dense_function(x, w, b), FusedDenseFunc.apply(x, w, b)):
        torch.testing.assert_close(y, F.linear(x, w, b))
    for y in (dense_no_bias_function(x, w), DenseNoBiasFunc.apply(x, w)):
        torch.testing.assert_close(y, x @ w.t())
    dx, dw = torch.autograd.grad(DenseNoBiasFunc.apply(x, w).sum(), [x, w])
    torch.testing.assert_close(dw, torch.ones(4, 5, dtype=F64).t() @ x)
    w2, b2 = randn((3, 5), F64, requires_grad=True), randn(3, F64, requires_grad=True)
    ref = F.linear(F.gelu(F.linear(x, w, b)), w2, b2)
    for y in (fused_dense_gelu_dense_function(x, w, b, w2, b2), FusedDenseGeluDenseFunc.apply(x, w, b, w2, b2)):
        torch.testing.assert_close(y, ref)
    with torch.autocast("cpu", dtype=BF16):
        assert fused_dense_function(x.float(), w.float(), b.float()).dtype == BF16


def test_extension_shims(backend):
    x, w1, b1 = randn((6, 8)), randn((10, 8)), randn(10)
    w2, b2 = randn((4, 10)), randn(4)
    g = randn((6, 4))
    torch.testing.assert_close(ext.linear_bias_forward(x, w1, b1), F.linear(x, w1, b1))
    w = randn((4, 8))
    dx, dw, db = ext.linear_bias_backward(x, w, g)
    torch.testing.assert_close(dx, g @ w)
    torch.testing.assert_close(dw, g.t() @ x)
    torch.testing.assert_close(db, g.sum(0))
    out1, out2, gelu_in = ext.linear_gelu_linear_forward(x, w1, b1, w2, b2)
    torch.testing.assert_close(gelu_in, F.linear(x, w1, b1))
    torch.testing.assert_close(out1, F.gelu(gelu_in))
    torch.testing.assert_close(out2, F.linear(out1, w2, b2))
    grads = ext.linear_gelu_linear_backward(x, gelu_in, out1, w1, w2, g)
    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    ref = torch.autograd.grad(F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2])), leaves[3], leaves[4]),
                              leaves, g)
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    # flash_attn's fused_dense_lib names (tanh GELU).
    dw, db = ext.linear_bias_wgrad(x, g, True)
    torch.testing.assert_close(dw, g.t() @ x)
    assert ext.linear_bias_wgrad(x, g, False)[1] is None
    out, pre = ext.linear_act_forward(x, w1, b1, True, True, 0)
    torch.testing.assert_close(out, F.gelu(pre, approximate="tanh"))
    assert len(ext.linear_act_forward(x, w1, b1, False, False, 0)) == 1
    d_pre, d_b = ext.bias_act_linear_dgrad_bgrad(w2, g, pre, False, 0)
    torch.testing.assert_close(d_pre, (g @ w2) * (pre > 0))
    torch.testing.assert_close(d_b, d_pre.sum(0))


def test_bad_arguments():
    with pytest.raises(ValueError, match="without bias"):
        FusedDenseGeluDense(4, 8, 4, bias=False)
    m = FusedDense(6, 3)
    with pytest.raises(ValueError, match=r"weight must have shape \(out_features, 5\)"):
        m(torch.randn(2, 5))
    with pytest.raises(TypeError, match="input is torch.float64 but weight's parameters are torch.float32"):
        m(torch.randn(2, 6, dtype=F64))
    m2 = FusedDenseGeluDense(6, 8, 3)
    with pytest.raises(ValueError, match=r"weight2 must have shape \(out_features, 8\)"):
        fused_dense_gelu_dense_function(torch.randn(2, 6), m2.weight1, m2.bias1, m2.weight1, m2.bias2)


def test_torch_compile_fullgraph():
    m = FusedDenseGeluDense(9, 16, 4)
    x = randn((6, 9), requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    params = list(m.parameters())
    y = compiled(x)
    got = torch.autograd.grad(y.square().sum(), [x, *params])
    y_ref = m(x)
    ref = torch.autograd.grad(y_ref.square().sum(), [x, *params])
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_rounding_matches_apex_reference(dtype):
    """Apex's test reference is ``torch.matmul(x, W.t()) + b`` in the input dtype: the product is rounded
    before the bias add. FusedDense (module, functional, ``FusedDenseFunc``, the extension) rounds the same
    way, so the outputs are equal, not merely close (a bias in the GEMM epilogue, rounded once, moves ~1 in
    4 bf16 outputs by an ulp, beyond Apex's 1e-3); the gradients are the reference's formulas."""
    torch.manual_seed(0)
    x = (torch.randn(48, 64) * 2).to(dtype).requires_grad_()
    m = FusedDense(64, 96).to(dtype)
    y = m(x)
    y_ref = torch.matmul(x.detach(), m.weight.detach().t()) + m.bias.detach()
    assert torch.equal(y, y_ref)
    for out in (fused_dense_function(x, m.weight, m.bias), FusedDenseFunc.apply(x, m.weight, m.bias),
                ext.linear_bias_forward(x.detach(), m.weight.detach(), m.bias.detach())):
        assert torch.equal(out, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(m.weight.grad, torch.matmul(dy.t(), x.detach()))
    assert torch.equal(x.grad, torch.matmul(dy, m.weight.detach()))
    assert torch.equal(m.bias.grad, dy.sum(0))
    x3 = x.detach()[:30].reshape(2, 15, 64)
    assert torch.equal(m(x3), torch.matmul(x3, m.weight.detach().t()) + m.bias.detach())


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_gelu_dense_rounding_matches_apex_reference(reference_backend, dtype):
    """FusedDenseGeluDense against ``matmul(gelu(matmul(x, W1.t()) + b1), W2.t()) + b2`` in the input dtype
    (Apex's test reference): equal on the reference path (the GPU's GELU kernel may differ by an ulp)."""
    torch.manual_seed(1)
    m = FusedDenseGeluDense(16, 40, 12).to(dtype)
    x = torch.randn(3, 7, 16).to(dtype)
    w1, b1, w2, b2 = (p.detach() for p in (m.weight1, m.bias1, m.weight2, m.bias2))
    ref = torch.matmul(F.gelu(torch.matmul(x, w1.t()) + b1), w2.t()) + b2
    assert torch.equal(m(x), ref)
    assert torch.equal(FusedDenseGeluDenseFunc.apply(x.reshape(-1, 16), w1, b1, w2, b2), ref.reshape(-1, 12))
    _, out2, gelu_in = ext.linear_gelu_linear_forward(x.reshape(-1, 16), w1, b1, w2, b2)
    assert torch.equal(out2, ref.reshape(-1, 12))
    assert torch.equal(gelu_in, (torch.matmul(x, w1.t()) + b1).reshape(-1, 40))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.half, torch.float, torch.bfloat16])
def test_apex_fused_dense_settings_gpu(dtype):
    """Apex's contrib fused_dense test settings (3 x 512 tokens, 1024 -> 3072) with its 1e-3 tolerances."""
    torch.manual_seed(0)
    x = torch.randn(3 * 512, 1024, dtype=dtype, device="cuda").requires_grad_()
    dense = FusedDense(1024, 3072).to(dtype=dtype).cuda()
    y = dense(x)
    y_ref = torch.matmul(x.detach(), dense.weight.detach().t()) + dense.bias.detach()
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(y_ref, y, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(torch.matmul(dy.t(), x.detach()), dense.weight.grad, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(torch.matmul(dy, dense.weight.detach()), x.grad, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(dy.sum(0), dense.bias.grad, atol=1e-3, rtol=1e-3)
    m = FusedDenseGeluDense(1024, 1536, 512).to(dtype=dtype).cuda()
    w1, b1, w2, b2 = (p.detach() for p in (m.weight1, m.bias1, m.weight2, m.bias2))
    ref = torch.matmul(F.gelu(torch.matmul(x.detach(), w1.t()) + b1), w2.t()) + b2
    torch.testing.assert_close(ref, m(x.detach()), atol=1e-3, rtol=1e-3)
