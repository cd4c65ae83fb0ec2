"""``flash_attn_with_kvcache`` (kernel path under the interpreter and the reference), ``bert_padding``
and the paged ``block_table`` of ``flash_attn_varlen_func``, against plain per-row references."""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from culmen.flash_attn.bert_padding import pad_input, unpad_input, unpad_input_for_concatenated_sequences
from culmen.flash_attn.flash_attn_interface import _get_block_size_n
from culmen.ops.rotary.reference import rotary_emb_ref
from culmen.testing import assert_close_tolerance
from culmen.testing.attention import plain


def _expected(q, k_cache, v_cache, k, v, seqlens, leftpad, rows, causal, window, cos, sin, interleaved):
    """Row by row: rotate, append, attend over [leftpad, seqlens + s_new) with ``plain`` in float64."""
    kc, vc = k_cache.clone()[rows], v_cache.clone()[rows]
    outs = []
    for b in range(q.shape[0]):
        n0 = int(seqlens[b])
        s_new = 0 if k is None else k.shape[1]
        qb = q[b:b + 1]
        if cos is not None:
            pos = torch.arange(n0, n0 + s_new)
            local = window != (-1, -1)
            qpos = torch.arange(n0, n0 + q.shape[1]) if (causal or local) else torch.full((q.shape[1],), n0)
            qb = rotary_emb_ref(qb.double(), cos[qpos][None].double(), sin[qpos][None].double(), interleaved)
            if k is not None:
                kb = rotary_emb_ref(k[b:b + 1].double(), cos[pos][None].double(), sin[pos][None].double(),
                                    interleaved)
                kc[b, n0:n0 + s_new] = kb[0].to(kc.dtype)
        elif k is not None:
            kc[b, n0:n0 + s_new] = k[b]
        if v is not None:
            vc[b, n0:n0 + s_new] = v[b]
        k0 = 0 if leftpad is None else int(leftpad[b])
        outs.append(plain(qb, kc[b:b + 1, k0:n0 + s_new], vc[b:b + 1, k0:n0 + s_new], torch.float64, causal=causal,
                          window=window))
    return torch.cat(outs), kc, vc


CASES = {
    "decode_causal_rotary": dict(sq=1, s_new=1, causal=True, rotary=True, interleaved=True),
    "prefill_chunk_gqa": dict(sq=5, s_new=5, causal=True, h=4, hk=2, rotary=True, interleaved=False),
    "no_new_tokens_noncausal": dict(sq=3, s_new=0, causal=False),
    "leftpad_batch_idx_window": dict(sq=4, s_new=4, causal=True, leftpad=True, batch_idx=True, window=(6, 0)),
    "rotary_noncausal": dict(sq=2, s_new=2, causal=False, rotary=True, interleaved=True),
}


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
@pytest.mark.parametrize("case", list(CASES))
def test_kvcache_matches_row_reference(request, backend, case):
    request.getfixturevalue(backend)
    c = CASES[case]
    B, S, d, h, hk = 3, 40, 16, c.get("h", 2), c.get("hk", 2)
    q = torch.randn(B, c["sq"], h, d)
    k_cache, v_cache = torch.randn(B + 2, S, hk, d), torch.randn(B + 2, S, hk, d)
    k = torch.randn(B, c["s_new"], hk, d) if c["s_new"] else None
    v = torch.randn(B, c["s_new"], hk, d) if c["s_new"] else None
    seqlens = torch.tensor([7, 0, 21], dtype=torch.int32)
    leftpad = torch.tensor([3, 0, 5], dtype=torch.int32) if c.get("leftpad") else None
    rows = torch.tensor([4, 0, 2]) if c.get("batch_idx") else torch.arange(B)
    cos = sin = None
    if c.get("rotary"):
        ang = torch.rand(S, 4) * 3
        cos, sin = ang.cos(), ang.sin()
    window = c.get("window", (-1, -1))
    want, kc_want, vc_want = _expected(q, k_cache, v_cache, k, v, seqlens, leftpad, rows, c["causal"], window, cos,
                                       sin, c.get("interleaved", True))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, seqlens,
                                       cache_batch_idx=rows.to(torch.int32) if c.get("batch_idx") else None,
                                       cache_leftpad=leftpad, causal=c["causal"], window_size=window,
                                       rotary_interleaved=c.get("interleaved", True), return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (B, h, c["sq"])
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(k_cache[rows], kc_want, atol=1e-6, rtol=1e-6)  # appended in place
    torch.testing.assert_close(v_cache[rows], vc_want)


