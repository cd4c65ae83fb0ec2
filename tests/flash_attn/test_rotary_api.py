"""flash_attn's rotary API on culmen: ``culmen.flash_attn.layers.rotary`` and ``ops.triton.rotary``.

The oracle is ``apply_rotary_emb_torch`` (flash_attn's own unfused reference, here
``culmen.ops.rotary.rotary_emb_ref``) on float64; the in-place packed forms are checked against the
oracle applied to the unpacked Q/K, for values and for the gradient reaching the packed tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

from culmen.flash_attn.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
)
from culmen.flash_attn.ops.triton.rotary import apply_rotary
from culmen.testing import assert_close_tolerance, randn

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


def _tables(rows, half, dtype=F32):
    ang = torch.rand(rows, half, dtype=F64) * 6
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_against_torch(backend, interleaved, request):
    request.getfixturevalue(f"{backend}_backend")
    b, s, h, d, rd = 2, 6, 3, 20, 12
    cos, sin = _tables(s + 3, rd // 2, BF16)
    x = randn((b, s, h, d), BF16, requires_grad=True)
    y = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=3)
    g = randn(y.shape, BF16)
    y.backward(g)
    hi, lo = x.detach().to(F64).requires_grad_(), x.detach().clone().requires_grad_()
    y_hi = apply_rotary_emb_torch(hi, cos[3:].to(F64), sin[3:].to(F64), interleaved)
    y_lo = apply_rotary_emb_torch(lo, cos[3:], sin[3:], interleaved)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    (d_hi,) = torch.autograd.grad(y_hi, hi, g.to(F64))
    (d_lo,) = torch.autograd.grad(y_lo, lo, g)
    assert_close_tolerance(x.grad, d_hi, d_lo, name="dx")
    assert apply_rotary_emb_func is apply_rotary_emb
    # ops.triton.rotary.apply_rotary: the conjugate rotation undoes it.
    back = apply_rotary(y.detach(), cos, sin, seqlen_offsets=3, interleaved=interleaved, conjugate=True)
    torch.testing.assert_close(back, x.detach(), rtol=0, atol=0.05)


def _packed_reference(qkv, cos, sin, cos_k, sin_k, interleaved, nq=None):
    """Out of place: rotate Q and K of a float64 copy of ``qkv`` with the oracle."""
    if qkv.dim() == 5:
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2:]
        q = apply_rotary_emb_torch(q, cos, sin, interleaved)
        k = apply_rotary_emb_torch(k, cos_k, sin_k, interleaved)
        return torch.cat((q[:, :, None], k[:, :, None], v), 2)
    nk = (qkv.shape[2] - nq) // 2
    q = apply_rotary_emb_torch(qkv[:, :, :nq], cos, sin, interleaved)
    k = apply_rotary_emb_torch(qkv[:, :, nq:nq + nk], cos_k, sin_k, interleaved)
    return torch.cat((q, k, qkv[:, :, nq + nk:]), 2)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("form", ["5d", "5d-xpos", "5d-unmergeable", "gqa", "gqa-xpos", "5d-xpos-unmergeable"])
def test_qkv_inplace_values_and_grads(form, backend, request):
    """Q and K rotated in place by one launch (two head groups), with K's own tables for XPos, whatever
    qkv's strides; the gradient reaches the packed tensor."""
    request.getfixturevalue(f"{backend}_backend")
    b, s, h, d = 2, 5, 2, 8
    cos, sin = _tables(s, d // 2)
    cos_k, sin_k = _tables(s, d // 2) if "xpos" in form else (None, None)
    nq = 3 if form.startswith("gqa") else None
    unmergeable = "unmergeable" in form
    if nq:
        shape = (b, s, nq + 2 * 2, d)
    elif unmergeable:
        shape = (b, s, h, 3, d)  # (3, h) not adjacent in memory: Q and K are groups of stride d
    else:
        shape = (b, s, 3, h, d)
    w = randn(shape, requires_grad=True)
    qkv = w * 1.0  # a non-leaf, as a projection's output
    if unmergeable:
        qkv = qkv.transpose(2, 3)
    interleaved = form.startswith("gqa")
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved=interleaved, num_heads_q=nq)
    assert out is qkv
    g = randn(qkv.shape)
    qkv.backward(g)
    wr = w.detach().to(F64).requires_grad_()
    src = wr.transpose(2, 3) if unmergeable else wr
    ck, sk = (cos_k, sin_k) if cos_k is not None else (cos, sin)
    ref = _packed_reference(src, cos.to(F64), sin.to(F64), ck.to(F64), sk.to(F64), interleaved, nq)
    assert_close_tolerance(qkv, ref, None, name="qkv")
    (dref,) = torch.autograd.grad(ref, wr, g.to(F64))
    assert_close_tolerance(w.grad, dref, None, name="dw")


def test_kv_inplace():
    kv = randn((2, 4, 2, 3, 8))
    v = kv[:, :, 1].clone()
    cos, sin = _tables(6, 3)
    ref = apply_rotary_emb_torch(kv[:, :, 0].to(F64), cos[2:].to(F64), sin[2:].to(F64))
    assert apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=2) is kv
    assert_close_tolerance(kv[:, :, 0], ref, None)
    assert torch.equal(kv[:, :, 1], v)


