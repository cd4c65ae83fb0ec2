"""``culmen.flash_attn_3`` (FA3's ``flash_attn_interface``) against float64 attention written out here:
return conventions, GQA, causal / local / softcap, gradients, ``seqused_q/k`` with random used lengths,
padded and packed sides, the KV cache with paged ``page_table`` of odd page sizes, packed queries and new
keys, ``rotary_seqlens``, the accepted-but-inert knobs, ``qv``'s argument checks,
and the ``flash_attn_interface`` import alias."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import culmen.flash_attn_3 as fa3
from culmen.ops.rotary.reference import rotary_emb_ref
from culmen.testing import assert_close_tolerance
from culmen.testing.attention import plain


def _lse64(q, k, causal=False, window=(-1, -1), softcap=0.0):
    """float64 log-sum-exp ``(B, h, sq)`` of the scaled (capped, masked) scores; +inf for rows with no key."""
    B, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(h // hk, 2)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kk) * d ** -0.5
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    rel = torch.arange(sk).view(1, sk) - (torch.arange(sq).view(sq, 1) + sk - sq)
    right = 0 if causal else window[1]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        ok &= rel <= right
    if window[0] >= 0:
        ok &= rel >= -window[0]
    lse = torch.logsumexp(s.masked_fill(~ok, float("-inf")), -1)
    return torch.where(ok.any(-1), lse, torch.full_like(lse, float("inf")))


def _qkv(B, sq, sk, h, hk, d, dtype=torch.bfloat16, grad=True):
    return [torch.randn(B, s, n, d, dtype=dtype, requires_grad=grad) for s, n in ((sq, h), (sk, hk), (sk, hk))]


# ------------------------------------------------------------------------------------------- dense

DENSE = {
    "gqa_causal": dict(sq=37, sk=53, h=4, hk=2, d=24, causal=True),
    "mqa_window_softcap": dict(sq=19, sk=19, h=3, hk=1, d=40, window=(5, 2), softcap=8.0),
    "longer_q_causal": dict(sq=21, sk=9, h=2, hk=2, d=16, causal=True),
}


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
@pytest.mark.parametrize("case", list(DENSE))
def test_flash_attn_func_matches_float64(request, backend, case):
    request.getfixturevalue(backend)
    c = DENSE[case]
    causal, window, softcap = c.get("causal", False), c.get("window", (-1, -1)), c.get("softcap", 0.0)
    q, k, v = _qkv(2, c["sq"], c["sk"], c["h"], c["hk"], c["d"])
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                   deterministic=True, return_attn_probs=True)
    kw = dict(causal=causal, window=window, softcap=softcap)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = plain(q64, k64, v64, torch.float64, **kw)
    lo = plain(q, k, v, torch.bfloat16, **kw)
    assert_close_tolerance(out, want, lo, name="out")
    assert lse.shape == (2, c["h"], c["sq"]) and lse.dtype == torch.float32
    assert_close_tolerance(lse, _lse64(q, k, **kw), None, atol=2e-4, name="lse")
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    low = torch.autograd.grad(lo, (q, k, v), dout)
    for name, g, r, lw in zip(("dq", "dk", "dv"), got, ref, low):
        assert_close_tolerance(g, r, lw, factor=3.0, name=name)
    # FA3's convention: a 2-tuple with return_attn_probs, the bare tensor without
    assert isinstance(fa3.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap),
                      torch.Tensor)


def test_knobs_accepted_results_identical():
    q, k, v = _qkv(2, 9, 17, 4, 2, 16, torch.float32, grad=False)
    base = fa3.flash_attn_func(q, k, v, causal=True)
    for kw in (dict(num_splits=4), dict(num_splits=0, pack_gqa=True), dict(pack_gqa=False, sm_margin=8),
               dict(window_size=[-1, 0])):
        assert torch.equal(fa3.flash_attn_func(q, k, v, causal=True, **kw), base), kw
    with pytest.raises(ValueError, match="num_splits"):
        fa3.flash_attn_func(q, k, v, num_splits=1000)
    with pytest.raises(TypeError, match="pack_gqa"):
        fa3.flash_attn_func(q, k, v, pack_gqa="yes")


def test_qkvpacked_5d_and_gqa_4d():
    B, S, h, hk, d = 2, 13, 4, 2, 16
    qkv = torch.randn(B, S, 3, h, d, requires_grad=True)
    out, lse = fa3.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    q, k, v = (t.detach().double() for t in qkv.unbind(2))
    torch.testing.assert_close(out.double(), plain(q, k, v, torch.float64, causal=True), atol=2e-5, rtol=1e-4)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and bool(qkv.grad.abs().sum() > 0)
    # 4-D: q heads, then k heads, then v heads along dim 2
    packed = torch.randn(B, S, h + 2 * hk, d, requires_grad=True)
    o4 = fa3.flash_attn_qkvpacked_func(packed, num_heads_q=h, window_size=(3, 3))
    q4, k4, v4 = (t.detach().double() for t in packed.split([h, hk, hk], 2))
    torch.testing.assert_close(o4.double(), plain(q4, k4, v4, torch.float64, window=(3, 3)), atol=2e-5, rtol=1e-4)
    o4.square().sum().backward()
    assert bool(packed.grad[:, :, h + hk:].abs().sum() > 0)  # v's heads got their gradient
    with pytest.raises(ValueError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(packed)


# ------------------------------------------------------------------------------------------ varlen


def _varlen_expected(q, k, v, lq, lk, used_q, used_k, causal, window):
    """Per sequence: plain float64 attention of the used prefixes; unused query rows are 0 / lse +inf."""
    outs, lses = [], []
    for b in range(len(lq)):
        qs = q[b][: lq[b]] if q.dim() == 4 else q[sum(lq[:b]): sum(lq[:b + 1])]
        ks = k[b][: lk[b]] if k.dim() == 4 else k[sum(lk[:b]): sum(lk[:b + 1])]
        vs = v[b][: lk[b]] if v.dim() == 4 else v[sum(lk[:b]): sum(lk[:b + 1])]
        uq, uk = used_q[b], used_k[b]
        o = torch.zeros(qs.shape, dtype=torch.float64)
        lse = torch.full((qs.shape[1], qs.shape[0]), float("inf"), dtype=torch.float64)
        if uq:
            qu, ku, vu = qs[None, :uq].double(), ks[None, :uk].double(), vs[None, :uk].double()
            o[:uq] = plain(qu, ku, vu, torch.float64, causal=causal, window=window)[0]
            lse[:, :uq] = _lse64(qu, ku, causal, window)[0]
        outs.append(o)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
@pytest.mark.parametrize("layout", ["packed", "padded_q", "padded_both"])
def test_varlen_seqused_random(request, backend, layout):
    request.getfixturevalue(backend)
    g = torch.Generator().manual_seed(7)
    B, h, hk, d = 3, 4, 2, 16
    causal, window = layout != "padded_both", ((-1, -1) if layout != "padded_both" else (4, 1))
    if layout == "packed":
        lq, lk = [7, 3, 11], [9, 1, 14]
    else:
        lq, lk = [9] * B, ([12] * B if layout == "padded_both" else [9, 1, 14])
    used_q = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in lq]
    used_k = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in lk]
    used_q[0], used_k[0] = lq[0], lk[0]  # one slot fully used
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    if layout == "packed":
        q = torch.randn(sum(lq), h, d, requires_grad=True)
        k, v = (torch.randn(sum(lk), hk, d, requires_grad=True) for _ in range(2))
        args = (cu(lq), cu(lk), max(lq), max(lk))
    elif layout == "padded_q":
        q = torch.randn(B, lq[0], h, d, requires_grad=True)
        k, v = (torch.randn(sum(lk), hk, d, requires_grad=True) for _ in range(2))
        args = (None, cu(lk), None, max(lk))
    else:
        q = torch.randn(B, lq[0], h, d, requires_grad=True)
        k, v = (torch.randn(B, lk[0], hk, d, requires_grad=True) for _ in range(2))
        args = (None, None, None, None)
    sq_t, sk_t = torch.tensor(used_q, dtype=torch.int32), torch.tensor(used_k, dtype=torch.int32)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, *args, seqused_q=sq_t, seqused_k=sk_t, causal=causal,
                                          window_size=window, return_attn_probs=True)
    assert out.shape == q.shape
    outs, lses = _varlen_expected(q.detach(), k.detach(), v.detach(), lq, lk, used_q, used_k, causal, window)
    if q.dim() == 3:
        want, want_lse = torch.cat(outs), torch.cat(lses, 1)
    else:
        want, want_lse = torch.stack(outs), torch.stack(lses)
    assert lse.shape == want_lse.shape
    torch.testing.assert_close(out.double(), want, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), want_lse, atol=3e-5, rtol=1e-5)
    # gradients: unused query rows and unused keys get exactly zero
    out.backward(torch.randn_like(out))
    for b in range(B):
        qrows = q.grad[b, used_q[b]:] if q.dim() == 4 else q.grad[sum(lq[:b]) + used_q[b]: sum(lq[:b + 1])]
        krows = k.grad[b, used_k[b]:] if k.dim() == 4 else k.grad[sum(lk[:b]) + used_k[b]: sum(lk[:b + 1])]
        assert bool((qrows == 0).all()) and bool((krows == 0).all()), b


def test_varlen_seqused_gradients_match_float64():
    B, S, h, d = 2, 11, 2, 16
    q, k, v = _qkv(B, S, S, h, h, d)
    used_q, used_k = torch.tensor([8, 11], dtype=torch.int32), torch.tensor([5, 10], dtype=torch.int32)
    out = fa3.flash_attn_varlen_func(q, k, v, None, None, None, None, seqused_q=used_q, seqused_k=used_k,
                                     causal=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(B):
        uq, uk = int(used_q[b]), int(used_k[b])
        sl = [t.detach()[b:b + 1] for t in (q, k, v)]
        q64, k64, v64 = (t.double().requires_grad_() for t in (sl[0][:, :uq], sl[1][:, :uk], sl[2][:, :uk]))
        ql, kl, vl = (t.clone().requires_grad_() for t in (sl[0][:, :uq], sl[1][:, :uk], sl[2][:, :uk]))
        want, lo = plain(q64, k64, v64, torch.float64, causal=True), plain(ql, kl, vl, torch.bfloat16, causal=True)
        assert_close_tolerance(out[b:b + 1, :uq], want, lo, name=f"out[{b}]")
        d_b = dout[b:b + 1, :uq]
        ref = torch.autograd.grad(want, (q64, k64, v64), d_b.double())
        low = torch.autograd.grad(lo, (ql, kl, vl), d_b)
        for name, g, r, lw, n in zip(("dq", "dk", "dv"), got, ref, low, (uq, uk, uk)):
            assert_close_tolerance(g[b:b + 1, :n], r, lw, factor=3.0, name=f"{name}[{b}]")


def test_varlen_seqused_out_of_range_rejected_on_cpu():
    q, k, v = _qkv(2, 5, 6, 2, 2, 16, torch.float32, grad=False)
    with pytest.raises(ValueError, match="seqused_k"):
        fa3.flash_attn_varlen_func(q, k, v, None, None, None, None, seqused_k=torch.tensor([6, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_q"):
        fa3.flash_attn_varlen_func(q, k, v, None, None, None, None, seqused_q=torch.tensor([-1, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="seqused_q"):
        fa3.flash_attn_varlen_func(q, k, v, None, None, None, None, seqused_q=torch.tensor([1, 2]))


def test_varlen_plain_matches_flash_attn2():
    from culmen.flash_attn import flash_attn_varlen_func as fa2_varlen

    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 8], dtype=torch.int32)
    q, k, v = torch.randn(9, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True, return_attn_probs=True)
    o2, l2, _ = fa2_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True, return_attn_probs=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2) and lse.shape == (2, 9)


# ---------------------------------------------------------------------------------------- kv cache


def _kv_expected(q_rows, k_cache, v_cache, new_k, new_v, seqlens, rot_off, cos, sin, causal, interleaved):
    """Per batch row (list inputs): rotate, append, attend over the row's keys in float64."""
    outs, lses = [], []
    kc, vc = k_cache.clone(), v_cache.clone()
    for b, qb in enumerate(q_rows):
        n0, kn, vn = int(seqlens[b]), new_k[b], new_v[b]
        sn, sq = kn.shape[0], qb.shape[0]
        if cos is not None:
            r0 = int(rot_off[b])
            kpos, qpos = torch.arange(r0, r0 + sn), (torch.arange(r0, r0 + sq) if causal else torch.full((sq,), r0))
            kn = rotary_emb_ref(kn[None].double(), cos[kpos][None].double(), sin[kpos][None].double(),
                                interleaved)[0].to(kc.dtype)
            qb = rotary_emb_ref(qb[None].double(), cos[qpos][None].double(), sin[qpos][None].double(),
                                interleaved)[0]
        kc[b, n0:n0 + sn], vc[b, n0:n0 + sn] = kn, vn
        kb, vb = kc[b:b + 1, : n0 + sn].double(), vc[b:b + 1, : n0 + sn].double()
        outs.append(plain(qb[None].double(), kb, vb, torch.float64, causal=causal)[0])
        lses.append(_lse64(qb[None].double(), kb, causal)[0])
    return outs, lses, kc, vc


