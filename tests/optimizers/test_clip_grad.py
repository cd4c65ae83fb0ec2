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


# ------------------------------------------------------------------------ every dtype, every order

NORM_TYPES = (2.0, 1.0, math.inf, -math.inf, 3.0, 0.5, 0.0)


def _twins(dtypes, device="cpu", scale=3.0, seed=0):
    """Params with gradients of ``dtypes`` and identical copies (same dtypes) for torch."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [SHAPES[i % len(SHAPES)] for i in range(len(dtypes))]
    a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dt)) for s, dt in zip(shapes, dtypes)]
    for p in a:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(device=device, dtype=p.dtype)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        q.grad = p.grad.clone()
    return a, b


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, False])
def test_fp64_matches_torch_to_the_last_bits(backend, norm_type, foreach):
    """float64 gradients keep float64 math: the norm and the clipped gradients are torch's (rtol 1e-15)."""
    a, b = _twins([torch.float64] * 5)
    got = clip_grad_norm_(a, 0.5, norm_type, foreach=foreach)
    want = torch.nn.utils.clip_grad_norm_(b, 0.5, norm_type, foreach=foreach)
    assert got.dtype == torch.float64 and got.shape == ()
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-15, atol=0)
        assert torch.equal(p, q)  # params untouched


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_fp32_matches_torch(backend, norm_type):
    a, b = _twins([torch.float32] * 5)
    got = clip_grad_norm_(a, 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(b, 0.5, norm_type)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("dtypes", [
    [torch.float16] * 3,
    [torch.bfloat16] * 3,
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float64],
], ids=["fp16", "bf16", "mixed"])
def test_16bit_and_mixed_lists(backend, norm_type, dtypes):
    """The norm is accumulated in fp32 (fp64 when a gradient is fp64) and matches a float64 oracle; the
    clipped gradients are torch's within the rounding of their dtype (torch rounds 16-bit norms)."""
    a, b = _twins(dtypes)
    oracle = [q.grad.double().clone() for q in b]  # (clone: .double() of an fp64 grad is the grad itself)
    want64 = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in oracle]), norm_type)
    got = clip_grad_norm_(a, 0.5, norm_type)
    torch.nn.utils.clip_grad_norm_(b, 0.5, norm_type)
    assert got.dtype == (torch.float64 if torch.float64 in dtypes else torch.float32)
    torch.testing.assert_close(got.double(), want64, rtol=1e-6 if torch.float64 in dtypes else 2e-6, atol=0)
    coef = min(1.0, 0.5 / (float(want64) + 1e-6))
    ulps = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
    # torch rounds each 16-bit group's norm to that dtype before combining: its clip coefficient is off by
    # up to the coarsest such rounding, ours by fp32 noise only
    coarse = max(ulps.get(dt, 1e-6) for dt in dtypes)
    for p, q, g in zip(a, b, oracle):
        ulp = ulps.get(p.dtype, 1e-6)
        tiny = 2.0 ** -24 if p.dtype == torch.float16 else 1e-30  # fp16 subnormals: absolute spacing 2^-24
        torch.testing.assert_close(p.grad.double(), g * coef, rtol=ulp, atol=tiny)  # ours: one rounding
        torch.testing.assert_close(p.grad.double(), q.grad.double(), rtol=ulp + coarse, atol=tiny)  # torch's


def test_no_clip_when_below_max_and_fp16_overflow():
    """max_norm above the norm leaves the gradients bitwise unchanged; an fp16 list whose norm overflows
    fp16 (torch returns inf and zeroes every gradient) gets a finite fp32 norm and a correct clip."""
    a, _ = _twins([torch.float16] * 3)
    before = [p.grad.clone() for p in a]
    clip_grad_norm_(a, 1e9)
    assert all(torch.equal(p.grad, g) for p, g in zip(a, before))
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float16))
    p.grad = torch.full((4096,), 60000.0, dtype=torch.float16)
    n = clip_grad_norm_([p], 1.0)
    assert math.isfinite(float(n)) and abs(float(n) - 60000.0 * 64) / (60000.0 * 64) < 1e-5
    assert abs(float(p.grad.double().norm()) - 1.0) < 1e-2


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_error_if_nonfinite(backend, bad, dtype):
    for norm_type in (2.0, 1.0, math.inf):
        a, b = _twins([dtype] * 3)
        a[1].grad.view(-1)[-1] = bad
        b[1].grad.view(-1)[-1] = bad
        with pytest.raises(RuntimeError, match="non-finite"):
            clip_grad_norm_(a, 1.0, norm_type, error_if_nonfinite=True)
        with pytest.raises(RuntimeError):
            torch.nn.utils.clip_grad_norm_(b, 1.0, norm_type, error_if_nonfinite=True)
        n = clip_grad_norm_(a, 1.0, norm_type)  # scales by the non-finite norm, as torch does
        assert not math.isfinite(float(n))


def test_foreach_argument_and_generators(backend):
    """``foreach`` True/False/None give the same numbers; a generator of params and a single tensor work."""
    outs = []
    for foreach in (None, True, False):
        a, _ = _twins([torch.float32, torch.float64, torch.bfloat16])
        n = clip_grad_norm_((p for p in a), 0.5, foreach=foreach)
        outs.append((n, [p.grad for p in a]))
    for n, gs in outs[1:]:
        torch.testing.assert_close(n, outs[0][0], rtol=1e-6, atol=0)
        for g, h in zip(gs, outs[0][1]):
            torch.testing.assert_close(g, h, rtol=1e-6 if g.dtype != torch.bfloat16 else 2 ** -7, atol=1e-30)


def test_empty_and_bad_arguments():
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    n = clip_grad_norm_([p], 1.0)  # no gradient: 0 on the params' device
    assert float(n) == 0.0 and n.device == p.device
    assert float(clip_grad_norm_([], 1.0)) == 0.0
    p.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(TypeError, match="max_norm"):
        clip_grad_norm_([p], "big")
    with pytest.raises(TypeError, match="norm_type"):
        clip_grad_norm_([p], 1.0, norm_type="fro")


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["cuda", "cpu"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_mixed_devices_and_dtypes_gpu(norm_type, first):
    """Gradients on CUDA and CPU, fp32/fp16/fp64 in one call (Apex's clip_grad test): torch's numbers. With
    the first gradient on the CPU the total norm is reduced there: the CUDA norms must have landed."""
    a, b = [], []
    for i, (dev, dt) in enumerate([(first, torch.float32), ("cpu", torch.float64), ("cuda", torch.float16),
                                   ("cuda", torch.float64), ("cpu", torch.float32), ("cuda", torch.float32)]):
        x, y = _twins([dt], device=dev, seed=i)
        a += x
        b += y
    got = clip_grad_norm_(a, 0.54321, norm_type)
    want = torch.nn.utils.clip_grad_norm_(b, 0.54321, norm_type)
    assert got.device == a[0].grad.device and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-20)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-20)
    for dt, rtol in ((torch.float64, 1e-15), (torch.float32, 1e-6)):
        x, y = _twins([dt] * 6, device="cuda", seed=7)
        torch.testing.assert_close(clip_grad_norm_(x, 0.54321, norm_type),
                                   torch.nn.utils.clip_grad_norm_(y, 0.54321, norm_type), rtol=rtol, atol=1e-20)
        for p, q in zip(x, y):
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=1e-20)
