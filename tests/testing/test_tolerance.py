"""culmen.testing: the tolerance rule, NaN handling, poison and the adversarial-input helpers."""

import math

import pytest
import torch

from culmen.testing import (
    assert_close_tolerance,
    default_atol,
    make_noncontiguous,
    make_strided_lastdim,
    odd_shapes,
    poison_,
    randn,
)


def _ln_refs(x):
    """A LayerNorm computed in float64 (ref_hi) and by PyTorch in bf16 (ref_lo)."""
    hi = torch.nn.functional.layer_norm(x.double(), x.shape[-1:])
    lo = torch.nn.functional.layer_norm(x, x.shape[-1:])
    return hi, lo


def test_passes_within_factor_of_baseline():
    x = randn((8, 300), torch.bfloat16)
    hi, lo = _ln_refs(x)
    res = assert_close_tolerance(lo, hi, lo, name="y")  # PyTorch itself is within 1x of itself
    assert res.err == pytest.approx(res.baseline)
    assert res.allowed == pytest.approx(2 * res.baseline + default_atol(torch.bfloat16) * hi.abs().max().item())
    # An fp32 computation of the same thing is far better than the bf16 baseline.
    assert_close_tolerance(torch.nn.functional.layer_norm(x.float(), x.shape[-1:]), hi, lo, name="y")


def test_fails_beyond_factor_and_names_the_tensor_and_index():
    hi = torch.zeros(4, 5, dtype=torch.float64) + 1.0
    lo = hi + 0.01  # baseline error 0.01
    actual = hi.clone().float()
    actual[2, 3] += 0.05  # 5x the baseline
    with pytest.raises(AssertionError) as exc:
        assert_close_tolerance(actual, hi, lo, name="dweight", atol=0.0)
    msg = str(exc.value)
    assert "dweight" in msg and "(2, 3)" in msg and "0.05" in msg and "0.01" in msg
    # ... and passes with a larger factor.
    assert_close_tolerance(actual, hi, lo, name="dweight", atol=0.0, factor=6.0)


def test_default_atol_by_dtype_and_scaled_by_magnitude():
    assert default_atol(torch.float64) == 1e-10
    assert default_atol(torch.float32) == 1e-5
    assert default_atol(torch.float16) == 1e-3
    assert default_atol(torch.bfloat16) == 8e-3
    hi = torch.full((3,), 100.0, dtype=torch.float64)
    actual = (hi + 5e-4).float()  # 5e-4 <= 1e-5 * 100: within rounding noise at this magnitude
    assert_close_tolerance(actual, hi, hi)
    with pytest.raises(AssertionError):
        assert_close_tolerance((hi + 5e-3).float(), hi, hi)


def test_without_ref_lo_only_atol_is_allowed():
    hi = torch.ones(3, dtype=torch.float64)
    assert_close_tolerance(hi.float() + 1e-6, hi, None)
    with pytest.raises(AssertionError):
        assert_close_tolerance(hi.float() + 1e-3, hi, None)


def test_nan_in_actual_fails():
    hi = torch.ones(2, 3, dtype=torch.float64)
    actual = hi.clone()
    actual[1, 2] = float("nan")
    with pytest.raises(AssertionError, match=r"non-finite mismatch.*\(1, 2\)"):
        assert_close_tolerance(actual, hi, hi, name="y")


def test_nan_at_the_same_place_passes():
    hi = torch.tensor([1.0, float("nan"), float("inf"), -2.0], dtype=torch.float64)
    actual = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    res = assert_close_tolerance(actual, hi, hi)
    assert res.err == 0.0


def test_nan_in_reference_only_fails_and_wrong_inf_fails():
    hi = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_close_tolerance(torch.tensor([1.0, 2.0]), hi, hi)
    hi = torch.tensor([1.0, float("inf")], dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_close_tolerance(torch.tensor([1.0, -float("inf")]), hi, hi)


def test_low_precision_overflow_does_not_make_anything_pass():
    hi = torch.tensor([1.0, 70000.0], dtype=torch.float64)
    lo = hi.half()  # 70000 overflows to inf in fp16
    assert math.isinf(lo[1].item())
    with pytest.raises(AssertionError):
        assert_close_tolerance(torch.tensor([1.0, 0.0]), hi, lo, atol=0.0)


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError, match="shape"):
        assert_close_tolerance(torch.ones(3), torch.ones(4, dtype=torch.float64), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64,
                                   torch.bool])
def test_poison(dtype):
    t = torch.zeros(5, 7, dtype=dtype)
    assert poison_(t) is t
    if dtype.is_floating_point:
        assert torch.isnan(t).all()
    elif dtype == torch.bool:
        assert t.all()
    else:
        assert (t == torch.iinfo(dtype).max).all()


def test_odd_shapes():
    shapes = odd_shapes()
    assert (3, 63) in shapes and (5, 123) in shapes and (7, 1000) in shapes and (2, 4097) in shapes
    assert all(isinstance(m, int) and isinstance(n, int) for m, n in shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_randn_fresh_nonzero(dtype):
    a, b = randn((16, 33), dtype), randn((16, 33), dtype, scale=3.0)
    assert a.dtype == dtype and a.shape == (16, 33)
    assert (a != 0).float().mean() > 0.99
    assert not torch.equal(a.float(), b.float() / 3)
    assert b.float().std() > 2.0
    assert randn(5, requires_grad=True).requires_grad


@pytest.mark.parametrize("shape", [(4, 7), (2, 3, 5), (6, 1)])
def test_make_noncontiguous_keeps_values_and_stride(shape):
    t = randn(shape)
    v = make_noncontiguous(t)
    assert torch.equal(v, t)
    assert not v.is_contiguous()
    assert v.stride(-1) == 1
    assert v.stride(-2) > shape[-1]


def test_make_noncontiguous_pads_with_poison_and_keeps_grad():
    t = randn((3, 4), requires_grad=True)
    v = make_noncontiguous(t)
    assert v.requires_grad and v.is_leaf
    (v * 2).sum().backward()
    assert torch.equal(v.grad, torch.full((3, 4), 2.0))
    row_end = v.as_strided((1,), (1,), v.storage_offset() + 4)
    assert torch.isnan(row_end).all()


@pytest.mark.parametrize("shape", [(4, 7), (9,), (2, 3, 5)])
def test_make_strided_lastdim(shape):
    t = randn(shape, torch.bfloat16)
    v = make_strided_lastdim(t)
    assert torch.equal(v, t)
    assert v.stride(-1) == 2 and not v.is_contiguous()


def test_make_noncontiguous_1d_falls_back_to_stride_2():
    v = make_noncontiguous(randn(10))
    assert v.stride(-1) == 2 and not v.is_contiguous()
