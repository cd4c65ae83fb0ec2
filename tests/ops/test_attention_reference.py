"""The attention reference and ops (culmen.ops.attention) against a direct float64 implementation."""

from __future__ import annotations

import pytest
import torch

from culmen.ops.attention import attention_ref, dropout_keep_mask, flash_attn, flash_attn_varlen, philox_rand
from culmen.testing import assert_close_tolerance


def naive(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, keep=None, p=0.0, scale=None,
          dtype=torch.float64):
    """softmax(QK^T)V written plainly: heads expanded, one additive bias matrix, per-row empty check."""
    B, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qq, kk, vv = (t.to(dtype) for t in (q, k, v))
    kk = kk.repeat_interleave(h // hk, dim=2)
    vv = vv.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", qq, kk) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    rows = torch.arange(sq).view(sq, 1) + (sk - sq)  # the key column aligned with each query
    cols = torch.arange(sk).view(1, sk)
    if alibi is not None:
        slopes = alibi.to(dtype).reshape(-1, h)  # (1 or B, h)
        s = s - slopes[:, :, None, None] * (cols - rows).abs().to(dtype)
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        allowed &= cols - rows <= right
    if left >= 0:
        allowed &= rows - cols <= left
    s = s.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(-1).view(1, 1, sq, 1)
    s_safe = torch.where(has_key, s, torch.zeros_like(s))
    a = torch.softmax(s_safe, dim=-1) * has_key
    lse = torch.where(has_key[..., 0], torch.logsumexp(s_safe, -1), torch.full_like(s[..., 0], float("inf")))
    if keep is not None:
        a = a * keep / (1 - p)
    return torch.einsum("bhij,bjhd->bihd", a, vv), lse


def rand_qkv(B, sq, sk, h, hk, d, dtype=torch.float32, grad=False):
    q = torch.randn(B, sq, h, d, dtype=dtype)
    k = torch.randn(B, sk, hk, d, dtype=dtype)
    v = torch.randn(B, sk, hk, d, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


CASES = {
    "causal_sq<sk": dict(sq=5, sk=9, causal=True),
    "causal_sq>sk": dict(sq=9, sk=5, causal=True),
    "window": dict(sq=7, sk=11, window=(2, 1)),
    "window_left_only": dict(sq=10, sk=6, window=(3, -1)),
    "window_causal": dict(sq=8, sk=8, window=(2, 3), causal=True),
    "softcap": dict(sq=6, sk=7, softcap=2.0),
    "alibi_h": dict(sq=6, sk=9, alibi="h", causal=True),
    "alibi_bh": dict(sq=7, sk=5, alibi="bh"),
    "gqa": dict(sq=6, sk=8, h=6, hk=2, causal=True),
    "mqa_all": dict(sq=5, sk=13, h=4, hk=1, window=(4, 2), softcap=3.0, alibi="h"),
}


def _setup(case, dtype=torch.float32, grad=False):
    c = dict(CASES[case])
    B, h, hk, d = 2, c.pop("h", 4), c.pop("hk", 4), 16
    q, k, v = rand_qkv(B, c.pop("sq"), c.pop("sk"), h, hk, d, dtype, grad)
    alibi = c.pop("alibi", None)
    if alibi == "h":
        alibi = torch.rand(h) * 0.5
    elif alibi == "bh":
        alibi = torch.rand(B, h) * 0.5
    return q, k, v, dict(causal=c.get("causal", False), window=c.get("window", (-1, -1)),
                         softcap=c.get("softcap", 0.0), alibi=alibi)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_forward_matches_naive(case):
    q, k, v, f = _setup(case)
    out, lse = attention_ref(q, k, v, causal=f["causal"], window_size=f["window"], softcap=f["softcap"],
                             alibi_slopes=f["alibi"])
    ref, ref_lse = naive(q, k, v, **f)
    lo, lo_lse = naive(q, k, v, **f, dtype=torch.float32)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close_tolerance(out, ref, lo, name="out")
    assert_close_tolerance(lse, ref_lse, lo_lse, name="lse")


@pytest.mark.parametrize("case", ["causal_sq>sk", "window", "softcap", "alibi_bh", "gqa", "mqa_all"])
def test_op_gradients_match_float64(case):
    q, k, v, f = _setup(case, grad=True)
    out, lse, _ = flash_attn(q, k, v, causal=f["causal"], window_size=f["window"], softcap=f["softcap"],
                             alibi_slopes=f["alibi"])
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = [t.grad for t in (q, k, v)]
    assert grads[1].shape == k.shape  # dk/dv per KV head
    for dtype in (torch.float64, torch.float32):
        for t in (q, k, v):
            t.grad = None
        r, _ = naive(q, k, v, **f, dtype=dtype)
        r.backward(dout.to(dtype))
        if dtype == torch.float64:
            hi = [t.grad.clone() for t in (q, k, v)]
        else:
            lo = [t.grad.clone() for t in (q, k, v)]
    for name, g, h_, l_ in zip("qkv", grads, hi, lo):
        assert_close_tolerance(g, h_, l_, name=f"d{name}")


def test_op_gradients_bf16():
    q, k, v, f = _setup("gqa", dtype=torch.bfloat16, grad=True)
    out, _, _ = flash_attn(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = [t.grad for t in (q, k, v)]
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    res = {}
    for dtype in (torch.float64, torch.bfloat16):
        for t in (q, k, v):
            t.grad = None
        r, _ = naive(q, k, v, causal=True, dtype=dtype)
        r.backward(dout.to(dtype))
        res[dtype] = (r.detach(), [t.grad.clone() for t in (q, k, v)])
    assert_close_tolerance(out, res[torch.float64][0], res[torch.bfloat16][0], name="out")
    for name, g, h_, l_ in zip("qkv", grads, res[torch.float64][1], res[torch.bfloat16][1]):
        assert_close_tolerance(g, h_, l_, factor=3.0, name=f"d{name}")


def test_fully_masked_rows_zero_not_nan():
    q, k, v = rand_qkv(1, 7, 3, 2, 2, 8, grad=True)
    out, lse, _ = flash_attn(q, k, v, causal=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))  # rows 0..3 see no key
    assert torch.isinf(lse[..., :4]).all() and (lse[..., :4] > 0).all()
    assert torch.isfinite(lse[..., 4:]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :4], torch.zeros_like(q.grad[:, :4]))
    # A window that excludes every key (sq >> sk with a narrow window) also gives zeros.
    out2, _ = attention_ref(q.detach(), k.detach(), v.detach(), window_size=(0, 0))
    assert not torch.isnan(out2).any()


def test_varlen_matches_per_sequence_dense():
    h, hk, d = 4, 2, 8
    cu_q = torch.tensor([0, 3, 9, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    q = torch.randn(10, h, d, requires_grad=True)
    k = torch.randn(14, hk, d, requires_grad=True)
    v = torch.randn(14, hk, d, requires_grad=True)
    alibi = torch.rand(3, h)
    kw = dict(causal=True, window_size=(3, -1), softcap=4.0)
    out, lse, _ = flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 7, alibi_slopes=alibi, **kw)
    assert out.shape == q.shape and lse.shape == (h, 10)
    ref_out, ref_lse = attention_ref(q.detach(), k.detach(), v.detach(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     alibi_slopes=alibi, **kw)
    torch.testing.assert_close(out, ref_out)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b in range(3):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (t.detach()[s][None].clone().requires_grad_() for t, s in ((q, sq_), (k, sk_), (v, sk_)))
        ob, lb, _ = flash_attn(qb, kb, vb, alibi_slopes=alibi[b:b + 1], **kw)
        torch.testing.assert_close(out[sq_], ob[0])
        torch.testing.assert_close(lse[:, sq_], lb[0])
        ob.backward(dout[sq_][None])
        torch.testing.assert_close(q.grad[sq_], qb.grad[0])
        torch.testing.assert_close(k.grad[sk_], kb.grad[0])
        torch.testing.assert_close(v.grad[sk_], vb.grad[0])


# Values of Triton's ``tl.rand(seed, offsets)`` (triton 3.9 interpreter), for offsets 0, 1, 2, 7.
TRITON_RAND = {
    42: [0.7740801572799683, 0.024562695994973183, 0.3482663035392761, 0.7167209386825562],
    2**33 + 17: [0.5194833278656006, 0.9975155591964722, 0.43045106530189514, 0.4472232460975647],
}


@pytest.mark.parametrize("seed", sorted(TRITON_RAND))
def test_philox_matches_triton_rand(seed):
    got = philox_rand(seed, torch.tensor([0, 1, 2, 7]))
    assert got.tolist() == TRITON_RAND[seed]


def test_dropout_mask_replay_and_rate():
    rng = torch.tensor([1234, 99], dtype=torch.int64)
    bidx = torch.arange(2)
    m1 = dropout_keep_mask(rng, 0.3, bidx, 4, 64, 64)
    m2 = dropout_keep_mask(rng.clone(), 0.3, bidx, 4, 64, 64)
    m3 = dropout_keep_mask(torch.tensor([1235, 99]), 0.3, bidx, 4, 64, 64)
    assert torch.equal(m1, m2) and not torch.equal(m1, m3)
    assert abs(m1.float().mean().item() - 0.7) < 0.01
    # Batch b of a two-batch mask equals the one-batch mask of index b (the counter layout).
    assert torch.equal(m1[1:], dropout_keep_mask(rng, 0.3, torch.tensor([1]), 4, 64, 64))


def test_dropout_forward_backward_consistent():
    torch.manual_seed(0)
    q, k, v = rand_qkv(2, 9, 12, 4, 2, 8, grad=True)
    p = 0.25
    torch.manual_seed(7)
    out, lse, S = flash_attn(q, k, v, p, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    out_again, _, S_again = flash_attn(q, k, v, p, causal=True, return_attn_probs=True)
    assert torch.equal(out, out_again) and torch.equal(S, S_again)
    assert S.shape == (2, 4, 128, 128)
    S = S[:, :, :9, :12]
    keep = ~torch.signbit(S)  # dropped entries are stored negated
    # flash_attn's layout: exp(s - running row max); 12 keys are one 128-key block, so the row max.
    scores = (torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(2, 2)) * 8 ** -0.5)
    scores = scores.masked_fill(torch.ones(9, 12, dtype=torch.bool).triu(12 - 9 + 1), float("-inf"))
    probs_ref = torch.exp(scores - scores.amax(-1, keepdim=True))
    torch.testing.assert_close(S.abs().double(), probs_ref, rtol=1e-4, atol=1e-6)
    frac = keep[probs_ref > 0].float().mean().item()
    assert 0.55 < frac < 0.95
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = [t.grad.clone() for t in (q, k, v)]
    res = {}
    for dtype in (torch.float64, torch.float32):
        for t in (q, k, v):
            t.grad = None
        r, _ = naive(q, k, v, causal=True, keep=keep.to(dtype), p=p, dtype=dtype)
        r.backward(dout.to(dtype))
        res[dtype] = (r.detach(), [t.grad.clone() for t in (q, k, v)])
    assert_close_tolerance(out, res[torch.float64][0], res[torch.float32][0], name="out")
    for name, g, h_, l_ in zip("qkv", grads, res[torch.float64][1], res[torch.float32][1]):
        assert_close_tolerance(g, h_, l_, name=f"d{name}")


def test_reference_explicit_mask_equals_rng_mask():
    q, k, v = rand_qkv(2, 6, 10, 2, 2, 8)
    rng = torch.tensor([5, 1000], dtype=torch.int64)
    mask = dropout_keep_mask(rng, 0.4, torch.arange(2), 2, 6, 10)
    a, la = attention_ref(q, k, v, dropout_p=0.4, rng_state=rng)
    b, lb = attention_ref(q, k, v, dropout_p=0.4, dropout_mask=mask)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(la, lb)


def test_reference_float64_and_deterministic_backward():
    q, k, v = rand_qkv(1, 5, 6, 2, 1, 8, dtype=torch.float64, grad=True)
    out, lse = attention_ref(q, k, v, softcap=1.5)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    ref, _ = naive(q, k, v, softcap=1.5)
    torch.testing.assert_close(out, ref)
    torch.manual_seed(3)
    o1, _, _ = flash_attn(q, k, v, 0.1, deterministic=True)
    g1 = torch.autograd.grad(o1.sum(), (q, k, v))
    torch.manual_seed(3)
    o2, _, _ = flash_attn(q, k, v, 0.1, deterministic=True)
    g2 = torch.autograd.grad(o2.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_dropout_mask_with_another_default_device():
    """The mask's scratch names its device: with ``meta`` as the default device (a script that sets
    ``torch.set_default_device("cuda")``) the CPU mask is unchanged."""
    rng = torch.tensor([1234, 99], dtype=torch.int64)
    bidx = torch.arange(2)
    want = dropout_keep_mask(rng, 0.3, bidx, 4, 16, 16)
    torch.set_default_device("meta")
    try:
        got = dropout_keep_mask(rng, 0.3, bidx, 4, 16, 16)
    finally:
        torch.set_default_device(None)
    assert got.device.type == "cpu" and torch.equal(got, want)
