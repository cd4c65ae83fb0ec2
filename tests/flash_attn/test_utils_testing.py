"""``flash_attn.utils.testing`` (flash_attn's test utilities): the masks, ``generate_qkv``'s packing and
pad functions, and ``attention_ref`` against culmen's attention (itself checked against float64 elsewhere)
and against a direct float64 formula."""

from __future__ import annotations

import pytest
import torch

import culmen.flash_attn_3 as fa3
from culmen.flash_attn import flash_attn_func, flash_attn_varlen_func
from culmen.flash_attn.utils import testing as T
from culmen.testing.attention import plain


def test_random_padding_masks():
    torch.manual_seed(0)
    m = T.generate_random_padding_mask(40, 12, "cpu", mode="random", zero_lengths=True)
    assert m.shape == (12, 40) and m.dtype == torch.bool
    lens = m.sum(-1)
    assert lens[0] == 0 and lens[5] == 0 and lens[10] == 0 and lens[-1] == 0
    assert all(20 <= n <= 40 for i, n in enumerate(lens.tolist()) if i % 5 and i != 11)
    assert torch.equal(m, torch.arange(40)[None] < lens[:, None])  # a prefix per row
    assert T.generate_random_padding_mask(7, 3, "cpu", mode="full").all()
    third = T.generate_random_padding_mask(30, 50, "cpu", mode="third").sum(-1)
    assert third.min() >= 10 and third.max() <= 30
    with pytest.raises(ValueError, match="mode"):
        T.generate_random_padding_mask(4, 2, "cpu", mode="half")


def test_local_and_chunk_masks_bottom_right():
    m = T.construct_local_mask(3, 5, (1, 0))
    want = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 0, 0, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(m, want)  # query i sits at key i + 2; keys [i + 1, i + 2] visible
    sink = T.construct_local_mask(3, 5, (1, 0), sink_token_length=1)
    assert not sink[:, 0].any() and torch.equal(sink[:, 1:], want[:, 1:])
    causal_only = T.construct_local_mask(2, 4, (-1, 0))
    assert torch.equal(causal_only, torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool))
    c = T.construct_chunk_mask(4, 6, 3)
    # query i at key i + 2: chunks [0, 3) and [3, 6)
    want_c = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]],
                          dtype=torch.bool)
    want_c[0] = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert torch.equal(c, want_c)
    kpm = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    per = T.construct_local_mask(2, 6, (0, 0), key_padding_mask=kpm)
    assert per.shape == (2, 1, 2, 6)
    assert torch.equal(per[0, 0, 1], torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool))
    lp = torch.tensor([2, 0])
    shifted = T.construct_local_mask(1, 6, (0, 0), key_leftpad=lp)
    # batch 0's keys shift left by 2 (its first two are padding, never visible): key 5 is position 3, not
    # the query's 5; batch 1 unshifted sees key 5 only
    assert shifted[0, 0, 0].all()
    assert torch.equal(shifted[1, 0, 0], torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool))


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2))])
def test_attention_ref_matches_float64_and_culmen(causal, window):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 11, 2, 16), torch.randn(2, 11, 2, 16)
    out, attn = T.attention_ref(q, k, v, causal=causal, window_size=window)
    torch.testing.assert_close(out.double(), plain(q, k, v, torch.float64, causal=causal, window=window),
                               rtol=1e-5, atol=1e-5)
    assert attn.shape == (2, 4, 7, 11)
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=causal, window_size=window), out,
                               rtol=1e-4, atol=1e-4)


def test_generate_qkv_round_trip_and_varlen_attention():
    torch.manual_seed(2)
    b, sq, sk, h, d = 3, 9, 12, 2, 16
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, h, d), torch.randn(b, sk, h, d)
    qm = T.generate_random_padding_mask(sq, b, "cpu", mode="third")
    km = T.generate_random_padding_mask(sk, b, "cpu", mode="third")
    (q_u, k_u, v_u, qv_u, cu_q, cu_k, used_q, used_k, max_q, max_k, q2, k2, v2, qv2, out_pad, dq_pad,
     dk_pad) = T.generate_qkv(q, k, v, qm, km)
    assert qv_u is None and qv2 is None and q_u.requires_grad and q2.requires_grad
    assert q_u.shape[0] == int(qm.sum()) and cu_q[-1] == q_u.shape[0] and max_q == int(qm.sum(-1).max())
    assert torch.equal(used_k, km.sum(-1).to(torch.int32))
    assert torch.equal(out_pad(q_u), q * qm[:, :, None, None])
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, causal=True)
    out, _ = T.attention_ref(q, k, v, qm, km, causal=True)
    torch.testing.assert_close(out_pad(out_u), out, rtol=1e-4, atol=1e-4)
    assert torch.equal(dk_pad(k_u.detach()), k * km[:, :, None, None])
    # packed layouts
    qkv_u, cu, mx, qkv, o_pad, dqkv_pad = T.generate_qkv(q[:, :sq], k[:, :sq], v[:, :sq], qm, qm, qkvpacked=True)
    assert qkv_u.shape == (int(qm.sum()), 3, h, d) and qkv.shape == (b, sq, 3, h, d)
    assert dqkv_pad(qkv_u.detach()).shape == (b, sq, 3, h, d)
    res = T.generate_qkv(q, k, v, None, km, kvpacked=True)
    assert len(res) == 11 and res[1].shape == (int(km.sum()), 2, h, d) and res[4] == sq
    with pytest.raises(ValueError, match="qkvpacked"):
        T.generate_qkv(q, k, v, qm, km, qkvpacked=True)


def test_attention_ref_chunk_and_descale_match_fa3():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 10, 2, 16), torch.randn(1, 14, 1, 16), torch.randn(1, 14, 1, 16)
    out, _ = T.attention_ref(q, k, v, causal=True, attention_chunk=4)
    torch.testing.assert_close(fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=4), out,
                               rtol=1e-4, atol=1e-4)
    qd, kd, vd = torch.rand(1, 1) + 0.5, torch.rand(1, 1) + 0.5, torch.rand(1, 1) + 0.5
    scaled, _ = T.attention_ref(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    plain, _ = T.attention_ref(q * qd, k * kd, v * vd)
    torch.testing.assert_close(scaled, plain)


def test_utils_torch_amp_decorators():
    from culmen.flash_attn.utils.torch import custom_bwd, custom_fwd

    class Double(torch.autograd.Function):
        @staticmethod
        @custom_fwd
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @custom_bwd
        def backward(ctx, g):
            return g * 2

    class Cast(torch.autograd.Function):
        @staticmethod
        @custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, x):
            return x + 1

        @staticmethod
        @custom_bwd
        def backward(ctx, g):
            return g

    x = torch.randn(3, requires_grad=True)
    Double.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert torch.equal(Cast.apply(x.detach()), x.detach() + 1)
