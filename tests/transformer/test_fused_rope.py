"""Apex's fused RoPE API (``culmen.transformer.functional``) and its extension module.

The oracle is Apex's formula written out: with per-column angles ``f`` (``[s, 1, 1, d2]``), the first
``d2`` columns become ``t * cos(f) + rotate_half(t) * sin(f)`` and the rest pass through. Checked
with the tolerance rule for the output and the gradient of ``t``.
"""

from __future__ import annotations

import pytest
import torch

from culmen.testing import assert_close_tolerance, randn
from culmen.transformer.functional import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_cached,
    fused_apply_rotary_pos_emb_thd,
)
from culmen.transformer.functional._ext import fused_rotary_positional_embedding as rope_ext

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


def _rot_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apex_oracle(t, cos, sin):
    """``t`` ``[..., d]`` with ``cos``/``sin`` broadcastable to ``t[..., :d2]``; math in t's dtype."""
    d2 = cos.shape[-1]
    c, s = cos.to(t.dtype), sin.to(t.dtype)
    return torch.cat((t[..., :d2] * c + _rot_half(t[..., :d2]) * s, t[..., d2:]), dim=-1)


def _check(fn, t, oracle, name):
    tg = t.detach().clone().requires_grad_()
    y = fn(tg)
    g = randn(y.shape, t.dtype)
    y.backward(g)
    hi, lo = t.detach().to(F64).requires_grad_(), t.detach().clone().requires_grad_()
    y_hi, y_lo = oracle(hi), oracle(lo)
    assert_close_tolerance(y, y_hi, y_lo, name=f"{name} y")
    (d_hi,) = torch.autograd.grad(y_hi, hi, g.to(F64))
    (d_lo,) = torch.autograd.grad(y_lo, lo, g)
    assert_close_tolerance(tg.grad, d_hi, d_lo, name=f"{name} dt")
    return y


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("transpose", [False, True])
def test_sbhd_freqs(backend, transpose, request):
    request.getfixturevalue(f"{backend}_backend")
    s, b, h, d, d2 = 7, 2, 3, 16, 12
    freqs = torch.rand(s, 1, 1, d2) * 20  # independent angles per column, as Apex allows
    t = randn((s, b, h, d), BF16)
    y = _check(lambda x: fused_apply_rotary_pos_emb(x, freqs, transpose), t,
               lambda x: _apex_oracle(x, freqs.to(F64).cos(), freqs.to(F64).sin()), "sbhd")
    assert y.shape == t.shape
    assert (y.transpose(0, 1) if transpose else y).is_contiguous()
    # cos/sin of the last freqs are reused; an in-place update of freqs must be seen.
    freqs.mul_(0.5)
    y2 = fused_apply_rotary_pos_emb(t, freqs, transpose)
    assert_close_tolerance(y2, _apex_oracle(t.to(F64), freqs.to(F64).cos(), freqs.to(F64).sin()),
                           _apex_oracle(t, freqs.to(F64).cos(), freqs.to(F64).sin()), name="sbhd after freqs update")
    assert (y.transpose(0, 1) if transpose else y).is_contiguous()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cached_and_extension(backend, request):
    request.getfixturevalue(f"{backend}_backend")
    s, b, h, d, d2 = 6, 3, 2, 10, 10
    ang = torch.rand(s, 1, 1, d2, dtype=F64) * 6
    cos_, sin_ = ang.cos().to(BF16), ang.sin().to(BF16)  # tables in t's dtype (Apex allows fp32 or t's)
    t = randn((s, b, h, d), BF16)
    y = _check(lambda x: fused_apply_rotary_pos_emb_cached(x, cos_, sin_), t,
               lambda x: _apex_oracle(x, cos_.to(F64), sin_.to(F64)), "cached")
    # The extension module computes the same, and its backward is the autograd gradient.
    assert torch.equal(rope_ext.forward_cached(t, cos_, sin_, False), y)
    freqs = ang.float()
    yf = fused_apply_rotary_pos_emb(t.requires_grad_(), freqs, True)
    g = randn(yf.shape, BF16)
    (dt,) = torch.autograd.grad(yf, t, g)
    assert torch.equal(rope_ext.forward(t.detach(), freqs, True), yf.detach())
    assert torch.equal(rope_ext.backward(g, freqs, True), dt)
    assert torch.equal(rope_ext.backward_cached(g, cos_, sin_, False),
                       torch.autograd.grad(fused_apply_rotary_pos_emb_cached(t, cos_, sin_), t, g)[0])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_thd(backend, request):
    request.getfixturevalue(f"{backend}_backend")
    lens = [3, 5, 1, 4]
    cu = torch.tensor([0, 3, 8, 9, 13], dtype=torch.int32)
    h, d, d2 = 2, 12, 8
    freqs = torch.rand(max(lens), 1, 1, d2) * 10
    t = randn((13, h, d))
    pos = torch.cat([torch.arange(n) for n in lens])
    f = freqs.reshape(-1, d2).to(F64)[pos][:, None, :]
    _check(lambda x: fused_apply_rotary_pos_emb_thd(x, cu, freqs), t, lambda x: _apex_oracle(x, f.cos(), f.sin()),
           "thd")
    assert torch.equal(rope_ext.forward_thd(t, cu, freqs), fused_apply_rotary_pos_emb_thd(t, cu, freqs))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_2d(backend, request):
    request.getfixturevalue(f"{backend}_backend")
    b, ih, iw, h, d = 2, 3, 4, 2, 16
    ah, aw = torch.rand(1, ih + 2, 1, d // 2, dtype=F64) * 6, torch.rand(1, iw + 1, 1, d // 2, dtype=F64) * 6
    cos_h, sin_h, cos_w, sin_w = ah.cos().float(), ah.sin().float(), aw.cos().float(), aw.sin().float()
    t = randn((b, ih * iw, h, d))
    rows, cols = torch.arange(ih * iw) // iw, torch.arange(ih * iw) % iw

    def oracle(x):
        a = _apex_oracle(x[..., :d // 2], cos_h.to(F64)[0, rows], sin_h.to(F64)[0, rows])
        c = _apex_oracle(x[..., d // 2:], cos_w.to(F64)[0, cols], sin_w.to(F64)[0, cols])
        return torch.cat((a, c), -1)

    y = _check(lambda x: fused_apply_rotary_pos_emb_2d(x, ih, iw, cos_h, sin_h, cos_w, sin_w), t, oracle, "2d")
    t5 = t.view(b, ih, iw, h, d)
    assert torch.equal(rope_ext.forward_2d(t5, cos_h, sin_h, cos_w, sin_w), y)


def test_bad_input():
    t = randn((4, 2, 3, 8))
    with pytest.raises(ValueError, match="sequence length 4"):
        fused_apply_rotary_pos_emb(t, torch.rand(5, 1, 1, 8))
    with pytest.raises(ValueError, match=r"\(s, 1, 1, d2\)"):
        fused_apply_rotary_pos_emb(t, torch.rand(4, 8))
    with pytest.raises(ValueError, match="must be even and <= t.size"):
        fused_apply_rotary_pos_emb(t, torch.rand(4, 1, 1, 10))
    with pytest.raises(ValueError, match="must be even"):
        fused_apply_rotary_pos_emb(t, torch.rand(4, 1, 1, 5))
    with pytest.raises(TypeError, match="floating-point"):
        fused_apply_rotary_pos_emb(t, torch.ones(4, 1, 1, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="same shape"):
        fused_apply_rotary_pos_emb_cached(t, torch.rand(4, 1, 1, 8), torch.rand(4, 1, 1, 6))
    with pytest.raises(ValueError, match="img_h \\* img_w"):
        fused_apply_rotary_pos_emb_2d(t, 2, 3, *[torch.rand(1, 4, 1, 4)] * 4)
    with pytest.raises(ValueError, match="divisible by 4"):
        fused_apply_rotary_pos_emb_2d(randn((1, 6, 2, 6)), 2, 3, *[torch.rand(1, 4, 1, 3)] * 4)
    with pytest.raises(ValueError, match="fewer than the image's 3"):
        fused_apply_rotary_pos_emb_2d(randn((1, 6, 2, 8)), 2, 3, *[torch.rand(1, 2, 1, 4)] * 4)
    with pytest.raises(ValueError, match="3-D"):
        fused_apply_rotary_pos_emb_thd(t, torch.tensor([0, 4], dtype=torch.int32), torch.rand(4, 1, 1, 8))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_autograd_classes_match_the_functions(backend, request):
    """Apex's ``FusedRoPEFunc`` / ``FusedRoPECachedFunc`` / ``FusedRoPETHDFunc`` / ``FusedRoPE2DFunc``
    (``apply`` with Apex's arguments): bit-identical outputs and input gradients to the functions."""
    from culmen.transformer.functional.fused_rope import (
        FusedRoPE2DFunc,
        FusedRoPECachedFunc,
        FusedRoPEFunc,
        FusedRoPETHDFunc,
    )

    request.getfixturevalue(f"{backend}_backend")
    s, b, h, d = 5, 2, 3, 8
    freqs = torch.rand(s, 1, 1, 6) * 10
    ang = torch.rand(s, 1, 1, d) * 6
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    ih, iw = 2, 3
    ah, aw = torch.rand(1, ih, 1, d // 2) * 6, torch.rand(1, iw, 1, d // 2) * 6
    cases = [
        ((s, b, h, d), lambda x: FusedRoPEFunc.apply(x, freqs, True),
         lambda x: fused_apply_rotary_pos_emb(x, freqs, True)),
        ((s, b, h, d), lambda x: FusedRoPECachedFunc.apply(x, ang.cos(), ang.sin()),
         lambda x: fused_apply_rotary_pos_emb_cached(x, ang.cos(), ang.sin())),
        ((5, h, d), lambda x: FusedRoPETHDFunc.apply(x, cu, freqs),
         lambda x: fused_apply_rotary_pos_emb_thd(x, cu, freqs)),
        ((b, ih * iw, h, d), lambda x: FusedRoPE2DFunc.apply(x, ih, iw, ah.cos(), ah.sin(), aw.cos(), aw.sin()),
         lambda x: fused_apply_rotary_pos_emb_2d(x, ih, iw, ah.cos(), ah.sin(), aw.cos(), aw.sin())),
    ]
    for shape, cls_call, fn_call in cases:
        t = randn(shape, BF16)
        a, c = t.clone().requires_grad_(), t.clone().requires_grad_()
        ya, yc = cls_call(a), fn_call(c)
        assert torch.equal(ya, yc)
        g = randn(ya.shape, BF16)
        ya.backward(g)
        yc.backward(g)
        assert torch.equal(a.grad, c.grad)