def _paged(cache, page, n_pages_total, g):
    """A dense ``(B, S, hk, d)`` cache scattered into shuffled pages of ``page`` rows: (pages, page_table)."""
    B, S = cache.shape[:2]
    per = S // page
    perm = torch.randperm(n_pages_total, generator=g)[: B * per]
    pages = torch.randn(n_pages_total, page, *cache.shape[2:])
    pages[perm] = cache.reshape(B * per, page, *cache.shape[2:])
    return pages, perm.view(B, per).to(torch.int32)


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
@pytest.mark.parametrize("page", [1, 3, None])
def test_kvcache_paged_any_page_size(request, backend, page):
    request.getfixturevalue(backend)
    g = torch.Generator().manual_seed(3)
    B, S, h, hk, d, sn = 2, 12, 4, 2, 16, 2
    k_dense, v_dense = torch.randn(B, S, hk, d), torch.randn(B, S, hk, d)
    q, kn, vn = torch.randn(B, sn, h, d), torch.randn(B, sn, hk, d), torch.randn(B, sn, hk, d)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    ang = torch.rand(S, 4) * 3
    cos, sin = ang.cos(), ang.sin()
    outs, lses, kc_want, _ = _kv_expected(list(q), k_dense, v_dense, list(kn), list(vn), seqlens, seqlens, cos, sin,
                                          True, False)
    if page is None:
        k_cache, v_cache, table = k_dense.clone(), v_dense.clone(), None
    else:
        k_cache, table = _paged(k_dense, page, B * S // page + 3, g)
        v_cache, _ = _paged(v_dense, page, B * S // page + 3, torch.Generator().manual_seed(3))
    meta = fa3.get_scheduler_metadata(B, sn, S, h, hk, d, seqlens, torch.float32, page_size=page, causal=True)
    assert meta.dtype == torch.int32 and meta.dim() == 1
    res = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, None, cos, sin, seqlens, page_table=table,
                                      causal=True, rotary_interleaved=False, scheduler_metadata=meta, num_splits=3,
                                      pack_gqa=True, return_softmax_lse=True)
    assert len(res) == 4 and res[2].numel() == 0 and res[3].numel() == 0
    out, lse = res[0], res[1]
    torch.testing.assert_close(out.double(), torch.stack(outs), atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), torch.stack(lses), atol=3e-5, rtol=1e-5)
    dense_k = k_cache if table is None else k_cache[table.long()].reshape(B, S, hk, d)
    torch.testing.assert_close(dense_k, kc_want, atol=1e-6, rtol=1e-6)  # new keys appended in place


