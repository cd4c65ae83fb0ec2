"""FA3's low-level ops ``_flash_attn_forward`` / ``_flash_attn_backward`` (what context-parallel code calls),
against culmen's public FA3 functions and their autograd, on the CPU reference path in float64."""

from __future__ import annotations

import pytest
import torch

import culmen.flash_attn_3 as fa3
from culmen.flash_attn_3 import _flash_attn_backward, _flash_attn_forward, round_up_headdim

F64 = torch.float64


def _qkv(B, sq, sk, h, hk, d, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, sq, h, d, dtype=F64, generator=g)
    k = torch.randn(B, sk, hk, d, dtype=F64, generator=g)
    v = torch.randn(B, sk, hk, dv or d, dtype=F64, generator=g)
    return q, k, v


def _autograd(fn, q, k, v, dout):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fn(qq, kk, vv), (qq, kk, vv), dout)


def test_round_up_headdim():
    assert [round_up_headdim(x) for x in (1, 64, 65, 96, 100, 128, 160, 192, 200, 256, 512)] == \
        [64, 64, 96, 96, 128, 128, 192, 192, 256, 256, 256]
    with pytest.raises(TypeError, match="head_size"):
        round_up_headdim(64.0)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size_left=3, window_size_right=1, softcap=2.0),
                                  dict(causal=True, dv=8), dict(attention_chunk=4)])
def test_dense_forward_and_backward_match_autograd(opts):
    opts = dict(opts)
    dv = opts.pop("dv", None)
    q, k, v = _qkv(2, 9, 13, 4, 2, 16, dv)
    out, lse, acc, lse_acc = _flash_attn_forward(q, k, v, softmax_scale=0.3, **opts)
    window = (opts.pop("window_size_left", -1), opts.pop("window_size_right", -1))
    ref_out, ref_lse = fa3.flash_attn_func(q, k, v, 0.3, window_size=window, return_attn_probs=True, **opts)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    assert acc.numel() == 0 and lse_acc.numel() == 0 and acc.dtype == torch.float32
    if opts.get("attention_chunk"):
        return  # FA3's backward op takes no attention_chunk
    dout = torch.randn_like(out)
    dq, dk, dv_ = (torch.full_like(t, float("nan")) for t in (q, k, v))
    d = _flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv_, softmax_scale=0.3,
                             is_causal=opts.get("causal", False), window_size_left=window[0],
                             window_size_right=window[1], softcap=opts.get("softcap", 0.0))
    ref = _autograd(lambda a, b, c: fa3.flash_attn_func(a, b, c, 0.3, window_size=window, **opts), q, k, v, dout)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv_), ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)
    torch.testing.assert_close(d, (dout * out).sum(-1).permute(0, 2, 1).float())


def test_out_buffer_and_default_scale():
    q, k, v = _qkv(1, 5, 7, 2, 2, 16)
    buf = torch.empty(1, 5, 2, 16, dtype=F64)
    out, lse, _, _ = _flash_attn_forward(q, k, v, out_=buf)
    assert out is buf
    torch.testing.assert_close(out, fa3.flash_attn_func(q, k, v), rtol=0, atol=0)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    _flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    for got, want in zip((dq, dk, dv), _autograd(fa3.flash_attn_func, q, k, v, dout)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="out_"):
        _flash_attn_forward(q, k, v, out_=torch.empty(1, 5, 2, 8, dtype=F64))


def _packed(B, lens_q, lens_k, h, hk, d, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, dtype=F64, generator=g)
    k = torch.randn(sum(lens_k), hk, d, dtype=F64, generator=g)
    v = torch.randn(sum(lens_k), hk, d, dtype=F64, generator=g)
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) for lens in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("used", [False, True])
def test_varlen_forward_and_backward_match_autograd(used):
    q, k, v, cu_q, cu_k = _packed(3, [5, 1, 7], [6, 9, 4], 4, 2, 16)
    su_q = torch.tensor([4, 1, 5], dtype=torch.int32) if used else None
    su_k = torch.tensor([6, 3, 2], dtype=torch.int32) if used else None
    kw = dict(causal=True, softmax_scale=0.25)
    out, lse, _, _ = _flash_attn_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=su_q,
                                         seqused_k=su_k, max_seqlen_q=7, max_seqlen_k=9, **kw)

    def ref_fn(a, b, c, lse=False):
        return fa3.flash_attn_varlen_func(a, b, c, cu_q, cu_k, 7, 9, su_q, su_k, return_attn_probs=lse, **kw)

    ref_out, ref_lse = ref_fn(q, k, v, True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    d = _flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, su_q, su_k, 7, 9, dq, dk, dv, 0.25, True)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), _autograd(ref_fn, q, k, v, dout)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)
    assert d.shape == (4, q.shape[0])