def _expected_tables(dim, base, seqlen, scale_base=None):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    f = torch.outer(torch.arange(seqlen, dtype=F64), inv)
    if scale_base is None:
        return f.cos(), f.sin(), f.cos(), f.sin()
    sc = (torch.arange(0, dim, 2, dtype=F64) + 0.4 * dim) / (1.4 * dim)
    xs = sc ** ((torch.arange(seqlen, dtype=F64) - seqlen // 2) / scale_base)[:, None]
    return f.cos() * xs, f.sin() * xs, f.cos() / xs, f.sin() / xs


@pytest.mark.parametrize("scale_base", [None, 16.0])
def test_rotary_embedding_module(scale_base):
    b, s, h, d, dim = 2, 6, 2, 12, 8
    rope = RotaryEmbedding(dim, base=500.0, scale_base=scale_base)
    qkv = randn((b, s, 3, h, d))
    ref_in = qkv.to(F64)
    out = rope(qkv, seqlen_offset=1)
    assert out is qkv and rope._seq_len_cached == s + 1
    cq, sq, ck, sk = (t[1:] for t in _expected_tables(dim, 500.0, s + 1, scale_base))
    ref = _packed_reference(ref_in, cq, sq, ck, sk, False)
    assert_close_tolerance(out, ref, None, atol=1e-5)
    # q + kv form, per-batch offsets (the cache must then be sized by max_seqlen).
    q, kv = randn((b, s, h, d)), randn((b, s, 2, h, d))
    q0, kv0 = q.to(F64), kv.to(F64)
    offs = torch.tensor([0, 3])
    rope2 = RotaryEmbedding(dim, base=500.0, scale_base=scale_base)
    with pytest.raises(ValueError, match="max_seqlen"):
        rope2(q.clone(), kv.clone(), seqlen_offset=offs)
    q_out, kv_out = rope2(q, kv, seqlen_offset=offs, max_seqlen=s + 3)
    cq, sq, ck, sk = _expected_tables(dim, 500.0, s + 3, scale_base)
    for i in range(b):
        rows = slice(int(offs[i]), int(offs[i]) + s)
        assert_close_tolerance(q_out[i], apply_rotary_emb_torch(q0[i:i + 1], cq[rows], sq[rows])[0], None, atol=1e-5)
        assert_close_tolerance(kv_out[i, :, 0], apply_rotary_emb_torch(kv0[i:i + 1, :, 0], ck[rows], sk[rows])[0],
                               None, atol=1e-5)
    assert torch.equal(kv_out[:, :, 1], kv0[:, :, 1].float())


def test_rotary_embedding_positions_in_fp32_after_cast():
    rope = RotaryEmbedding(8, pos_idx_in_fp32=True).to(BF16)
    assert rope.inv_freq.dtype == BF16 and not rope.state_dict()  # non-persistent buffers
    qkv = randn((1, 700, 3, 1, 8), BF16)
    rope(qkv)
    want = _expected_tables(8, 10000.0, 700)[0]
    assert rope._cos_cached.dtype == BF16
    assert (rope._cos_cached.to(F64) - want).abs().max() < 0.01  # one bf16 rounding: positions stay exact
    # Without it, bf16 positions past 256 are rounded and the angles are far off.
    rope_lo = RotaryEmbedding(8, pos_idx_in_fp32=False).to(BF16)
    rope_lo(qkv.clone())
    assert (rope_lo._cos_cached.to(F64) - want).abs().max() > 0.1
    assert math.isclose(rope.base, 10000.0)


def test_bad_input():
    cos, sin = _tables(4, 4)
    with pytest.raises(ValueError, match="needs num_heads_q"):
        apply_rotary_emb_qkv_(randn((1, 4, 6, 8)), cos, sin)
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(randn((1, 4, 7, 8)), cos, sin, num_heads_q=2)
    with pytest.raises(ValueError, match=r"\(batch, seqlen, 3, nheads, headdim\)"):
        apply_rotary_emb_qkv_(randn((1, 4, 2, 1, 8)), cos, sin)
    with pytest.raises(ValueError, match=r"\(batch, seqlen, 2, nheads, headdim\)"):
        apply_rotary_emb_kv_(randn((1, 4, 3, 1, 8)), cos, sin)
    with pytest.raises(ValueError, match="cos_k and sin_k"):
        apply_rotary_emb_qkv_(randn((1, 4, 3, 1, 8)), cos, sin, cos_k=cos)
    with pytest.raises(ValueError, match="positive even"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(randn((1, 4, 1, 6)), cos, sin)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("form", ["x", "x-view", "qkv", "qkv-view", "gqa", "kv", "module"])
def test_inplace_on_leaf_that_requires_grad(form, backend, request):
    """In place on a leaf that requires grad (or a view of one) works as in flash_attn: the leaf's memory
    holds the rotation and the returned tensor carries the gradient back to the leaf."""
    request.getfixturevalue(f"{backend}_backend")
    b, s, h, d = 2, 5, 2, 8
    cos, sin = _tables(s, d // 2)
    cos64, sin64 = cos.to(F64), sin.to(F64)
    shapes = {"x": (b, s, h, d), "x-view": (b, s, h + 1, d), "qkv": (b, s, 3, h, d), "qkv-view": (b, s, 4, h, d),
              "gqa": (b, s, 3 + 2 * 1, d), "kv": (b, s, 2, h, d), "module": (b, s, 3, h, d)}
    leaf = randn(shapes[form], requires_grad=True)
    src = leaf.detach().to(F64)
    if form == "x":
        out = apply_rotary_emb(leaf, cos, sin, inplace=True)
        ref = apply_rotary_emb_torch(src, cos64, sin64)
    elif form == "x-view":
        out = apply_rotary_emb(leaf[:, :, 1:], cos, sin, inplace=True)
        ref = apply_rotary_emb_torch(src[:, :, 1:], cos64, sin64)
    elif form in ("qkv", "qkv-view"):
        qkv = leaf if form == "qkv" else leaf[:, :, 1:]
        out = apply_rotary_emb_qkv_(qkv, cos, sin)
        ref = _packed_reference(src if form == "qkv" else src[:, :, 1:], cos64, sin64, cos64, sin64, False)
    elif form == "gqa":
        out = apply_rotary_emb_qkv_(leaf, cos, sin, interleaved=True, num_heads_q=3)
        ref = _packed_reference(src, cos64, sin64, cos64, sin64, True, 3)
    elif form == "kv":
        out = apply_rotary_emb_kv_(leaf, cos, sin)
        ref = torch.cat((apply_rotary_emb_torch(src[:, :, :1].squeeze(2), cos64, sin64)[:, :, None], src[:, :, 1:]), 2)
    else:
        out = RotaryEmbedding(d)(leaf)
        c, s_, _, _ = _expected_tables(d, 10000.0, s)
        ref = _packed_reference(src, c, s_, c, s_, False)
    assert_close_tolerance(out, ref, None, name="out")
    g = randn(out.shape)
    out.backward(g)
    # The gradient of a rotation is the rotation back: check it through the oracle's own autograd.
    src_g = src.clone().requires_grad_()
    if form == "x":
        ref_g = apply_rotary_emb_torch(src_g, cos64, sin64)
    elif form == "x-view":
        ref_g = apply_rotary_emb_torch(src_g[:, :, 1:], cos64, sin64)
    elif form in ("qkv", "qkv-view"):
        ref_g = _packed_reference(src_g if form == "qkv" else src_g[:, :, 1:], cos64, sin64, cos64, sin64, False)
    elif form == "gqa":
        ref_g = _packed_reference(src_g, cos64, sin64, cos64, sin64, True, 3)
    elif form == "kv":
        k = apply_rotary_emb_torch(src_g[:, :, :1].squeeze(2), cos64, sin64)[:, :, None]
        ref_g = torch.cat((k, src_g[:, :, 1:]), 2)
    else:
        ref_g = _packed_reference(src_g, c, s_, c, s_, False)
    (dref,) = torch.autograd.grad(ref_g, src_g, g.to(F64))
    assert_close_tolerance(leaf.grad, dref, None, name="dleaf")
    # The leaf's own memory holds the rotation (flash_attn rotates in place).
    mem = leaf.detach()[:, :, 1:] if form in ("x-view", "qkv-view") else leaf.detach()
    torch.testing.assert_close(mem.to(F64), ref, rtol=1e-5, atol=1e-5)


def test_inplace_on_leaf_under_compile(reference_backend):
    """The same under torch.compile (fullgraph): no error, and gradients as in eager mode."""
    torch._dynamo.reset()
    b, s, h, d = 2, 5, 2, 8
    cos, sin = _tables(s, d // 2)

    def fn(x, qkv):
        return apply_rotary_emb(x, cos, sin, inplace=True), apply_rotary_emb_qkv_(qkv, cos, sin)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x0, qkv0 = randn((b, s, h, d)), randn((b, s, 3, h, d))
    gx, gq = randn(x0.shape), randn(qkv0.shape)
    res = []
    for f in (fn, compiled):
        x, qkv = x0.clone().requires_grad_(), qkv0.clone().requires_grad_()
        ox, oq = f(x, qkv)
        torch.autograd.backward((ox, oq), (gx, gq))
        res.append((ox.detach(), oq.detach(), x.grad, qkv.grad, x.detach().clone()))
    for i, (e, c) in enumerate(zip(*res)):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"result {i}: {m}")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_inplace_on_leaf_view_of_a_plain_tensor(backend, request):
    """unpad_input returns a view of a tensor that does not require grad; ``requires_grad_()`` makes that view a
    leaf of its own (flash_attn's varlen rotary test rotates it in place): no error, the gradient reaches it."""
    from culmen.flash_attn.bert_padding import unpad_input

    request.getfixturevalue(f"{backend}_backend")
    b, s, h, d = 3, 6, 2, 8
    cos, sin = _tables(s, d // 2)
    mask = torch.arange(s)[None] < torch.tensor([[6], [4], [5]])
    x_unpad, _, cu, max_s, _ = unpad_input(randn((b, s, h, d)), mask)
    plain = torch.randn(x_unpad.shape[0] + 1, h, d)[1:]  # a leaf view whatever unpad_input returns
    for leaf in (x_unpad, plain):
        leaf = leaf.requires_grad_()
        assert leaf.is_leaf
        src = leaf.detach().to(F64).clone()
        out = apply_rotary_emb(leaf, cos, sin, inplace=True, cu_seqlens=cu, max_seqlen=max_s)
        lens = (cu[1:] - cu[:-1]).tolist()
        rows = [apply_rotary_emb_torch(part[None], cos[:n].to(F64), sin[:n].to(F64))[0]
                for part, n in zip(src.split(lens), lens)]
        assert_close_tolerance(out, torch.cat(rows), None, name="out")
        out.backward(torch.ones_like(out))
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_varlen_cu_seqlens_past_the_tensor_touch_nothing_outside(backend, request):
    """cu_seqlens whose values run past the packed tensor (or go backwards) never make the kernel read or write
    outside it, forward (in place) or backward: the guard rows around x keep their sentinel."""
    request.getfixturevalue(f"{backend}_backend")
    h, d, total = 2, 8, 6
    cos, sin = _tables(8, d // 2)
    buf = torch.full((total + 8, h, d), 7.0)
    x = buf[2:2 + total]
    x.copy_(randn((total, h, d)))
    x = x.requires_grad_()
    for cu in ([0, 2, 4, 7], [0, 6, 10, 15], [0, 5, 3, 6]):
        cu_t = torch.tensor(cu, dtype=torch.int32)
        out = apply_rotary_emb(x, cos, sin, inplace=True, cu_seqlens=cu_t, max_seqlen=8)
        out.backward(torch.ones_like(out))
        assert (buf[:2] == 7).all() and (buf[2 + total:] == 7).all()
        assert torch.isfinite(x.grad).all()