@pytest.mark.parametrize("backend", ["reference_backend", "triton_backend"])
def test_kvcache_packed_q_packed_new_rotary_seqlens(request, backend):
    """cu_seqlens_q + max_seqlen_q, cu_seqlens_k_new and rotary_seqlens, paged with page size 3."""
    request.getfixturevalue(backend)
    g = torch.Generator().manual_seed(5)
    B, S, h, hk, d = 3, 15, 2, 1, 16
    lq, ln = [2, 1, 3], [2, 0, 3]
    k_dense, v_dense = torch.randn(B, S, hk, d), torch.randn(B, S, hk, d)
    q_rows = [torch.randn(n, h, d) for n in lq]
    kn_rows, vn_rows = [torch.randn(n, hk, d) for n in ln], [torch.randn(n, hk, d) for n in ln]
    seqlens = torch.tensor([4, 7, 0], dtype=torch.int32)
    rot = torch.tensor([10, 3, 1], dtype=torch.int32)
    ang = torch.rand(S, 8) * 3
    cos, sin = ang.cos(), ang.sin()
    outs, lses, kc_want, vc_want = _kv_expected(q_rows, k_dense, v_dense, kn_rows, vn_rows, seqlens, rot, cos, sin,
                                                True, True)
    k_cache, table = _paged(k_dense, 3, 20, g)
    v_cache, _ = _paged(v_dense, 3, 20, torch.Generator().manual_seed(5))
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        torch.cat(q_rows), k_cache, v_cache, torch.cat(kn_rows), torch.cat(vn_rows), None, cos, sin, seqlens,
        page_table=table, cu_seqlens_q=cu(lq), cu_seqlens_k_new=cu(ln), max_seqlen_q=4, rotary_seqlens=rot,
        causal=True, return_softmax_lse=True)
    assert out.shape == (sum(lq), h, d) and lse.shape == (h, sum(lq))
    torch.testing.assert_close(out.double(), torch.cat(outs), atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), torch.cat(lses, 1), atol=3e-5, rtol=1e-5)
    dense_v = v_cache[table.long()].reshape(B, S, hk, d)
    torch.testing.assert_close(dense_v, vc_want)
    # the same call through batched q (no cu_seqlens_q) for equal lengths matches the dense fast path
    q2 = torch.randn(B, 1, h, d)
    kc2, vc2 = k_dense.clone(), v_dense.clone()
    a = fa3.flash_attn_with_kvcache(q2, kc2, vc2, cache_seqlens=seqlens, causal=True)
    b = fa3.flash_attn_with_kvcache(q2[:, 0], k_dense.clone(), v_dense.clone(), cache_seqlens=seqlens,
                                    cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32), max_seqlen_q=1, causal=True)
    torch.testing.assert_close(b.view(a.shape), a, atol=1e-6, rtol=1e-6)