def test_padded_q_with_seqused_against_packed_keys():
    """A padded ``q`` (no cu_seqlens_q) with ``seqused_q`` beside packed keys with ``seqused_k``."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 2, 8, dtype=F64, generator=g)
    k = torch.randn(11, 1, 8, dtype=F64, generator=g)
    v = torch.randn(11, 1, 8, dtype=F64, generator=g)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    su_q, su_k = torch.tensor([6, 3], dtype=torch.int32), torch.tensor([4, 6], dtype=torch.int32)

    def ref_fn(a, b, c, lse=False):
        return fa3.flash_attn_varlen_func(a, b, c, None, cu_k, None, 6, su_q, su_k, return_attn_probs=lse)

    out, lse = ref_fn(q, k, v, True)
    got_out, got_lse, _, _ = _flash_attn_forward(q, k, v, cu_seqlens_k=cu_k, max_seqlen_k=6, seqused_q=su_q,
                                                 seqused_k=su_k)
    torch.testing.assert_close(got_out, out, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, lse, rtol=0, atol=0)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    _flash_attn_backward(dout, q, k, v, out, lse, None, cu_k, su_q, su_k, None, 6, dq, dk, dv)
    for got, want in zip((dq, dk, dv), _autograd(ref_fn, q, k, v, dout)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # past the used lengths (query rows 3.. of batch 1, key row 4 of batch 0): zero gradients
    assert (dq[1, 3:] == 0).all() and (dk[4] == 0).all() and (dv[4] == 0).all()


def test_backward_uses_the_given_out_and_lse():
    """A ring step: the keys in two halves, each half's forward, their outputs merged by lse; each half's
    backward with the merged out/lse gives that half's share, and the shares add up to full attention's."""
    q, k, v = _qkv(1, 6, 10, 2, 2, 16, seed=4)
    halves = [(k[:, :5], v[:, :5]), (k[:, 5:], v[:, 5:])]
    parts = [_flash_attn_forward(q, kk, vv)[:2] for kk, vv in halves]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(part_lse - lse).permute(0, 2, 1)[..., None] for o, part_lse in parts)
    dout = torch.randn_like(out)
    grads = []
    for kk, vv in halves:
        dq, dk, dv = (torch.empty_like(t) for t in (q, kk, vv))
        _flash_attn_backward(dout, q, kk, vv, out, lse, dq=dq, dk=dk, dv=dv)
        grads.append((dq, dk, dv))
    full = _autograd(fa3.flash_attn_func, q, k, v, dout)
    torch.testing.assert_close(grads[0][0] + grads[1][0], full[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 1), full[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 1), full[2], rtol=1e-10, atol=1e-10)


def test_kv_cache_route_writes_the_new_keys():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 4, 16, dtype=F64, generator=g)
    k_cache, v_cache = (torch.randn(2, 12, 2, 16, dtype=F64, generator=g) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 16, dtype=F64, generator=g) for _ in range(2))
    seqlens = torch.tensor([3, 8], dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse, _, _ = _flash_attn_forward(q, k_cache, v_cache, k_new, v_new, seqused_k=seqlens, causal=True)
    ref_out, ref_lse, _, _ = fa3.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                                         causal=True, return_softmax_lse=True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    torch.testing.assert_close(k_cache, kc, rtol=0, atol=0)
    assert torch.equal(k_cache[0, 3], k_new[0, 0]) and torch.equal(v_cache[1, 8], v_new[1, 0])


def test_bad_arguments_name_themselves():
    q, k, v = _qkv(1, 4, 4, 2, 2, 16)
    out, lse, _, _ = _flash_attn_forward(q, k, v)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="dq must be"):
        _flash_attn_backward(dout, q, k, v, out, lse, dq=torch.empty(1, 4, 2, 8, dtype=F64))
    with pytest.raises(ValueError, match="sm_margin"):
        _flash_attn_backward(dout, q, k, v, out, lse, sm_margin=-1)
    with pytest.raises(TypeError, match="softmax_lse"):
        _flash_attn_backward(dout, q, k, v, out, None)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        _flash_attn_forward(q, k, v, k[:, :1], v[:, :1], cu_seqlens_k=cu, max_seqlen_k=4)
