"""Split-KV decoding through flash_attn 2's ``flash_attn_with_kvcache`` (``num_splits``): equal to the unsplit
call and to float64 attention, dense and paged (``block_table``) caches, ALiBi, softcap, local windows."""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn import flash_attn_with_kvcache


def attend64(q, k, v, n, causal=False, window=(-1, -1), softcap=0.0, alibi=None):
    sq, h, d = q.shape
    g = h // k.shape[1]
    kk, vv = k[:n].double().repeat_interleave(g, 1), v[:n].double().repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), kk) * d ** -0.5
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(sq).view(sq, 1) + n - sq
    j = torch.arange(n).view(1, -1)
    if alibi is not None:
        s = s - alibi.double().view(h, 1, 1) * (j - i).abs()
    right = 0 if causal else window[1]
    if right >= 0:
        s = s.masked_fill(j > i + right, float("-inf"))
    if window[0] >= 0:
        s = s.masked_fill(j < i - window[0], float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(9, 0), softcap=4.0), dict(alibi=True)],
                         ids=["causal", "local_softcap", "alibi"])
def test_fa2_kvcache_num_splits(triton_backend, kw):
    kw = dict(kw)
    B, h, hk, d, S, sq = 2, 4, 2, 16, 57, 2
    alibi = torch.rand(h) if kw.pop("alibi", False) else None
    kc, vc = torch.randn(B, S, hk, d), torch.randn(B, S, hk, d)
    q = torch.randn(B, sq, h, d)
    seqlens = torch.tensor([57, 23], dtype=torch.int32)
    one = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, alibi_slopes=alibi, num_splits=1, **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, alibi_slopes=alibi, num_splits=3,
                                       return_softmax_lse=True, **kw)
    torch.testing.assert_close(out, one, atol=1e-5, rtol=1e-5)
    assert lse.shape == (B, h, sq)
    for b in range(B):
        w = attend64(q[b], kc[b], vc[b], int(seqlens[b]), kw.get("causal", False), kw.get("window_size", (-1, -1)),
                     kw.get("softcap", 0.0), alibi)
        torch.testing.assert_close(out[b].double(), w, atol=2e-5, rtol=2e-5)


def test_fa2_paged_kvcache_num_splits_with_append(triton_backend):
    B, h, hk, d, page, nb = 2, 2, 1, 16, 7, 4
    kc, vc = torch.randn(B * nb, page, hk, d), torch.randn(B * nb, page, hk, d)
    table = torch.randperm(B * nb, dtype=torch.int32).view(B, nb)
    seqlens = torch.tensor([20, 3], dtype=torch.int32)
    q, kn, vn = torch.randn(B, 1, h, d), torch.randn(B, 1, hk, d), torch.randn(B, 1, hk, d)
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=table, causal=True,
                                  num_splits=4)
    dk = kc[table.long()].reshape(B, nb * page, hk, d)
    dv = vc[table.long()].reshape(B, nb * page, hk, d)
    for b in range(B):
        torch.testing.assert_close(dk[b, int(seqlens[b])], kn[b, 0])
        w = attend64(q[b], dk[b], dv[b], int(seqlens[b]) + 1, causal=True)
        torch.testing.assert_close(out[b].double(), w, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
def test_fa2_kvcache_gpu_splits_equal_unsplit():
    dev, B, h, hk, d, S = "cuda", 2, 16, 2, 128, 8192
    kc = torch.randn(B, S, hk, d, device=dev, dtype=torch.float16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, 1, h, d, device=dev, dtype=torch.float16)
    seqlens = torch.tensor([8192, 3001], device=dev, dtype=torch.int32)
    one = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=1)
    for n in (0, 4, 16):
        got = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=n)
        torch.testing.assert_close(got, one, atol=2e-3, rtol=2e-3)
