"""Pack-GQA one-token decoding (``flash_attn_with_kvcache`` with ``seqlen_q == 1`` and ``nheads > nheads_k``): the
G query heads of a KV head run as G rows of one program. Checked against float64 attention on the Triton kernels
(interpreter), with appended tokens, rotary, left padding, paged caches, split-KV, the lse, and the cases that must
not pack (ALiBi, a window) still correct."""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn import flash_attn_with_kvcache
from culmen.ops.attention import kvcache


def attend64(q, k, v, start, end):
    """float64 attention of each row's one query over keys ``[start[b], end[b])``: ``(out (B, 1, h, d), lse)``."""
    B, _, h, d = q.shape
    g = h // k.shape[2]
    outs, lses = [], []
    for b in range(B):
        kk = k[b, start[b]:end[b]].double().repeat_interleave(g, 1)
        vv = v[b, start[b]:end[b]].double().repeat_interleave(g, 1)
        s = torch.einsum("hd,jhd->hj", q[b, 0].double(), kk) * d ** -0.5
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hj,jhd->hd", torch.softmax(s, -1), vv))
    return torch.stack(outs)[:, None], torch.stack(lses)[:, :, None]


def _plan_for(q, kc):
    plans = [p for p in kvcache.PLANS.values() if p.out_shape[:3] == tuple(q.shape[:3])
             and p.n_cache_rows == kc.shape[0]]
    return plans[-1]


@pytest.mark.parametrize("h,hk,rows", [(6, 2, 3), (4, 1, 4), (8, 2, 4), (32, 1, 16), (36, 2, 9), (17, 1, 1)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_pack_gqa_decode_with_append_equals_float64(triton_backend, h, hk, rows, splits, causal):
    """``rows``: the query heads packed per program, the largest divisor of h / hk up to 16 (17 heads over one KV
    head: none, one head a program as without packing)."""
    B, S, d = 3, 40, 16
    kc, vc = torch.randn(B, S, hk, d), torch.randn(B, S, hk, d)
    q = torch.randn(B, 1, h, d)
    kn, vn = torch.randn(B, 1, hk, d), torch.randn(B, 1, hk, d)
    lens = torch.tensor([0, 17, 39], dtype=torch.int32)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=causal, num_splits=splits,
                                       return_softmax_lse=True)
    plan = _plan_for(q, kc)
    assert plan.pack == (rows > 1) and (not plan.pack or plan.attn.q_shape == (B, rows, h // rows, d))
    for b, n in enumerate(lens.tolist()):
        kc0[b, n], vc0[b, n] = kn[b, 0], vn[b, 0]
    torch.testing.assert_close(kc, kc0, rtol=0, atol=0)
    want, want_lse = attend64(q, kc0, vc0, [0] * B, (lens + 1).tolist())
    assert out.shape == q.shape and lse.shape == (B, h, 1)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-5)


def test_pack_gqa_non_contiguous_q_paged_leftpad_rotary(triton_backend):
    """q a strided slice of a wider tensor, a paged cache (page 8) with left padding and rotary on q and the new
    key: equals the same call with every feature but packing done by hand (the unpacked single-head reference)."""
    B, h, hk, d, page, npages = 2, 6, 3, 16, 8, 5
    wide = torch.randn(B, 1, h, 2 * d)
    q = wide[..., :d]  # head-dim stride 1, head stride 2 d
    kc, vc = torch.randn(B * npages, page, hk, d), torch.randn(B * npages, page, hk, d)
    table = torch.randperm(B * npages, dtype=torch.int32).view(B, npages)
    kn, vn = torch.randn(B, 1, hk, d), torch.randn(B, 1, hk, d)
    lens = torch.tensor([11, 33], dtype=torch.int32)
    left = torch.tensor([3, 0], dtype=torch.int32)
    cos, sin = torch.rand(npages * page, d // 2), torch.rand(npages * page, d // 2)
    kc1, vc1 = kc.clone(), vc.clone()
    got = flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                  cache_leftpad=left, block_table=table)
    assert _plan_for(q, kc).pack
    # the reference: one query head per call (no group to pack), same caches
    outs = []
    for i in range(h):
        kh = i // (h // hk)
        kci, vci = kc1[:, :, kh:kh + 1].clone(), vc1[:, :, kh:kh + 1].clone()
        outs.append(flash_attn_with_kvcache(q[:, :, i:i + 1].contiguous(), kci, vci, kn[:, :, kh:kh + 1],
                                            vn[:, :, kh:kh + 1], rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                            cache_leftpad=left, block_table=table))
    torch.testing.assert_close(got, torch.cat(outs, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(alibi_slopes=True), dict(window_size=(5, 0))], ids=["alibi", "window"])
def test_features_with_per_head_positions_do_not_pack(triton_backend, kw):
    kw = dict(kw)
    B, h, hk, d, S = 2, 4, 2, 16, 24
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(h)
    kc, vc, q = torch.randn(B, S, hk, d), torch.randn(B, S, hk, d), torch.randn(B, 1, h, d)
    lens = torch.tensor([24, 9], dtype=torch.int32)
    got = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **kw)
    assert not _plan_for(q, kc).pack
    with torch.no_grad():
        from culmen.ops.backend import use_backend

        with use_backend("reference"):
            want = flash_attn_with_kvcache(q.double(), kc.double(), vc.double(), cache_seqlens=lens,
                                           **{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                              for k, v in kw.items()})
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_pack_gqa_fp8_decode_with_descales(triton_backend):
    """FP8 one-token decoding with per-(batch, kv head) descales of different sizes: the packed rows keep their
    KV head's descales (the dense forward, which does not pack, is the reference on the same inputs)."""
    from culmen.flash_attn_3 import flash_attn_func as fa3_func
    from culmen.flash_attn_3 import flash_attn_with_kvcache as fa3_kvcache
    from culmen.flash_attn_3.fp8 import quantize_fp8

    B, S, h, hk, d = 2, 19, 6, 2, 16
    scale = torch.tensor([0.5, 3.0]).view(1, 1, hk, 1)
    q = torch.randn(B, 1, h, d)
    k, v = torch.randn(B, S, hk, d) * scale, torch.randn(B, S, hk, d) * scale
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    got = fa3_kvcache(q8, k8.clone(), v8.clone(), cache_seqlens=S, q_descale=qd, k_descale=kd, v_descale=vd)
    assert _plan_for(q8, k8).pack
    want = fa3_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
