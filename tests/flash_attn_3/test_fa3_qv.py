"""FA3's ``qv`` (MLA-style extra query) in ``culmen.flash_attn_3``: every score is ``scale * (q . k + qv . v)``
with FA3's default ``scale = (d + dv) ** -0.5``. Forward and backward (dq, dk, dv, dqv) against float64 attention
written out here, on the reference and on the Triton kernels (the CPU interpreter); varlen, ``seqused_k`` and the
KV cache (paged, packed queries)."""

from __future__ import annotations

import pytest
import torch

import culmen.flash_attn_3 as fa3
from culmen.testing import assert_close_tolerance


def oracle(q, k, v, qv, dtype, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """``(out (B, sq, h, dv), lse (B, h, sq))`` in ``dtype``; rows that see no key give 0 / ``+inf``."""
    B, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hk
    qq, qvv = q.to(dtype), qv.to(dtype)
    kk, vv = k.to(dtype).repeat_interleave(g, 2), v.to(dtype).repeat_interleave(g, 2)
    scale = (d + dv) ** -0.5 if scale is None else scale
    s = (torch.einsum("bihd,bjhd->bhij", qq, kk) + torch.einsum("bihd,bjhd->bhij", qvv, vv)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(sq, device=q.device).view(sq, 1) + sk - sq
    j = torch.arange(sk, device=q.device).view(1, sk)
    ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    right = 0 if causal else window[1]
    if right >= 0:
        ok &= j <= i + right
    if window[0] >= 0:
        ok &= j >= i - window[0]
    seen = ok.any(-1).view(1, 1, sq, 1)
    s = s.masked_fill(~ok, float("-inf")).masked_fill(~seen, 0.0)
    a = torch.softmax(s, -1) * seen
    lse = torch.where(seen[..., 0], torch.logsumexp(s, -1), torch.full((), float("inf"), dtype=s.dtype))
    return torch.einsum("bhij,bjhd->bihd", a, vv), lse


CASES = {
    "gqa_causal_dv_ne_d": dict(sq=19, sk=27, h=4, hk=2, d=16, dv=24, causal=True),
    "mqa_window_softcap": dict(sq=13, sk=21, h=2, hk=1, d=8, dv=16, window=(6, 2), softcap=5.0),
    "same_dims_longer_q": dict(sq=23, sk=17, h=2, hk=2, d=16, dv=16, causal=True),
}


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
@pytest.mark.parametrize("case", list(CASES))
def test_dense_qv_forward_backward_match_float64(request, backend, case):
    request.getfixturevalue(backend)
    c = CASES[case]
    kw = dict(causal=c.get("causal", False), window=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0))
    B = 2
    q = torch.randn(B, c["sq"], c["h"], c["d"], dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, c["sk"], c["hk"], c["d"], dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, c["sk"], c["hk"], c["dv"], dtype=torch.bfloat16, requires_grad=True)
    qv = torch.randn(B, c["sq"], c["h"], c["dv"], dtype=torch.bfloat16, requires_grad=True)
    out, lse = fa3.flash_attn_func(q, k, v, causal=kw["causal"], qv=qv, window_size=kw["window"],
                                   softcap=kw["softcap"], return_attn_probs=True)
    assert out.shape == (B, c["sq"], c["h"], c["dv"]) and out.dtype == torch.bfloat16
    leaves64 = tuple(t.detach().double().requires_grad_() for t in (q, k, v, qv))
    want, lse64 = oracle(*leaves64, torch.float64, **kw)
    lo, _ = oracle(q, k, v, qv, torch.bfloat16, **kw)
    assert_close_tolerance(out, want, lo, name="out")
    assert_close_tolerance(lse, lse64.detach(), None, atol=2e-4, name="lse")
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, qv), dout)
    ref = torch.autograd.grad(want, leaves64, dout.double())
    low = torch.autograd.grad(lo, (q, k, v, qv), dout)
    for name, g, r, lw in zip(("dq", "dk", "dv", "dqv"), got, ref, low):
        assert g.shape == r.shape, name
        assert_close_tolerance(g, r, lw, factor=3.0, name=name)


