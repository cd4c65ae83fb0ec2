"""Apex's fused RoPE reproduces Apex's numerics in fp16/bf16, not only a tolerance around float64.

Apex's CUDA kernels (and the unfused PyTorch formula Apex tests them against) round cos/sin to the
input dtype, then round each product and the sum to it. culmen's Apex functions run the rotary op with
``round_ops``, which does the same, so on CPU (the reference path and the Triton kernel under the
interpreter, both using the same ``torch.cos`` tables) the output and the gradient equal the formula
bit for bit. On the GPU ``cos``/``sin`` may differ from PyTorch's by an fp32 ulp, which can flip a
rare rounding: there the check is Apex's own test tolerance for the dtype.

The formula is written here from its definition: ``t[..., :d2] * cos(f).to(dtype) +
rotate_half(t[..., :d2]) * sin(f).to(dtype)``, the other columns unchanged.
"""

from __future__ import annotations

import pytest
import torch

from culmen.transformer.functional import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_cached,
    fused_apply_rotary_pos_emb_thd,
)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# Apex's tests compare with torch.testing's default tolerances of the dtype.
APEX_TOL = {BF16: dict(rtol=1.6e-2, atol=1e-5), F16: dict(rtol=1e-3, atol=1e-5), F32: dict(rtol=1.3e-6, atol=1e-5)}


def _half_turn(x):
    lo, hi = x.chunk(2, dim=-1)
    return torch.cat((-hi, lo), dim=-1)


def formula(t, cos, sin):
    """Apex's unfused RoPE in ``t``'s dtype: ``cos``/``sin`` broadcast against ``t[..., :d2]``."""
    d2 = cos.shape[-1]
    c, s = cos.to(t.dtype), sin.to(t.dtype)
    head = t[..., :d2]
    return torch.cat((head * c + _half_turn(head) * s, t[..., d2:]), dim=-1)


def formula_thd(t, cu, freqs):
    pieces = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        f = freqs[: b - a]
        pieces.append(formula(t[a:b].unsqueeze(1), f.cos(), f.sin()).squeeze(1))
    return torch.cat(pieces)


def formula_2d(t, ih, iw, cos_h, sin_h, cos_w, sin_w):
    b, _, h, d = t.shape
    q = t.view(b, ih, iw, h, d)
    q1, q2 = q.chunk(2, dim=-1)
    q1 = formula(q1, cos_h[:, :ih].unsqueeze(2), sin_h[:, :ih].unsqueeze(2))
    q2 = formula(q2, cos_w[:, :iw].unsqueeze(1), sin_w[:, :iw].unsqueeze(1))
    return torch.cat((q1, q2), dim=-1).view(b, ih * iw, h, d)


def _leaf(shape, dtype, device, transpose=None):
    """``rand`` like Apex's tests (positive values), optionally with a permuted memory layout."""
    t = torch.rand(shape, dtype=F32, device=device).to(dtype)
    if transpose is not None:
        t = t.transpose(*transpose).contiguous().transpose(*transpose)
    return t.requires_grad_()


def _compare(fused, unfused, t, exact: bool):
    """Output and gradient (of a non-uniform upstream gradient) of ``fused(t)`` against ``unfused(t)``."""
    y = fused(t)
    g = torch.randn(y.shape, device=t.device).to(t.dtype)
    (dy,) = torch.autograd.grad(y, t, g)
    y_ref = unfused(t)
    (dy_ref,) = torch.autograd.grad(y_ref, t, g)
    tol = APEX_TOL[t.dtype]
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dy, dy_ref, **tol)
    if exact:
        assert torch.equal(y, y_ref), f"{(y != y_ref).float().mean().item():.2%} of the outputs differ"
        assert torch.equal(dy, dy_ref), f"{(dy != dy_ref).float().mean().item():.2%} of the gradients differ"
    return y


def _run_sbhd(dtype, device, exact, transpose, d2_frac, cached, out_t, size=(37, 2, 3, 32), scale=8.0):
    s, b, h, d = size
    d2 = int(d * d2_frac)
    t = _leaf((s, b, h, d), dtype, device, transpose)
    freqs = torch.rand(s, 1, 1, d2, device=device) * scale  # up to 8 rad: every sign of cos/sin
    if cached:
        fused = lambda x: fused_apply_rotary_pos_emb_cached(x, freqs.cos(), freqs.sin(), out_t)  # noqa: E731
    else:
        fused = lambda x: fused_apply_rotary_pos_emb(x, freqs, out_t)  # noqa: E731
    y = _compare(fused, lambda x: formula(x, freqs.cos(), freqs.sin()), t, exact)
    assert y.transpose(0, 1).is_contiguous() is out_t