def test_kvcache_bad_values_rejected_on_cpu():
    q, kc, vc = torch.randn(2, 1, 2, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    kn = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="exceed"):
        fa3.flash_attn_with_kvcache(q, kc, vc, kn, kn.clone(), cache_seqlens=torch.tensor([7, 0], dtype=torch.int32),
                                    cu_seqlens_k_new=torch.tensor([0, 2, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="scheduler_metadata"):
        fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, scheduler_metadata=torch.zeros(3))


# ----------------------------------------------------------------------------------------- qv checks


def test_qv_of_the_wrong_shape_or_dtype_raises():
    """``qv`` must be shaped like ``q`` with V's head dim, in q's dtype: each function names it (its numbers
    are tested in test_fa3_qv.py)."""
    q, k, v = _qkv(1, 4, 4, 2, 2, 16, torch.float32, grad=False)
    funcs = {
        "func": lambda **kw: fa3.flash_attn_func(q, k, v, **kw),
        "varlen": lambda **kw: fa3.flash_attn_varlen_func(q, k, v, None, None, None, None, **kw),
        "kvcache": lambda **kw: fa3.flash_attn_with_kvcache(q, k.clone(), v.clone(), cache_seqlens=4, **kw),
    }
    for f in funcs.values():
        with pytest.raises(ValueError, match="qv"):
            f(qv=torch.randn(1, 4, 2, 8))
        with pytest.raises(TypeError, match="qv"):
            f(qv=torch.randn(1, 4, 2, 16, dtype=torch.float64))


# ------------------------------------------------------------------------------------------- alias


def test_alias_in_process():
    from culmen import compat

    compat.install(force=True)
    try:
        import flash_attn_interface

        assert flash_attn_interface is fa3
        from flash_attn_interface import flash_attn_combine, flash_attn_func  # noqa: F401
    finally:
        compat.uninstall()


def test_alias_through_python_m_culmen_compat(tmp_path):
    script = tmp_path / "uses_fa3.py"
    script.write_text(textwrap.dedent("""
        import torch
        from flash_attn_interface import flash_attn_func, flash_attn_with_kvcache
        q = torch.randn(1, 3, 2, 16)
        out, lse = flash_attn_func(q, q, q, causal=True, return_attn_probs=True)
        print(flash_attn_func.__module__, tuple(out.shape), tuple(lse.shape))
    """))
    res = subprocess.run([sys.executable, "-m", "culmen.compat", str(script)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "culmen.flash_attn_3.interface (1, 3, 2, 16) (1, 2, 3)" in res.stdout
