"""Output strides of attention, eager and under ``torch.compile`` with Inductor (issue 14, item 14).

flash_attn's ``out`` is a contiguous ``(b, s, h, d)`` (``(total, h, d)`` varlen) tensor, so scripts call
``.view`` on it. Every culmen path (reference, kernels, compiled) must give contiguous outputs, and the
fake implementations of the ``torch.library`` ops must give the strides the real ops give: Inductor plans
its buffers from them. The compiled graphs here run on CPU with the Inductor backend (fullgraph, forward
and backward) and are compared with eager mode.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from culmen.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from culmen.flash_attn.modules.mha import FlashCrossAttention, FlashSelfAttention
from culmen.ops.attention import op  # noqa: F401  (registers culmen::flash_attn_fwd / _varlen_fwd)

B, S, H, D = 2, 9, 4, 16
CU = [0, 4, 11, 18]


def _cu():
    return torch.tensor(CU, dtype=torch.int32)


def _all_forms(q, k, v, qkv, kv, qp, kp, vp, qkvp, kvp):
    """Every interface form, eager or traced: six outputs."""
    cu = _cu().to(q.device)
    return (flash_attn_func(q, k, v, causal=True),
            flash_attn_qkvpacked_func(qkv),
            flash_attn_kvpacked_func(q, kv, window_size=(3, 1)),
            flash_attn_varlen_func(qp, kp, vp, cu, cu, 7, 7, causal=True),
            flash_attn_varlen_qkvpacked_func(qkvp, cu, 7),
            flash_attn_varlen_kvpacked_func(qp, kvp, cu, cu, 7, 7))


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    return (r(B, S, H, D), r(B, S, H, D), r(B, S, H, D), r(B, S, 3, H, D), r(B, S, 2, H, D),
            r(18, H, D), r(18, H, D), r(18, H, D), r(18, 3, H, D), r(18, 2, H, D))


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
def test_eager_outputs_contiguous_and_viewable(request, backend):
    request.getfixturevalue(backend)
    outs = _all_forms(*_inputs())
    for o in outs:
        assert o.is_contiguous(), o.stride()
        o.view(o.shape[0], -1)  # what scripts do with flash_attn's output


def test_reference_gradients_contiguous(reference_backend):
    q, k, v = (torch.randn(B, S, H, D, requires_grad=True) for _ in range(3))
    grads = torch.autograd.grad(flash_attn_func(q, k, v, causal=True).sum(), (q, k, v))
    assert all(g.is_contiguous() for g in grads)


def test_fake_strides_match_real():
    """The ops' fake implementations (run by torch.compile's tracing) give the real outputs' strides."""
    q, k, v = (torch.randn(B, S, H, D).transpose(1, 2).contiguous().transpose(1, 2) for _ in range(3))  # permuted
    cu = _cu()
    qp = torch.randn(18, H, D)
    dense_args = (q, k, v, None, None, 0.0, D ** -0.5, True, -1, -1, 0.0, False, False)
    varlen_args = (qp, qp, qp, cu, cu, 7, 7, None, None, 0.0, D ** -0.5, False, -1, -1, 0.0, False, False)
    real = [torch.ops.culmen.flash_attn_fwd(*dense_args), torch.ops.culmen.flash_attn_varlen_fwd(*varlen_args)]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fd = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in dense_args]
        fv = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in varlen_args]
        fake = [torch.ops.culmen.flash_attn_fwd(*fd), torch.ops.culmen.flash_attn_varlen_fwd(*fv)]
    for r_outs, f_outs in zip(real, fake):
        for r, f in zip(r_outs[:2], f_outs[:2]):  # out, lse
            assert r.shape == f.shape and r.stride() == f.stride() and r.is_contiguous(), (r.stride(), f.stride())


def _train(fn, inputs):
    outs = fn(*inputs)
    loss = sum(o.square().sum() for o in outs)
    grads = torch.autograd.grad(loss, [t for t in inputs if t.requires_grad])
    return outs, grads


def test_inductor_fullgraph_every_form_matches_eager():
    """One fullgraph Inductor graph with all six functions, ``.view`` on every output, forward and
    backward, equal to eager mode."""
    torch._dynamo.reset()

    def fn(*a):
        return tuple(o.view(o.shape[0], -1) for o in _all_forms(*a))

    inputs = _inputs()
    want, want_g = _train(fn, inputs)
    got, got_g = _train(torch.compile(fn, fullgraph=True), inputs)
    for a, b in zip(got + got_g, want + want_g):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_inductor_fullgraph_modules_match_eager():
    """FlashSelfAttention (dense) and FlashCrossAttention (varlen) compiled with Inductor, fullgraph."""
    torch._dynamo.reset()
    self_attn, cross_attn = FlashSelfAttention(causal=True), FlashCrossAttention(window_size=(4, 0))
    cu = _cu()

    def fn(qkv, qp, kvp):  # the dense and varlen calls of each module (the compile time is the cost here)
        outs = (self_attn(qkv), cross_attn(qp, kvp, cu_seqlens=cu, max_seqlen=7, cu_seqlens_k=cu, max_seqlen_k=7))
        return tuple(o.view(o.shape[0], -1) for o in outs)

    a = _inputs()
    inputs = (a[3], a[5], a[9])
    want, want_g = _train(fn, inputs)
    got, got_g = _train(torch.compile(fn, fullgraph=True), inputs)
    for x, y in zip(got + got_g, want + want_g):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_inductor_outputs_contiguous(dtype):
    """On the GPU (the Triton kernels inside the compiled graph): contiguous outputs, ``.view`` works,
    results equal to eager mode."""
    torch._dynamo.reset()
    a = [t.detach().cuda().requires_grad_() for t in _inputs(dtype)]

    def fn(*x):
        return tuple(o.view(o.shape[0], -1) for o in _all_forms(*x))

    want, want_g = _train(fn, a)
    got, got_g = _train(torch.compile(fn, fullgraph=True), a)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for x, y in zip(got + got_g, want + want_g):
        torch.testing.assert_close(x, y, **tol)
    assert all(o.is_contiguous() for o in _all_forms(*a))
