"""``flash_attn_combine`` (the Triton kernel under the interpreter and the PyTorch reference) against a float64
merge written out here, with empty (``lse = -inf``) splits holding garbage, rows with no split at all, odd
shapes, FA3's transposed lse layout, ``out=`` / ``out_dtype=``, and split-KV attention equal to no split."""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn_3 import flash_attn_combine, flash_attn_func
from culmen.testing import assert_close_tolerance


def _merge64(out_partial, lse_partial):
    """float64 merge: weights exp(lse_s - logsumexp) over the non-empty splits, explicitly per row."""
    o, lse = out_partial.double(), lse_partial.double()
    valid = lse > float("-inf")
    L = torch.logsumexp(torch.where(valid, lse, torch.full_like(lse, -1e300)), 0)
    any_valid = valid.any(0)
    L = torch.where(any_valid, L, torch.full_like(L, float("-inf")))
    w = torch.where(valid, torch.exp(lse - torch.where(any_valid, L, torch.zeros_like(L))), torch.zeros_like(lse))
    out = (w[..., None] * torch.where(valid[..., None], o, torch.zeros_like(o))).sum(0)
    return out, L


def _merge32(out_partial, lse_partial):
    """The same merge done naively in fp32 (the low-precision baseline of the tolerance rule)."""
    lse = lse_partial.float()
    w = torch.softmax(lse, 0).nan_to_num(0.0)
    o = torch.where(w[..., None] > 0, out_partial.float(), torch.zeros((), dtype=torch.float32))
    return (w[..., None] * o).sum(0)


def _partials(n_splits, B, S, H, D, empty_frac=0.3):
    out_partial = torch.randn(n_splits, B, S, H, D)
    # FA3's layout: the lse buffer is (splits, B, H, S), handed over transposed (seqlen contiguous).
    lse_buf = torch.randn(n_splits, B, H, S) * 3
    empty = torch.rand(n_splits, B, H, S) < empty_frac
    lse_buf[empty] = float("-inf")
    lse_buf[:, 0, 0, 0] = float("-inf")  # one row with no key in any split
    lse_partial = lse_buf.transpose(2, 3)
    out_partial[lse_partial == float("-inf")] = float("nan")  # an empty split's output is never read
    return out_partial, lse_partial


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
@pytest.mark.parametrize("shape", [(3, 2, 5, 3, 33), (1, 1, 7, 2, 16), (7, 1, 3, 1, 5), (40, 2, 2, 2, 8)])
def test_combine_matches_float64(request, backend, shape):
    request.getfixturevalue(backend)
    out_partial, lse_partial = _partials(*shape)
    want, want_lse = _merge64(out_partial, lse_partial)
    out, lse = flash_attn_combine(out_partial, lse_partial)
    n, B, S, H, D = shape
    assert out.shape == (B, S, H, D) and out.dtype == torch.float32
    assert lse.shape == (B, S, H) and lse.dtype == torch.float32 and lse.stride(1) == 1  # (B, H, S) buffer
    assert_close_tolerance(out, want, _merge32(out_partial, lse_partial), name="out")
    assert_close_tolerance(lse, want_lse, None, atol=1e-5 * max(1.0, float(want_lse[want_lse.isfinite()].abs().max())),
                           name="lse")
    assert float(lse[0, 0, 0]) == float("-inf") and bool((out[0, 0, 0] == 0).all())
    assert not bool(out.isnan().any())


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
def test_combine_out_and_dtype(request, backend):
    request.getfixturevalue(backend)
    out_partial, lse_partial = _partials(4, 2, 3, 2, 24)
    want, _ = _merge64(out_partial, lse_partial)
    dest = torch.full((2, 3, 2, 24), float("nan"), dtype=torch.bfloat16)
    got, _ = flash_attn_combine(out_partial, lse_partial, out=dest, out_dtype=torch.bfloat16)
    assert got is dest and got.dtype == torch.bfloat16
    assert_close_tolerance(got, want, want.to(torch.bfloat16), name="out bf16")
    half, _ = flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)
    assert half.dtype == torch.float16
    assert_close_tolerance(half, want, want.to(torch.float16), name="out fp16")
    # non-contiguous partials (a strided view) are read through their strides
    big = torch.randn(4, 2, 3, 2, 48)
    big[..., ::2] = out_partial
    got2, _ = flash_attn_combine(big[..., ::2], lse_partial)
    assert_close_tolerance(got2, want, _merge32(out_partial, lse_partial), name="out strided")


def test_combine_rejects_bad_arguments():
    out_partial, lse_partial = _partials(2, 1, 3, 2, 8)
    with pytest.raises(ValueError, match="lse_partial"):
        flash_attn_combine(out_partial, lse_partial[:, :, :2])
    with pytest.raises(TypeError, match="fp32"):
        flash_attn_combine(out_partial.half(), lse_partial)
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_combine(torch.randn(257, 1, 1, 1, 4), torch.randn(257, 1, 1, 1))
    with pytest.raises(TypeError, match="out_dtype"):
        flash_attn_combine(out_partial, lse_partial, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="out must be"):
        flash_attn_combine(out_partial, lse_partial, out=torch.empty(1, 3, 2, 7))


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
def test_split_kv_equals_no_split(request, backend):
    """Attention over key chunks, merged by flash_attn_combine, equals attention over all keys."""
    request.getfixturevalue(backend)
    B, sq, sk, h, hk, d = 2, 3, 23, 4, 2, 16
    q, k, v = torch.randn(B, sq, h, d), torch.randn(B, sk, hk, d), torch.randn(B, sk, hk, d)
    full, full_lse = flash_attn_func(q, k, v, return_attn_probs=True)
    bounds = [0, 5, 6, 17, 23]
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, lse = flash_attn_func(q, k[:, a:b], v[:, a:b], softmax_scale=d ** -0.5, return_attn_probs=True)
        outs.append(o.float())
        lses.append(lse.transpose(1, 2))  # (B, sq, h)
    out, lse = flash_attn_combine(torch.stack(outs), torch.stack(lses), out_dtype=torch.float32)
    torch.testing.assert_close(out, full, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse.transpose(1, 2), atol=2e-5, rtol=1e-5)