def test_qv_changes_the_scores_and_explicit_scale_is_kept(triton_backend):
    """qv really enters the scores (zero qv with the scale given equals plain attention; a random one differs),
    and an explicit ``softmax_scale`` overrides FA3's ``(d + dv) ** -0.5``."""
    q, k, v = torch.randn(1, 9, 2, 16), torch.randn(1, 11, 2, 16), torch.randn(1, 11, 2, 16)
    plain = fa3.flash_attn_func(q, k, v, softmax_scale=0.3)
    zero = fa3.flash_attn_func(q, k, v, softmax_scale=0.3, qv=torch.zeros(1, 9, 2, 16))
    torch.testing.assert_close(zero, plain, atol=1e-5, rtol=1e-5)
    qv = torch.randn(1, 9, 2, 16)
    got = fa3.flash_attn_func(q, k, v, softmax_scale=0.3, qv=qv)
    want, _ = oracle(q, k, v, qv, torch.float64, scale=0.3)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(got, plain, atol=1e-2)


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
def test_varlen_qv_and_seqused_k(request, backend):
    request.getfixturevalue(backend)
    lens_q, lens_k = [5, 11, 1], [9, 11, 6]
    h, hk, d, dv = 2, 1, 8, 16
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, dv, requires_grad=True)
    qv = torch.randn(sum(lens_q), h, dv, requires_grad=True)
    out = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, qv=qv)
    l64 = tuple(t.detach().double().requires_grad_() for t in (q, k, v, qv))
    wants = []
    for b in range(3):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        wants.append(oracle(l64[0][None, sq_], l64[1][None, sk_], l64[2][None, sk_], l64[3][None, sq_],
                            torch.float64, causal=True)[0][0])
    want = torch.cat(wants)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v, qv), dout), torch.autograd.grad(want, l64, dout.double())):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
    # padded sides with seqused_k: sequence b sees its first used[b] keys only
    B, sq, sk = 2, 4, 10
    qd, kd, vd = torch.randn(B, sq, h, d), torch.randn(B, sk, hk, d), torch.randn(B, sk, hk, dv)
    qvd = torch.randn(B, sq, h, dv)
    used = torch.tensor([10, 6], dtype=torch.int32)
    got = fa3.flash_attn_varlen_func(qd, kd, vd, None, None, None, None, seqused_k=used, qv=qvd)
    for b in range(B):
        n = int(used[b])
        w, _ = oracle(qd[b:b + 1], kd[b:b + 1, :n], vd[b:b + 1, :n], qvd[b:b + 1], torch.float64)
        torch.testing.assert_close(got[b:b + 1].double(), w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
def test_kvcache_qv_paged_and_packed_queries(request, backend):
    """MLA-style decode: ``qv`` with a paged cache of page size 3, new tokens appended; then packed queries."""
    request.getfixturevalue(backend)
    B, h, hk, d, dv, page, npages = 2, 4, 1, 8, 16, 3, 5
    kc = torch.randn(B * npages, page, hk, d)
    vc = torch.randn(B * npages, page, hk, dv)
    table = torch.randperm(B * npages, dtype=torch.int32).view(B, npages)
    seqlens = torch.tensor([6, 11], dtype=torch.int32)
    kn, vn = torch.randn(B, 2, hk, d), torch.randn(B, 2, hk, dv)
    q, qv = torch.randn(B, 2, h, d), torch.randn(B, 2, h, dv)
    dense_k = kc[table.long()].reshape(B, npages * page, hk, d).clone()
    dense_v = vc[table.long()].reshape(B, npages * page, hk, dv).clone()
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, kc, vc, kn, vn, qv=qv, cache_seqlens=seqlens, page_table=table,
                                               causal=True, return_softmax_lse=True)
    for b in range(B):
        n = int(seqlens[b])
        kk = torch.cat([dense_k[b:b + 1, :n], kn[b:b + 1]], 1)
        vv = torch.cat([dense_v[b:b + 1, :n], vn[b:b + 1]], 1)
        w, lw = oracle(q[b:b + 1], kk, vv, qv[b:b + 1], torch.float64, causal=True)
        torch.testing.assert_close(out[b:b + 1].double(), w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b:b + 1].double(), lw, atol=1e-5, rtol=1e-5)
    # packed queries (2 then 1 rows) against the now-filled cache
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32)
    qp, qvp = torch.randn(3, h, d), torch.randn(3, h, dv)
    outp = fa3.flash_attn_with_kvcache(qp, kc, vc, qv=qvp, cache_seqlens=seqlens + 2, page_table=table,
                                       cu_seqlens_q=cu_q, max_seqlen_q=2, causal=True)
    dense_k = kc[table.long()].reshape(B, npages * page, hk, d)
    dense_v = vc[table.long()].reshape(B, npages * page, hk, dv)
    for b, rows in ((0, slice(0, 2)), (1, slice(2, 3))):
        n = int(seqlens[b]) + 2
        w, _ = oracle(qp[None, rows], dense_k[b:b + 1, :n], dense_v[b:b + 1, :n], qvp[None, rows], torch.float64,
                      causal=True)
        torch.testing.assert_close(outp[rows].double(), w[0], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qv_gpu_mla_shapes(dtype):
    """DeepSeek MLA decode and prefill shapes on the GPU kernels: d 64 (rope) + dv 512 (latent), 16 heads over one
    KV head; forward and backward within the tolerance rule."""
    dev = "cuda"
    B, sq, sk, h, d, dv = 2, 257, 1031, 16, 64, 512
    q = torch.randn(B, sq, h, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, sk, 1, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, sk, 1, dv, device=dev, dtype=dtype, requires_grad=True)
    qv = torch.randn(B, sq, h, dv, device=dev, dtype=dtype, requires_grad=True)
    out = fa3.flash_attn_func(q, k, v, causal=True, qv=qv)
    l64 = tuple(t.detach().double().requires_grad_() for t in (q, k, v, qv))
    want, _ = oracle(*l64, torch.float64, causal=True)
    lows = tuple(t.detach().requires_grad_() for t in (q, k, v, qv))
    lo, _ = oracle(*lows, dtype, causal=True)
    assert_close_tolerance(out, want, lo, name="out")
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, qv), dout)
    ref = torch.autograd.grad(want, l64, dout.double())
    low = torch.autograd.grad(lo, lows, dout)
    for name, g, r, lw in zip(("dq", "dk", "dv", "dqv"), got, ref, low):
        assert_close_tolerance(g, r, lw, factor=3.0, name=name)
    # decode: one query over a 4097-key cache
    kc = torch.randn(B, 4097, 1, d, device=dev, dtype=dtype)
    vc = torch.randn(B, 4097, 1, dv, device=dev, dtype=dtype)
    qd, qvd = torch.randn(B, 1, h, d, device=dev, dtype=dtype), torch.randn(B, 1, h, dv, device=dev, dtype=dtype)
    got = fa3.flash_attn_with_kvcache(qd, kc, vc, qv=qvd, cache_seqlens=torch.tensor([4097, 1234], device=dev,
                                                                                    dtype=torch.int32))
    for b, n in ((0, 4097), (1, 1234)):
        w, _ = oracle(qd[b:b + 1].double(), kc[b:b + 1, :n].double(), vc[b:b + 1, :n].double(),
                      qvd[b:b + 1].double(), torch.float64)
        lw, _ = oracle(qd[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], qvd[b:b + 1], dtype)
        assert_close_tolerance(got[b:b + 1], w, lw, name="decode")
