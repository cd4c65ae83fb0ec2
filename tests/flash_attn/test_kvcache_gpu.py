"""``flash_attn_with_kvcache`` on a real GPU (the kernel's per-row key-range mode) at decoding sizes,
against the row-by-row float64 expectation of the CPU tests, with the paged cache included."""

from __future__ import annotations

import pytest
import torch
from test_kvcache_padding import CASES, _expected

from culmen.flash_attn import flash_attn_with_kvcache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [64, 128])
def test_kvcache_gpu_matches_row_reference(case, d):
    c = CASES[case]
    B, S, h, hk = 3, 1000, c.get("h", 8), c.get("hk", 2)
    g = torch.Generator().manual_seed(hash((case, d)) % 2**31)
    q = torch.randn(B, c["sq"], h, d, generator=g).bfloat16()
    k_cache = torch.randn(B + 2, S, hk, d, generator=g).bfloat16()
    v_cache = torch.randn(B + 2, S, hk, d, generator=g).bfloat16()
    k = torch.randn(B, c["s_new"], hk, d, generator=g).bfloat16() if c["s_new"] else None
    v = torch.randn(B, c["s_new"], hk, d, generator=g).bfloat16() if c["s_new"] else None
    seqlens = torch.tensor([517, 0, 900], dtype=torch.int32)
    leftpad = torch.tensor([30, 0, 257], dtype=torch.int32) if c.get("leftpad") else None
    rows = torch.tensor([4, 0, 2]) if c.get("batch_idx") else torch.arange(B)
    cos = sin = None
    if c.get("rotary"):
        ang = torch.rand(S, d // 4, generator=g) * 3
        cos, sin = ang.cos(), ang.sin()
    window = c.get("window", (-1, -1))
    if window != (-1, -1):
        window = (300, 0)
    interleaved = c.get("interleaved", True)
    want, kc_want, vc_want = _expected(q.double(), k_cache.double(), v_cache.double(),
                                       None if k is None else k.double(), None if v is None else v.double(),
                                       seqlens, leftpad, rows, c["causal"], window, cos, sin, interleaved)
    cu = {n: (t.cuda() if t is not None else None) for n, t in dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cos=cos, sin=sin, seqlens=seqlens, leftpad=leftpad).items()}
    out, lse = flash_attn_with_kvcache(
        cu["q"], cu["k_cache"], cu["v_cache"], cu["k"], cu["v"], cu["cos"], cu["sin"], cu["seqlens"],
        cache_batch_idx=rows.to(torch.int32).cuda() if c.get("batch_idx") else None, cache_leftpad=cu["leftpad"],
        causal=c["causal"], window_size=window, rotary_interleaved=interleaved, return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and lse.shape == (B, h, c["sq"])
    # bf16 inputs: the output error is dominated by bf16 rounding of the result (and of rotated keys).
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cu["k_cache"].cpu()[rows].double(), kc_want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(cu["v_cache"].cpu()[rows].double(), vc_want)


def test_kvcache_gpu_paged_equals_contiguous():
    B, page, nb, hk, d = 2, 256, 4, 2, 128
    dev = torch.device("cuda")
    pages_k = torch.randn(12, page, hk, d, device=dev, dtype=torch.bfloat16)
    pages_v = torch.randn(12, page, hk, d, device=dev, dtype=torch.bfloat16)
    table = torch.tensor([[5, 2, 9, 0], [1, 7, 3, 11]], dtype=torch.int32, device=dev)
    dense_k = pages_k[table.long()].reshape(B, nb * page, hk, d).clone()
    dense_v = pages_v[table.long()].reshape(B, nb * page, hk, d).clone()
    q = torch.randn(B, 3, 8, d, device=dev, dtype=torch.bfloat16)
    kn, vn = (torch.randn(B, 3, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([300, 1000], dtype=torch.int32, device=dev)
    a = flash_attn_with_kvcache(q, pages_k, pages_v, kn, vn, cache_seqlens=seqlens, block_table=table, causal=True)
    b = flash_attn_with_kvcache(q, dense_k, dense_v, kn, vn, cache_seqlens=seqlens, causal=True)
    # The two calls split the keys differently (paged: 4 splits of 128-key blocks, dense: 8 of 64), so their fp32
    # sums round differently and a bf16 output may differ by one ulp (2.4e-4 seen on an H200); an addressing error
    # would be of the outputs' size (~0.05).
    torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=1.6e-2)
    torch.testing.assert_close(pages_k[table.long()].reshape(B, nb * page, hk, d), dense_k)
