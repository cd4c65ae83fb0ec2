"""Scaled masked softmax on a real GPU at real sizes (run by ``scripts/gpu-check``).

Same tolerance rule as ``test_softmax.py`` (float64 oracle on the GPU vs PyTorch's error in the
input dtype), forward and backward. Covers Megatron's shapes (padding and causal, sk 2048 / 4096),
rows past Apex's 16384 limit (the chunked kernels, causal too), odd sizes and dtypes, fully masked
rows, int64 indexing past 2^31 elements, the Apex module, and ``torch.compile`` with inductor.
"""

from __future__ import annotations

import pytest
import torch

from culmen.ops.softmax import scaled_masked_softmax, scaled_masked_softmax_ref
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn
from culmen.transformer import AttnMaskType
from culmen.transformer.functional import FusedScaleMaskSoftmax

pytestmark = pytest.mark.gpu

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DEV = torch.device("cuda")


def _mask(kind: str, B: int, SQ: int, SK: int):
    if kind == "b1qk":
        return torch.rand(B, 1, SQ, SK, device=DEV) < 0.25
    if kind == "b11k":
        lens = torch.randint(1, SK + 1, (B,), device=DEV)
        return (torch.arange(SK, device=DEV)[None] >= lens[:, None]).view(B, 1, 1, SK)
    return None


@pytest.mark.parametrize("shape,dtype,mask_kind,causal", [
    ((4, 16, 2048, 2048), BF16, "b1qk", False),
    ((4, 16, 2048, 2048), BF16, "", True),
    ((2, 8, 1024, 4096), F16, "b11k", False),
    ((1, 8, 4096, 4096), BF16, "", True),
], ids=["pad2048", "causal2048", "keypad4096-f16", "causal4096"])
def test_megatron_shapes(shape, dtype, mask_kind, causal):
    x_grad_check(shape, dtype, mask_kind, causal)


def x_grad_check(shape, dtype, mask_kind, causal, **kw):
    B, NP, SQ, SK = shape
    x = randn(shape, dtype, DEV, scale=4.0)
    if kw.get("noncontig"):
        x = make_noncontiguous(x, pad=5)
    mask = _mask(mask_kind, B, SQ, SK)
    scale = kw.get("scale", 0.125)
    xg = x.detach().clone().requires_grad_()
    y = scaled_masked_softmax(xg, mask, scale, causal)
    g = randn(shape, dtype, DEV)
    y.backward(g)
    hi, lo = x.detach().to(F64).requires_grad_(), x.detach().clone().requires_grad_()
    y_hi = scaled_masked_softmax_ref(hi, mask, scale, causal)
    y_lo = scaled_masked_softmax_ref(lo, mask, scale, causal)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    (d_hi,) = torch.autograd.grad(y_hi, hi, g.to(F64))
    (d_lo,) = torch.autograd.grad(y_lo, lo, g)
    assert_close_tolerance(xg.grad, d_hi, d_lo, name="dx")
    if causal:
        assert not bool(y.triu(1).any())
    return y


@pytest.mark.parametrize("shape,mask_kind,causal", [
    ((1, 4, 64, 32768), "b11k", False),
    ((1, 2, 16, 65536), "b1qk", False),
    ((1, 1, 17000, 17000), "", True),
], ids=["keypad32k", "pad64k", "causal17k"])
def test_long_rows_chunked(shape, mask_kind, causal):
    x_grad_check(shape, BF16, mask_kind, causal)


@pytest.mark.parametrize("sk", [1, 7, 1000, 4097, 16385])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_odd_sizes(sk, dtype):
    x_grad_check((3, 5, 7, sk), dtype, "b1qk", False, noncontig=True, scale=0.7)


def test_fully_masked_rows_are_zero():
    B, NP, SQ, SK = 2, 4, 128, 20000
    mask = torch.rand(B, 1, SQ, SK, device=DEV) < 0.5
    mask[:, :, ::7] = True
    x = randn((B, NP, SQ, SK), BF16, DEV)
    y = scaled_masked_softmax(x, mask, 0.3)
    assert not bool(y[:, :, ::7].any())
    rows = y.float().sum(-1)
    keep = torch.ones(SQ, dtype=torch.bool, device=DEV)
    keep[::7] = False
    torch.testing.assert_close(rows[:, :, keep], torch.ones_like(rows[:, :, keep]), rtol=0, atol=2e-2)


def test_int64_indexing_past_2_31_elements():
    x = randn((1, 1, 65536, 32769), BF16, DEV)  # 2.15e9 elements
    y = scaled_masked_softmax(x, None, 0.5)
    tail = x[:, :, -16:]
    assert_close_tolerance(y[:, :, -16:], scaled_masked_softmax_ref(tail.to(F64), None, 0.5),
                           scaled_masked_softmax_ref(tail, None, 0.5), name="tail")


@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.causal])
def test_apex_module_at_megatron_size(kind):
    b, np_, s = 4, 16, 2048
    sm = FusedScaleMaskSoftmax(False, True, kind, True, lambda t, m: t.masked_fill(m, -10000.0), True, 0.125)
    x = randn((b, np_, s, s), BF16, DEV, scale=4.0)
    mask = (torch.rand(b, 1, s, s, device=DEV) < 0.2) if kind == AttnMaskType.padding else \
        torch.ones(s, s, dtype=torch.bool, device=DEV).triu(1)[None, None]
    y = sm(x, mask)
    torch_path = sm.forward_torch_softmax(x, mask)
    ref = scaled_masked_softmax_ref(x.to(F64), mask, 0.125)
    assert_close_tolerance(y, ref, torch_path, name=str(kind))


def test_torch_compile_inductor():
    mask = torch.rand(2, 1, 512, 1024, device=DEV) < 0.2

    def fn(x):
        return scaled_masked_softmax(x * 1.5, mask, 0.25) * 2.0

    x = randn((2, 8, 512, 1024), BF16, DEV, requires_grad=True)
    torch._dynamo.reset()
    comp = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(comp(x), fn(x), rtol=0, atol=1e-2)
    ga = torch.autograd.grad(fn(x).float().sum(), x)[0]
    gb = torch.autograd.grad(comp(x).float().sum(), x)[0]
    torch.testing.assert_close(gb, ga, rtol=0, atol=1e-2)