def _run_thd(dtype, device, exact, transpose):
    cu = torch.tensor([0, 11, 12, 30, 37], dtype=torch.int32, device=device)
    h, d, d2 = 3, 16, 16
    t = _leaf((37, h, d), dtype, device, transpose)
    freqs = torch.rand(18, 1, 1, d2, device=device) * 8
    _compare(lambda x: fused_apply_rotary_pos_emb_thd(x, cu, freqs), lambda x: formula_thd(x, cu, freqs), t, exact)


def _run_2d(dtype, device, exact, transpose, margin):
    b, ih, iw, h, d = 2, 3, 5, 2, 16
    t = _leaf((b, ih * iw, h, d), dtype, device, transpose)
    ah = torch.rand(1, ih + margin, 1, d // 2, device=device) * 8
    aw = torch.rand(1, iw + margin, 1, d // 2, device=device) * 8
    # Tables in t's dtype, as Apex's test builds them.
    tabs = (ah.cos().to(dtype), ah.sin().to(dtype), aw.cos().to(dtype), aw.sin().to(dtype))
    _compare(lambda x: fused_apply_rotary_pos_emb_2d(x, ih, iw, *tabs), lambda x: formula_2d(x, ih, iw, *tabs), t,
             exact)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize(("transpose", "d2_frac", "cached", "out_t"), [
    (None, 1.0, False, False),
    ((0, 1), 0.5, False, True),
    ((2, 3), 1.0, True, False),
    (None, 0.5, True, True),
])
def test_sbhd_matches_apex_formula(backend, dtype, transpose, d2_frac, cached, out_t, request):
    request.getfixturevalue(f"{backend}_backend")
    _run_sbhd(dtype, "cpu", True, transpose, d2_frac, cached, out_t)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_thd_and_2d_match_apex_formula(backend, dtype, request):
    request.getfixturevalue(f"{backend}_backend")
    _run_thd(dtype, "cpu", True, (1, 2))
    _run_2d(dtype, "cpu", True, (2, 3), 2)


def test_fp32_math_elsewhere():
    """The rounding is Apex's only: the op's default (flash_attn's numerics) keeps fp32 math, and fp32
    inputs of the Apex functions match the formula to fp32 rounding."""
    from culmen.ops.rotary import rotary

    x = torch.rand(1, 9, 2, 16).to(BF16)
    ang = torch.rand(9, 8) * 8
    y = rotary(x, ang.cos(), ang.sin())
    ref = formula(x.double(), ang.cos().double().repeat(1, 2)[:, None], ang.sin().double().repeat(1, 2)[:, None])
    assert torch.equal(y, ref.to(BF16))  # one rounding of the exact result
    _run_sbhd(F32, "cpu", False, None, 1.0, False, False)


def test_compiled_matches_eager():
    """The traced path (``culmen::rotary`` with ``round_ops``) computes what the eager one does. (With
    Inductor on CPU the graph holds the reference's casts, which Inductor fuses away, as it does for the
    plain formula; on a GPU the kernel is opaque to it: see the GPU test below.)"""
    t = torch.rand(9, 2, 2, 16).to(BF16)
    freqs = torch.rand(9, 1, 1, 16) * 8
    compiled = torch.compile(fused_apply_rotary_pos_emb, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(t, freqs), formula(t, freqs.cos(), freqs.sin()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize(("transpose", "cached", "out_t"), [(None, False, False), ((0, 1), True, True),
                                                            ((2, 3), False, True)])
def test_gpu_matches_apex_formula(dtype, transpose, cached, out_t):
    """The CUDA kernel against the formula at one of Apex's test shapes (angles in [0, 1), as there),
    with Apex's tolerance; packed and 2-D forms too."""
    _run_sbhd(dtype, "cuda", False, transpose, 0.5, cached, out_t, size=(512, 2, 16, 128), scale=1.0)
    _run_thd(dtype, "cuda", False, None)
    _run_2d(dtype, "cuda", False, transpose, 3)


@pytest.mark.gpu
def test_gpu_inductor_keeps_apex_numerics():
    """Under Inductor the kernel is launched as is (``wrap_triton``), so the rounding survives: compiled and
    eager outputs and gradients are equal bit for bit."""
    t = _leaf((256, 2, 8, 64), BF16, "cuda")
    freqs = torch.rand(256, 1, 1, 64, device="cuda") * 8
    compiled = torch.compile(fused_apply_rotary_pos_emb, fullgraph=True)
    g = torch.randn(t.shape, device="cuda").to(BF16)
    y = compiled(t, freqs)
    (dy,) = torch.autograd.grad(y, t, g)
    y_eager = fused_apply_rotary_pos_emb(t, freqs)
    (dy_eager,) = torch.autograd.grad(y_eager, t, g)
    assert torch.equal(y, y_eager) and torch.equal(dy, dy_eager)