def test_kvcache_paged_equals_contiguous(triton_backend):
    B, page, nb, hk, d = 2, 8, 4, 2, 16
    pages_k, pages_v = torch.randn(12, page, hk, d), torch.randn(12, page, hk, d)
    table = torch.tensor([[5, 2, 9, 0], [1, 7, 3, 11]], dtype=torch.int32)
    dense_k = pages_k[table.long()].reshape(B, nb * page, hk, d).clone()
    dense_v = pages_v[table.long()].reshape(B, nb * page, hk, d).clone()
    q, kn, vn = torch.randn(B, 2, 4, d), torch.randn(B, 2, hk, d), torch.randn(B, 2, hk, d)
    seqlens = torch.tensor([9, 20], dtype=torch.int32)
    a = flash_attn_with_kvcache(q, pages_k, pages_v, kn, vn, cache_seqlens=seqlens, block_table=table, causal=True)
    b = flash_attn_with_kvcache(q, dense_k, dense_v, kn, vn, cache_seqlens=seqlens, causal=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(pages_k[table.long()].reshape(B, nb * page, hk, d), dense_k)


def test_kvcache_bad_input():
    q, kc = torch.randn(2, 1, 2, 16), torch.randn(2, 8, 2, 16)
    with pytest.raises(TypeError, match="cache_seqlens must be"):
        flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="k and v"):
        flash_attn_with_kvcache(q, kc, kc.clone(), k=torch.randn(2, 1, 2, 16))
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        flash_attn_with_kvcache(q, kc.double(), kc.double())


def test_unpad_pad_roundtrip_and_varlen_equals_masked_dense(triton_backend):
    B, S, h, d = 3, 11, 2, 16
    mask = torch.arange(S)[None, :] < torch.tensor([[11], [4], [7]])
    x = torch.randn(B, S, h, d, requires_grad=True)
    xu, idx, cu, mx, used = unpad_input(x, mask)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 11, 15, 22] and mx == 11 and used.tolist() == [11, 4, 7]
    back = pad_input(xu, idx, B, S)
    assert torch.equal(back[mask], x[mask]) and torch.equal(back[~mask], torch.zeros_like(back[~mask]))
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None, None].float().expand_as(x))
    out = flash_attn_varlen_func(xu, xu, xu, cu, cu, mx, mx, causal=True)
    for b, n in enumerate((11, 4, 7)):
        ref = flash_attn_func(x[b:b + 1, :n], x[b:b + 1, :n], x[b:b + 1, :n], causal=True)
        assert_close_tolerance(pad_input(out, idx, B, S)[b:b + 1, :n], ref.double(), ref, name=f"row {b}")
    xc, _, cu2, mx2 = unpad_input_for_concatenated_sequences(x, torch.tensor([[5, 6, 0] + [0] * 8,
                                                                             [4] + [0] * 10, [2, 2, 3] + [0] * 8]))
    assert cu2.tolist() == [0, 5, 11, 15, 17, 19, 22] and mx2 == 6 and xc.shape[0] == 22
    assert _get_block_size_n(None, 64, False, True) == 128


def test_varlen_block_table_equals_packed(triton_backend):
    page, hk, d = 4, 2, 16
    lens = [6, 9]
    pages_k, pages_v = torch.randn(8, page, hk, d), torch.randn(8, page, hk, d)
    table = torch.tensor([[3, 0, 6], [7, 1, 4]], dtype=torch.int32)
    cu = torch.tensor([0, 6, 15], dtype=torch.int32)
    q = torch.randn(15, 2, d)
    packed_k = torch.cat([pages_k[table[b].long()].reshape(-1, hk, d)[:n] for b, n in enumerate(lens)])
    packed_v = torch.cat([pages_v[table[b].long()].reshape(-1, hk, d)[:n] for b, n in enumerate(lens)])
    a = flash_attn_varlen_func(q, pages_k, pages_v, cu, cu, 9, 9, causal=True, block_table=table)
    b = flash_attn_varlen_func(q, packed_k, packed_v, cu, cu, 9, 9, causal=True)
    torch.testing.assert_close(a, b)
