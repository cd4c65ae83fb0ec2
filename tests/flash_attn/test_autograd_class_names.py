"""flash_attn's public autograd classes that other libraries call directly: ``flash_attn.layers.rotary``'s
``ApplyRotaryEmb`` / ``ApplyRotaryEmbQKV_`` / ``ApplyRotaryEmbKV_`` and ``flash_attn.bert_padding``'s
``IndexFirstAxis`` / ``IndexPutFirstAxis`` / ``IndexFirstAxisResidual``: real ``torch.autograd.Function``
subclasses with flash_attn's ``apply`` arguments, equal to the functions (and to float64 formulas), with
gradients of every input checked."""

from __future__ import annotations

import pytest
import torch

from culmen.flash_attn import bert_padding as bp
from culmen.flash_attn.layers import rotary as R


def _tables(s, rd, dtype=torch.float64):
    t = torch.arange(s, dtype=torch.float64)[:, None] * (1.0 / 10000 ** (torch.arange(0, rd, 2) / rd))[None]
    return t.cos().to(dtype), t.sin().to(dtype)


def test_classes_are_autograd_functions():
    for cls in (R.ApplyRotaryEmb, R.ApplyRotaryEmbQKV_, R.ApplyRotaryEmbKV_, bp.IndexFirstAxis,
                bp.IndexPutFirstAxis, bp.IndexFirstAxisResidual):
        assert issubclass(cls, torch.autograd.Function)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_class_matches_torch_formula(inplace, interleaved):
    torch.manual_seed(0)
    B, S, H, D, rd = 2, 7, 3, 10, 6
    cos, sin = _tables(S + 3, rd)
    x0 = torch.randn(B, S, H, D, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    xin = x.clone() if inplace else x  # an in-place rotation of a non-leaf, as flash_attn's callers do
    out = R.ApplyRotaryEmb.apply(xin, cos, sin, interleaved, inplace, 2)
    want = R.apply_rotary_emb_torch(x0, cos[2:2 + S], sin[2:2 + S], interleaved)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    if inplace:
        assert out.data_ptr() == xin.data_ptr()
    g = torch.randn_like(out)
    out.backward(g)
    x1 = x0.clone().requires_grad_()
    R.apply_rotary_emb_torch(x1, cos[2:2 + S], sin[2:2 + S], interleaved).backward(g)
    torch.testing.assert_close(x.grad, x1.grad, rtol=1e-12, atol=1e-12)


def test_apply_rotary_emb_class_inplace_on_a_leaf_that_requires_grad():
    """flash_attn's class does not mark the input dirty: a leaf that requires grad may be rotated in place."""
    S, D = 5, 8
    cos, sin = _tables(S, D)
    x = torch.randn(1, S, 2, D, dtype=torch.float64, requires_grad=True)
    before = x.detach().clone()
    out = R.ApplyRotaryEmb.apply(x, cos, sin, False, True)
    torch.testing.assert_close(x.detach(), R.apply_rotary_emb_torch(before, cos, sin))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_apply_rotary_emb_class_varlen():
    torch.manual_seed(1)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    x = torch.randn(8, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(6, 8)
    out = R.ApplyRotaryEmb.apply(x, cos, sin, False, False, 0, cu, 5)
    want = R.apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=5)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    (gw,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(gx, gw)


@pytest.mark.parametrize("layout", ["5d", "gqa"])
def test_apply_rotary_emb_qkv_class(layout):
    torch.manual_seed(2)
    B, S, D = 2, 6, 8
    cos, sin = _tables(S, D)
    if layout == "5d":
        qkv0 = torch.randn(B, S, 3, 2, D, dtype=torch.float64)
        nq, parts = None, lambda t: (t[:, :, 0], t[:, :, 1], t[:, :, 2])
    else:
        qkv0 = torch.randn(B, S, 4 + 2 * 2, D, dtype=torch.float64)
        nq, parts = 4, lambda t: (t[:, :, :4], t[:, :, 4:6], t[:, :, 6:])
    qkv = qkv0.clone().requires_grad_()
    work = qkv.clone()
    out = R.ApplyRotaryEmbQKV_.apply(work, cos, sin, None, None, False, 0, nq)
    assert out.data_ptr() == work.data_ptr()
    q, k, v = parts(out)
    q0, k0, v0 = parts(qkv0)
    torch.testing.assert_close(q, R.apply_rotary_emb_torch(q0, cos, sin))
    torch.testing.assert_close(k, R.apply_rotary_emb_torch(k0, cos, sin))
    torch.testing.assert_close(v, v0)
    g = torch.randn_like(out)
    out.backward(g)
    ref = qkv0.clone().requires_grad_()
    rq, rk, rv = parts(ref)
    torch.cat([t.reshape(B, S, -1) for t in (R.apply_rotary_emb_torch(rq, cos, sin),
                                             R.apply_rotary_emb_torch(rk, cos, sin), rv)], -1).backward(
        torch.cat([t.reshape(B, S, -1) for t in parts(g)], -1))
    torch.testing.assert_close(qkv.grad, ref.grad)


def test_apply_rotary_emb_kv_class():
    torch.manual_seed(3)
    cos, sin = _tables(5, 8)
    kv0 = torch.randn(1, 5, 2, 3, 8, dtype=torch.float64)
    kv = kv0.clone().requires_grad_()
    out = R.ApplyRotaryEmbKV_.apply(kv.clone(), cos, sin, False, 0)
    torch.testing.assert_close(out[:, :, 0], R.apply_rotary_emb_torch(kv0[:, :, 0], cos, sin))
    torch.testing.assert_close(out[:, :, 1], kv0[:, :, 1])
    g = torch.randn_like(out)
    out.backward(g)
    ref = kv0[:, :, 0].clone().requires_grad_()
    R.apply_rotary_emb_torch(ref, cos, sin).backward(g[:, :, 0])
    torch.testing.assert_close(kv.grad[:, :, 0], ref.grad)
    torch.testing.assert_close(kv.grad[:, :, 1], g[:, :, 1])


def test_rotary_class_argument_errors():
    cos, sin = _tables(4, 8)
    with pytest.raises(ValueError, match="num_heads_q"):
        R.ApplyRotaryEmbQKV_.apply(torch.randn(1, 4, 6, 8), cos, sin)
    with pytest.raises(ValueError, match="kv must be"):
        R.ApplyRotaryEmbKV_.apply(torch.randn(1, 4, 3, 2, 8), cos, sin)


def test_index_classes_and_residual():
    torch.manual_seed(4)
    x = torch.randn(9, 3, 2, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([7, 0, 4, 5])
    out = bp.IndexFirstAxis.apply(x, idx)
    torch.testing.assert_close(out, x.detach()[idx])
    torch.testing.assert_close(bp.index_first_axis(input=x, indices=idx), out)
    put = bp.IndexPutFirstAxis.apply(out, idx, 9)
    assert torch.equal(bp.index_put_first_axis(out, idx, first_axis_dim=9), put)
    assert put[1].abs().sum() == 0 and torch.equal(put[idx], out)
    g = torch.randn_like(put)
    (gx,) = torch.autograd.grad(put, x, g)
    want = torch.zeros_like(g)
    want[idx] = g[idx]
    torch.testing.assert_close(gx, want)
    # residual: gathered rows' gradient added into the residual's
    sel, res = bp.index_first_axis_residual(x, idx)
    torch.testing.assert_close(res, x.detach())
    gs, gr = torch.randn_like(sel), torch.randn_like(res)
    (gx,) = torch.autograd.grad((sel, res), x, (gs, gr))
    want = gr.clone()
    want.index_add_(0, idx, gs)
    torch.testing.assert_close(gx, want)
    sel, res = bp.IndexFirstAxisResidual.apply(x, idx)
    (gx,) = torch.autograd.grad(sel, x, gs)  # no residual gradient
    want = torch.zeros_like(x)
    want.index_add_(0, idx, gs)
    torch.testing.assert_close(gx, want)


def test_rotary_embedding_takes_device_fifth_as_flash_attn():
    rope = R.RotaryEmbedding(8, 10000.0, False, None, "cpu")
    assert rope.inv_freq.device.type == "cpu" and rope.pos_idx_in_fp32 is True
    with pytest.raises(TypeError):
        R.RotaryEmbedding(8, 10000.0, False, None, "cpu", False)  # pos_idx_in_fp32 is keyword only
