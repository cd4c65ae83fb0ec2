"""The opaque ops ``culmen::flash_attn_ws_fwd`` / ``_bwd`` that carry the Gluon forward's calls through
``torch.compile`` (``launch_ws.WS_TUNING["compile"]``).

The ``triton_op`` path's traced plans never take the Gluon kernels (Inductor re-emits ``wrap_triton``'s kernels
in its own code), so a compiled model ran culmen's Triton attention. With the switch on, dense calls the Gluon
forward takes run as ``torch.library.custom_op``s that call the eager plans. On CPU the plans run the reference,
which is enough to check what these ops add: their fake implementations, their autograd, the eligibility rule,
and a compiled model's outputs and gradients against eager.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from culmen.flash_attn import flash_attn_func
from culmen.ops.attention import launch_ws, op


@pytest.fixture(autouse=True)
def _no_work_floor(monkeypatch):
    """The Gluon forward at any size: these tests' shapes are far below ``WS_TUNING["min_work"]``
    (``test_small_calls_keep_the_triton_forward`` checks the floor itself)."""
    monkeypatch.setitem(launch_ws.WS_TUNING, "min_work", {})


def _qkv(B=2, sq=9, sk=11, h=4, hk=2, d=16, dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(sq * 31 + sk)
    return [torch.randn(B, s, n, d, generator=g, dtype=dtype).requires_grad_(grad)
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck(causal):
    """``torch.library.opcheck``: schema, fake implementations (shapes and strides of the real outputs), and the
    autograd registration of the forward; the backward op on its own."""
    q, k, v = _qkv()
    torch.library.opcheck(op.flash_attn_ws_fwd_op, (q, k, v, 0.3, causal))
    out, lse = op.flash_attn_ws_fwd_op(q.detach(), k.detach(), v.detach(), 0.3, causal)
    dout = torch.randn_like(out)
    torch.library.opcheck(op.flash_attn_ws_bwd_op, (dout, q.detach(), k.detach(), v.detach(), out, lse, 0.3, causal))


def test_ops_match_the_eager_call():
    """Forward and gradients of the opaque forward (through its registered autograd) equal ``flash_attn``'s."""
    q, k, v = _qkv()
    out, lse = op.flash_attn_ws_fwd_op(q, k, v, 16 ** -0.5, True)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_lse, _ = op.flash_attn(q, k, v, causal=True)
    ref_g = torch.autograd.grad(ref_out, (q, k, v), dout)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eligibility(monkeypatch):
    """Only dense calls the Gluon forward takes, with static shapes, on CUDA, with the switch on."""
    monkeypatch.setattr(op, "nvidia_hopper", lambda device: True)
    monkeypatch.setattr(op, "use_kernels", lambda *a, **kw: True)
    monkeypatch.setattr(launch_ws.kernels_ws, "AVAILABLE", True)
    base = dict(dropout_p=0.0, causal=True, window_size=(-1, -1), softcap=0.0, alibi=None, deterministic=False,
                return_probs=False)
    with FakeTensorMode():
        q = torch.empty(2, 64, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 64, 2, 128, dtype=torch.bfloat16, device="cuda")
        monkeypatch.setitem(launch_ws.WS_TUNING, "compile", False)
        assert not op._ws_under_compile(q, k, k, **base)
        monkeypatch.setitem(launch_ws.WS_TUNING, "compile", True)
        assert op._ws_under_compile(q, k, k, **base)
        for change in (dict(dropout_p=0.1), dict(window_size=(8, 0)), dict(softcap=5.0), dict(deterministic=True),
                       dict(return_probs=True), dict(alibi=torch.empty(8, device="cuda"))):
            assert not op._ws_under_compile(q, k, k, **{**base, **change}), change
        q96 = torch.empty(2, 64, 8, 96, dtype=torch.bfloat16, device="cuda")  # no Gluon tile for d96
        assert not op._ws_under_compile(q96, q96, q96, **base)
    assert not op._ws_under_compile(*_qkv(grad=False)[:3], **base)  # CPU tensors


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_model_takes_the_opaque_ops(causal, monkeypatch):
    """With the switch on (and the eligibility forced, which needs a Hopper GPU), a model compiled by Inductor
    (fullgraph) runs its attention through the eager plans: outputs and gradients equal eager mode."""
    monkeypatch.setitem(launch_ws.WS_TUNING, "compile", True)
    monkeypatch.setattr(op, "_ws_under_compile", lambda *a: True)
    calls = []
    plan_of = op._ws_plan
    monkeypatch.setattr(op, "_ws_plan", lambda *a: calls.append(a[3:]) or plan_of(*a))
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))

    def fn(q, k, v):
        return flash_attn_func(q @ w, k, v, causal=causal).square().sum()

    q, k, v = _qkv()
    torch._dynamo.reset()
    loss = torch.compile(fn, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    assert len(calls) >= 2  # the forward and the backward op
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    ref_loss = fn(q2, k2, v2)
    ref = torch.autograd.grad(ref_loss, (q2, k2, v2))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_compiled_attention_runs_the_gluon_kernels(causal, monkeypatch):
    """On a Hopper GPU with the switch on: a compiled call's plan holds the Gluon forward, and outputs and
    gradients match eager mode (which runs the same kernels)."""
    if not torch.cuda.is_available() or not op.nvidia_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper-class NVIDIA GPUs")
    monkeypatch.setitem(launch_ws.WS_TUNING, "compile", True)
    plans = []
    plan_of = op._ws_plan
    monkeypatch.setattr(op, "_ws_plan", lambda *a: plans.append(plan_of(*a)) or plans[-1])
    q, k, v = (t.detach().cuda().to(torch.bfloat16).requires_grad_()
               for t in _qkv(B=2, sq=1000, sk=1000, h=8, hk=2, d=128))

    def fn(q, k, v):
        return flash_attn_func(q, k, v, causal=causal)

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True)(q, k, v)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert plans and all(p.ws is not None for p in plans)
    ref = fn(q, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, b in zip(got, torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)  # the Gluon backward adds dQ in any order
