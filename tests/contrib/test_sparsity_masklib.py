"""contrib.sparsity.sparse_masklib: m:n masks are exactly m:n along the input-channel dim, keep the
most magnitude their pattern allows (checked by brute force in float64), and reject bad patterns."""

import itertools

import numpy as np
import pytest
import torch

from culmen.contrib.sparsity import create_mask
from culmen.contrib.sparsity.sparse_masklib import (
    compute_valid_2d_patterns,
    fill,
    m4n2_1d,
    mask_is_valid,
    mn_2d_greedy,
    parse_pattern,
    reshape_2d,
    reshape_2d_inv,
)


def _rows_channels(t):
    """Independent re-layout: every (output channel, kernel tap) row with the input channels last."""
    if t.dim() == 1:
        return t[None]
    if t.dim() == 2:
        return t
    k, c = t.shape[:2]
    return t.reshape(k, c, -1).transpose(1, 2).reshape(-1, c)


def _best_1d_kept(w, m, n):
    """Brute force over every n-subset of every group of m channels, in float64."""
    g = w.double().abs().reshape(-1, m)
    best = torch.zeros(g.shape[0], dtype=torch.float64)
    for keep in itertools.combinations(range(m), n):
        best = torch.maximum(best, g[:, list(keep)].sum(1))
    return float(best.sum())


@pytest.mark.parametrize("shape", [(24, 40), (16, 32, 3), (8, 16, 3, 5), (8, 16, 1, 3, 2), (40,)])
@pytest.mark.parametrize("pattern,m,n", [("m4n2_1d", 4, 2), ("m8n4_1d", 8, 4), ("m4n1_1d", 4, 1)])
def test_1d_masks_are_exactly_m_n_along_channels_and_optimal(shape, pattern, m, n):
    torch.manual_seed(hash((shape, pattern)) % 1000)
    w = torch.randn(shape, dtype=torch.float32)
    mask = create_mask(w, pattern)
    assert mask.shape == w.shape and mask.dtype == w.dtype
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    rc = _rows_channels(mask)
    counts = rc.reshape(rc.shape[0], -1, m).sum(-1)
    assert bool((counts == n).all()), counts
    kept = float((_rows_channels(w).double().abs() * rc.double()).sum())
    assert kept == pytest.approx(_best_1d_kept(_rows_channels(w), m, n), rel=1e-12)
    assert fill(mask) == pytest.approx(n / m)
    assert mask_is_valid(mask, pattern)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_mask_keeps_dtype_and_is_a_function_of_magnitude(dtype):
    w = torch.randn(16, 32).to(dtype)
    mask = create_mask(w, "m4n2_1d")
    assert mask.dtype == dtype
    assert torch.equal(mask, create_mask(-w, "m4n2_1d"))  # sign never matters
    assert torch.equal(m4n2_1d(w.float()).to(dtype), mask)


def test_1d_mask_of_a_strided_weight_matches_the_contiguous_one():
    base = torch.randn(32, 24)
    w = base.t()  # (24, 32), non-contiguous
    assert torch.equal(create_mask(w, "m4n2_1d"), create_mask(w.contiguous(), "m4n2_1d"))


def _valid_2d_blocks(m, n):
    rows = [r for r in itertools.product([0, 1], repeat=m) if sum(r) == n]
    out = [b for b in itertools.product(rows, repeat=m) if all(sum(col) == n for col in zip(*b))]
    return np.array(out, dtype=np.float64)


def test_2d_best_is_exactly_2_per_row_and_column_and_optimal():
    torch.manual_seed(1)
    w = torch.randn(8, 12)
    mask = create_mask(w, "m4n2_2d_best")
    blocks = reshape_2d(mask, 4, 4).reshape(2, 3, 4, 4)
    assert bool((blocks.sum(2) == 2).all()) and bool((blocks.sum(3) == 2).all())
    table = _valid_2d_blocks(4, 2)
    assert table.shape[0] == compute_valid_2d_patterns(4, 2).shape[0] == 90
    absw = reshape_2d(w.double().abs(), 4, 4).numpy()  # (2, 3, 16)
    best = (absw @ table.reshape(90, 16).T).max(-1).sum()
    assert float((w.double().abs() * mask.double()).sum()) == pytest.approx(best, rel=1e-12)
    # the transpose of a 2-D mask is also 2:4 along its rows
    assert mask_is_valid(mask.t().contiguous(), "m4n2_1d")


def _greedy_reference(w, m, n):
    mask = np.zeros(w.shape, dtype=np.int64)
    a = np.abs(w)
    for r0 in range(0, w.shape[0], m):
        for c0 in range(0, w.shape[1], m):
            order = sorted(((a[r0 + i, c0 + j], i, j) for i in range(m) for j in range(m)), reverse=True)
            rc, cc = [0] * m, [0] * m
            for _, i, j in order:
                if rc[i] < n and cc[j] < n:
                    mask[r0 + i, c0 + j] = 1
                    rc[i] += 1
                    cc[j] += 1
    return mask


def test_2d_greedy_matches_a_plain_greedy_and_respects_both_directions():
    torch.manual_seed(2)
    w = torch.randn(12, 8, dtype=torch.float64)
    mask = create_mask(w, "m4n2_2d_greedy")
    np.testing.assert_array_equal(mask.numpy().astype(np.int64), _greedy_reference(w.numpy(), 4, 2))
    blocks = reshape_2d(mask, 4, 4).reshape(3, 2, 4, 4)
    assert bool((blocks.sum(2) <= 2).all()) and bool((blocks.sum(3) <= 2).all())
    best = create_mask(w, "m4n2_2d_best")
    assert float((w.abs() * mask).sum()) <= float((w.abs() * best).sum()) + 1e-12
    assert torch.equal(mn_2d_greedy(w, 4, 2).double(), mask)


def test_reshape_2d_round_trip():
    x = torch.arange(8 * 12.).reshape(8, 12)
    blocks = reshape_2d(x, 4, 4)
    assert blocks.shape == (2, 3, 16)
    assert torch.equal(blocks[1, 2], x[4:8, 8:12].reshape(16))
    assert torch.equal(reshape_2d_inv(blocks.reshape(2, 3, 4, 4)), x)


def test_bad_patterns_and_shapes_raise_naming_the_argument():
    w = torch.randn(8, 16)
    for bad in ["m4n2", "n2m4_1d", "m4n5_1d", "m4n2_3d", ""]:
        with pytest.raises(ValueError, match="pattern"):
            create_mask(w, bad)
    with pytest.raises(ValueError, match="channel dimension has 18"):
        create_mask(torch.randn(8, 18), "m4n2_1d")
    with pytest.raises(ValueError, match="channel dimension has 6"):
        create_mask(torch.randn(8, 6, 3, 3), "m4n2_1d")
    with pytest.raises(ValueError, match="row count"):
        create_mask(torch.randn(6, 16), "m4n2_2d_best")
    with pytest.raises(TypeError, match="tensor"):
        create_mask(torch.ones(8, 16, dtype=torch.int32), "m4n2_1d")
    with pytest.raises(TypeError, match="pattern"):
        create_mask(w, 42)
    assert parse_pattern("m16n8_2d_greedy") == (16, 8, "2d_greedy")


def test_mask_follows_the_tensor_device_under_a_meta_default():
    w = torch.randn(8, 16)
    with torch.device("meta"):
        mask = create_mask(w, "m4n2_1d")
    assert mask.device == w.device and int(mask.sum()) == 64
