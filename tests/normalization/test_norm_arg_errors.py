"""Apex's norm modules reject a bad ``normalized_shape`` or ``eps`` at construction, with an error that
names the argument and shows the value; the shapes Apex and ``torch.nn.LayerNorm`` accept still work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from culmen.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from culmen.normalization import fused_layer_norm as fln

MODULES = [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm]


@pytest.mark.parametrize("cls", MODULES)
@pytest.mark.parametrize(("shape", "exc", "shown"), [
    (0, ValueError, "0"),
    (-4, ValueError, "-4"),
    ((8, 0), ValueError, "(8, 0)"),
    ([3, -1], ValueError, "[3, -1]"),
    ((), ValueError, "()"),
    (2.5, TypeError, "2.5"),
    ((4, 2.0), TypeError, "(4, 2.0)"),
    ("16", TypeError, "'16'"),
    (None, TypeError, "None"),
    (True, TypeError, "True"),
])
def test_bad_normalized_shape(cls, shape, exc, shown):
    with pytest.raises(exc, match="normalized_shape") as info:
        cls(shape)
    assert shown in str(info.value)


@pytest.mark.parametrize("cls", MODULES)
@pytest.mark.parametrize(("eps", "exc"), [(0.0, ValueError), (-1e-5, ValueError), (float("nan"), ValueError),
                                          (float("inf"), ValueError), ("1e-5", TypeError), (None, TypeError)])
def test_bad_eps(cls, eps, exc):
    with pytest.raises(exc, match="eps") as info:
        cls(8, eps=eps)
    assert repr(eps) in str(info.value)


@pytest.mark.parametrize("shape", [8, np.int64(8), [2, 4], (2, 4), torch.Size([2, 4]), [np.int32(8)]])
def test_accepted_shapes(shape):
    m = FusedRMSNorm(shape, eps=1e-6)
    n = int(np.prod(m.normalized_shape))
    assert n == 8 and m.weight.shape == m.normalized_shape
    x = torch.randn(3, *m.normalized_shape)
    y = m(x)
    ref = x * torch.rsqrt(x.pow(2).flatten(-len(m.normalized_shape)).mean(-1) + 1e-6).reshape(
        3, *([1] * len(m.normalized_shape)))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_functional_normalized_shape_errors():
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"normalized_shape must hold positive sizes, got \(0,\)"):
        fln.fused_layer_norm(x, (0,))
    with pytest.raises(TypeError, match="normalized_shape"):
        fln.fused_rms_norm(x, 6.0)
