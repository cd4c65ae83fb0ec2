"""``S_dmask`` (``return_attn_probs=True``) in flash_attn 2.x's layout (issue 14, item 7).

With dropout, flash_attn returns ``(batch, nheads, round128(seqlen_q), round128(seqlen_k))`` (the varlen
forms round ``max_seqlen``; each sequence starts at row and column 0) holding ``exp(s - m)``, where ``m``
is its forward's running row max when it reaches the entry's 128-key block (it walks the key blocks from
the last one down), negated where the entry was dropped; its tests read the keep-mask from the sign,
rescale the magnitudes with ``_get_block_size_n`` and the lse, and rebuild the output. These tests do
the same, independently, in float64: the mask the sign encodes must be exactly the one applied to
``out``, and the magnitudes must give back the probabilities.
"""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from culmen.flash_attn.flash_attn_interface import _get_block_size_n

P = 0.17


def _r128(n: int) -> int:
    return (n + 127) // 128 * 128


def _scores(q, k, causal, window, alibi):
    """float64 scores ``(B, h, sq, sk)`` of one dense batch, masked entries ``-inf``, and the mask."""
    B, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(h // hk, 2)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kk) * d ** -0.5
    rel = torch.arange(sk).view(1, sk) - (torch.arange(sq).view(sq, 1) + sk - sq)
    if alibi is not None:
        s = s - alibi.double().view(1, h, 1, 1) * rel.abs()
    vis = torch.ones(sq, sk, dtype=torch.bool)
    right = 0 if causal else window[1]
    if right >= 0:
        vis &= rel <= right
    if window[0] >= 0:
        vis &= rel >= -window[0]
    return s.masked_fill(~vis, float("-inf")), vis.expand(B, h, sq, sk)


def _softmax(s):
    lse = torch.logsumexp(s, -1, keepdim=True)
    return torch.exp(s - lse).nan_to_num(0.0), lse


def _rescale(mag, s, lse):
    """flash_attn's normalisation of ``|S_dmask|``: times ``exp(m - lse)`` with ``m`` the max of the scores
    over the entry's key block of ``_get_block_size_n`` columns and all later blocks."""
    bn = _get_block_size_n(None, 64, True, False)
    blocks = torch.stack([c.amax(-1) for c in s.split(bn, dim=-1)], -1)
    running = blocks.flip(-1).cummax(-1).values.flip(-1)
    parts = [a * torch.exp(running[..., i:i + 1] - lse) for i, a in enumerate(mag.split(bn, dim=-1))]
    return torch.cat(parts, -1).nan_to_num(0.0)


def _check_block(out, S, q, k, v, causal, window, alibi, out_tol):
    """One dense batch: ``S (B, h, sq, sk)`` cut out of ``S_dmask``; ``out (B, sq, h, d)``."""
    s, vis = _scores(q, k, causal, window, alibi)
    p, lse = _softmax(s)
    h, hk = q.shape[2], k.shape[2]
    vv = v.double().repeat_interleave(h // hk, 2)
    keep = ~torch.signbit(S)  # the sign bit of every entry (masked ones are +-0)
    rebuilt = torch.einsum("bhij,bjhd->bihd", p * keep / (1 - P), vv)
    torch.testing.assert_close(out.double(), rebuilt, **out_tol)
    # flash_attn's tests read ``S >= 0`` (so -0 counts as kept): the same output, -0 entries have p ~ 0.
    rebuilt_ge = torch.einsum("bhij,bjhd->bihd", p * (S >= 0) / (1 - P), vv)
    torch.testing.assert_close(out.double(), rebuilt_ge, **out_tol)
    mag_tol = dict(atol=1e-6, rtol=1e-5) if S.dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(_rescale(S.abs().double(), s, lse), p, **mag_tol)
    assert (S.abs()[~vis] == 0).all()  # masked: +-0
    if vis.sum() >= 2000:  # enough entries for the rate (std ~0.008)
        dropped = (~keep & vis).sum().item() / vis.sum().item()
        assert abs(dropped - P) < 0.04, dropped


def _assert_zero_padding(S, rows, cols):
    """Outside ``[:rows, :cols]``: +0 (no sign bit), as flash_attn's tests zero it anyway."""
    for part in (S[..., rows:, :], S[..., :, cols:]):
        assert (part == 0).all() and not torch.signbit(part).any()


DENSE = {
    # name: (sq, sk, h, hk, d, causal, window, alibi, form)
    "q1_k147_mqa": (1, 147, 6, 1, 32, False, (-1, -1), False, "func"),
    "113x211_causal_gqa": (113, 211, 4, 2, 32, True, (-1, -1), False, "func"),
    "200_causal_qkvpacked": (200, 200, 2, 2, 64, True, (-1, -1), False, "qkvpacked"),
    "97_window_kvpacked": (97, 97, 4, 2, 80, False, (20, 5), False, "kvpacked"),
    "64x300_alibi": (64, 300, 2, 2, 16, False, (-1, -1), True, "func"),
    "300x64_causal_rows_without_keys": (300, 64, 2, 1, 16, True, (-1, -1), False, "func"),
}


@pytest.mark.parametrize(("name", "dtype"), [(n, torch.float32) for n in DENSE]
                         + [("q1_k147_mqa", torch.float16), ("97_window_kvpacked", torch.float16)])
def test_dense_s_dmask_layout_and_mask(name, dtype):
    sq, sk, h, hk, d, causal, window, alibi, form = DENSE[name]
    B = 2 if sq * sk < 10_000 else 1  # the Philox replay is the cost of these CPU tests
    torch.manual_seed(sum(map(ord, name)))
    q = torch.randn(B, sq, h, d).to(dtype)
    k, v = torch.randn(B, sk, hk, d).to(dtype), torch.randn(B, sk, hk, d).to(dtype)
    slopes = torch.rand(h) * 0.3 if alibi else None
    kw = dict(causal=causal, window_size=window, alibi_slopes=slopes, return_attn_probs=True)
    if form == "qkvpacked":
        out, lse, S = flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), P, **kw)
    elif form == "kvpacked":
        out, lse, S = flash_attn_kvpacked_func(q, torch.stack([k, v], 2), P, **kw)
    else:
        out, lse, S = flash_attn_func(q, k, v, P, **kw)
    assert S.shape == (B, h, _r128(sq), _r128(sk)) and S.dtype == dtype
    assert out.is_contiguous()
    _assert_zero_padding(S, sq, sk)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    _check_block(out, S[..., :sq, :sk], q, k, v, causal, window, slopes, tol)


