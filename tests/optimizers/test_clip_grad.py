"""culmen.contrib.clip_grad.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch

from culmen.contrib.clip_grad import clip_grad_norm_

SHAPES = ((63,), (5, 123), (2049,), (1,))


def _pair(lockstep, dtypes=None):
    a = lockstep.params(SHAPES, dtypes=dtypes)
    b = lockstep.copies(a, torch.float64)
    gs = lockstep.grads(a, scale=3.0)
    lockstep.set_grads(a, gs)
    for q, g in zip(b, gs):
        q.grad = g.double()
    return a, b


@pytest.mark.parametrize("norm_type, max_norm", [(2.0, 1.0), (2.0, 1e6), (math.inf, 0.5), (1.0, 2.0), (3.0, 1.0)])
def test_matches_torch(backend, lockstep, norm_type, max_norm):
    a, b = _pair(lockstep)
    got = clip_grad_norm_(a, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(b, max_norm, norm_type)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    lockstep.assert_close([p.grad for p in a], [q.grad for q in b], rtol=1e-5, atol=1e-7, what="grad")


def test_mixed_dtypes_and_frozen(backend, lockstep):
    """fp32 / bf16 / fp16 grads in one call (norm in fp32), a param without grad, a single tensor argument."""
    a, b = _pair(lockstep, dtypes=[torch.float32, torch.bfloat16, torch.float16, torch.float32])
    a.append(torch.randn(5, requires_grad=True))  # no gradient: ignored
    got = clip_grad_norm_(a, 0.5)
    want = torch.nn.utils.clip_grad_norm_(b, 0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad.double(), q.grad.to(p.dtype).double(), rtol=1e-2, atol=1e-3)
    p = torch.randn(10, requires_grad=True)
    p.grad = torch.full((10,), 2.0)
    n = clip_grad_norm_(p, 1.0, foreach=False)
    assert abs(float(n) - math.sqrt(40.0)) < 1e-5
    assert abs(float(p.grad.norm()) - 1.0) < 1e-5


def test_nonfinite_and_empty(lockstep):
    a, _ = _pair(lockstep)
    a[1].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(a, 1.0, error_if_nonfinite=True)
    n = clip_grad_norm_(a, 1.0)  # scales by the NaN norm, as torch does
    assert math.isnan(float(n))
    assert float(clip_grad_norm_([torch.randn(3, requires_grad=True)], 1.0)) == 0.0
    p = torch.randn(4, 4, requires_grad=True)
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        clip_grad_norm_([p], 1.0)
