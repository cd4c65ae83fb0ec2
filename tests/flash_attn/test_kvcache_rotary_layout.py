"""flash_attn_with_kvcache with rotary on a q that is a view (packed qkv, as MHA decodes): the attention
must read the rotated copy with its own strides, not the caller's layout."""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn import flash_attn_with_kvcache
from culmen.ops.backend import use_backend
from culmen.testing import assert_close_tolerance


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("s_new", [1, 3])
def test_rotary_on_packed_qkv_view_matches_reference(interleaved, s_new):
    torch.manual_seed(0)
    B, S, h, d, filled = 2, 16, 4, 32, 5
    cache = torch.full((B, S, 2, h, d), float("nan"))
    cache[:, :filled] = torch.randn(B, filled, 2, h, d)
    qkv = torch.randn(B, s_new, 3, h, d)  # q, k, v are strided views of one buffer
    cos, sin = torch.rand(S, 8), torch.rand(S, 8)
    outs = []
    for backend in ("reference", "triton"):
        with use_backend(backend):
            c = cache.clone()
            outs.append(flash_attn_with_kvcache(qkv[:, :, 0], c[:, :, 0], c[:, :, 1], qkv[:, :, 1], qkv[:, :, 2],
                                                rotary_cos=cos, rotary_sin=sin, cache_seqlens=filled, causal=True,
                                                rotary_interleaved=interleaved))
    want = outs[0].double()
    assert torch.isfinite(outs[1]).all()
    assert_close_tolerance(outs[1], want, outs[0], name="out")