@pytest.mark.parametrize("form", ["func", "kvpacked", "qkvpacked"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_s_dmask_per_sequence(form, causal):
    """Varlen: ``(B, h, round128(max_seqlen_q), round128(max_seqlen_k))``, sequence ``b`` at ``S[b, :, :len_q,
    :len_k]``, +0 elsewhere; each sequence's block is flash_attn's dense layout of that sequence."""
    torch.manual_seed(3)
    h, hk, d = 2, (2 if form == "qkvpacked" else 1), 32
    lens_q = [5, 131, 23] if form != "qkvpacked" else [97, 1, 40]
    lens_k = [60, 133, 9] if form != "qkvpacked" else lens_q
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    mq, mk = max(lens_q), max(lens_k)
    q = torch.randn(sum(lens_q), h, d)
    k, v = torch.randn(sum(lens_k), hk, d), torch.randn(sum(lens_k), hk, d)
    kw = dict(causal=causal, return_attn_probs=True)
    if form == "qkvpacked":
        out, _, S = flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu_q, mq, P, **kw)
    elif form == "kvpacked":
        out, _, S = flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, cu_k, mq, mk, P, **kw)
    else:
        out, _, S = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, P, **kw)
    assert S.shape == (3, h, _r128(mq), _r128(mk)) and out.is_contiguous()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        Sb = S[b:b + 1]
        _assert_zero_padding(Sb, lq, lk)
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        _check_block(out[None, qs], Sb[..., :lq, :lk], q[None, qs], k[None, ks], v[None, ks], causal, (-1, -1),
                     None, dict(atol=1e-5, rtol=1e-4))


def test_no_dropout_gives_normalized_probabilities():
    """Without dropout flash_attn returns an empty tensor; culmen's superset: the probabilities."""
    q, k, v = torch.randn(2, 7, 2, 16), torch.randn(2, 150, 2, 16), torch.randn(2, 150, 2, 16)
    _, _, S = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    s, _ = _scores(q, k, True, (-1, -1), None)
    torch.testing.assert_close(S[..., :7, :150].double(), _softmax(s)[0], atol=1e-6, rtol=1e-5)
    _assert_zero_padding(S, 7, 150)


def test_triton_backend_returns_the_same_s_dmask(triton_backend):
    """``return_attn_probs`` runs the reference on every backend: the same ``S_dmask`` and output."""
    q, k, v = torch.randn(1, 20, 2, 16), torch.randn(1, 140, 2, 16), torch.randn(1, 140, 2, 16)
    torch.manual_seed(5)
    out, _, S = flash_attn_func(q, k, v, P, causal=True, return_attn_probs=True)
    _check_block(out, S[..., :20, :140], q, k, v, True, (-1, -1), None, dict(atol=1e-5, rtol=1e-4))
