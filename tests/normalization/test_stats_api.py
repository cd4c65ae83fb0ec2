"""Apex's functional normalization API with explicit statistics (``fused_layer_norm_affine_fwd`` / ``_bwd``
and the RMS / non-affine variants, their ``*_fake`` shape functions): outputs against culmen's modules,
statistics against float64 formulas, and every backward (from the input and, ``memory_efficient``, from
the output) against autograd of a float64 formula."""

from __future__ import annotations

import pytest
import torch

from culmen.normalization import fused_layer_norm as F


def _ref(x, w, b, eps, rms):
    x64 = x.double()
    mean = None if rms else x64.mean(-1, keepdim=True)
    c = x64 if rms else x64 - mean
    y = c * torch.rsqrt(c.square().mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_stats_api_forward_and_backward(rms, affine, memory_efficient):
    torch.manual_seed(0)
    shape, ns, eps = (3, 5, 12), [12], 1e-5
    x = torch.randn(shape, dtype=torch.float16) * 2 + 0.5
    w = (torch.rand(12) + 0.5).requires_grad_() if affine else None
    b = (torch.randn(12) * 0.1).requires_grad_() if affine and not rms else None
    if rms:
        out, invvar = (F.fused_rms_norm_affine_fwd(x, w, ns, eps, memory_efficient) if affine
                       else F.fused_rms_norm_fwd(x, ns, eps, memory_efficient))
        mean = None
    else:
        out, mean, invvar = (F.fused_layer_norm_affine_fwd(x, w, b, ns, eps, memory_efficient) if affine
                             else F.fused_layer_norm_fwd(x, ns, eps, memory_efficient))
        assert mean.shape == (15,) and mean.dtype == torch.float32
        torch.testing.assert_close(mean.double(), x.double().mean(-1).reshape(-1), rtol=1e-6, atol=1e-6)
    assert out.dtype == torch.float16 and invvar.shape == (15,) and invvar.dtype == torch.float32
    want = _ref(x, w, b, eps, rms)
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)
    module = (F.FusedRMSNorm if rms else F.FusedLayerNorm)(12, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            module.weight.copy_(w)
            if b is not None:
                module.bias.copy_(b)
            elif not rms:
                module.bias.zero_()
    torch.testing.assert_close(out, module(x.float()).half(), rtol=2e-3, atol=2e-3)
    # backward from the saved statistics
    dy = torch.randn(shape, dtype=torch.float16)
    x64 = x.double().requires_grad_()
    params = [p.detach().double().requires_grad_() if p is not None else None for p in (w, b)]
    y64 = _ref(x64, params[0], params[1], eps, rms)
    grads = torch.autograd.grad(y64, [x64] + [p for p in params if p is not None], dy.double())
    src = out if memory_efficient else x
    wd, bd = (w.detach() if w is not None else None), (b.detach() if b is not None else None)
    if rms:
        got = (F.fused_rms_norm_affine_bwd(dy, invvar, src, ns, wd, eps, memory_efficient) if affine
               else (F.fused_rms_norm_bwd(dy, invvar, src, ns, eps, memory_efficient),))
    else:
        got = (F.fused_layer_norm_affine_bwd(dy, mean, invvar, src, ns, wd, bd, eps, memory_efficient) if affine
               else (F.fused_layer_norm_bwd(dy, mean, invvar, src, ns, eps, memory_efficient),))
    tol = 3e-2 if memory_efficient else 5e-3  # from the fp16 output the normalized input is rounded
    for g, want_g in zip(got, grads):
        torch.testing.assert_close(g.double(), want_g, rtol=tol, atol=tol)
    # the forward outputs are differentiable
    xs = x.float().requires_grad_()
    o = F.fused_layer_norm_fwd(xs, ns, eps)[0]
    o.sum().backward()
    assert xs.grad is not None


def test_fakes_and_flag():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    w, b = torch.ones(8), torch.zeros(8)
    o, m, v = F.fused_layer_norm_affine_fwd_fake(x, w, b, [8], 1e-5)
    assert o.shape == x.shape and m.shape == (6,) and m.dtype == torch.float32
    assert F.fused_rms_norm_fwd_fake(x, [3, 8], 1e-5)[1].shape == (2,)
    assert F.fused_layer_norm_affine_bwd_fake(x, m, v, x, [8], w, b, 1e-5)[1].shape == (8,)
    assert isinstance(F.supports_custom_op(), bool)
    with pytest.raises(ValueError, match="normalized_shape"):
        F.fused_layer_norm_fwd(x, [7], 1e-5)
