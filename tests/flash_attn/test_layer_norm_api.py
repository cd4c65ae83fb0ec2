"""culmen.flash_attn.ops.triton.layer_norm against flash_attn 2.8's API and a float64 reference."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import culmen.flash_attn
from culmen.flash_attn.ops.triton import layer_norm as fa_ln
from culmen.flash_attn.ops.triton.layer_norm import (
    LayerNormFn,
    LayerNormLinearFn,
    RMSNorm,
    layer_norm_fn,
    layer_norm_linear_fn,
    rms_norm_fn,
)
from culmen.ops.layer_norm import reference
from culmen.testing import assert_close_tolerance, make_noncontiguous, poison_, randn

BACKENDS = ["reference", "triton"]
_EMPTY = inspect.Parameter.empty

_LN_FN_PARAMS = [
    ("x", _EMPTY), ("weight", _EMPTY), ("bias", _EMPTY), ("residual", None), ("x1", None), ("weight1", None),
    ("bias1", None), ("eps", 1e-6), ("dropout_p", 0.0), ("rowscale", None), ("prenorm", False),
    ("residual_in_fp32", False), ("zero_centered_weight", False), ("is_rms_norm", False),
    ("return_dropout_mask", False), ("out_dtype", None), ("out", None), ("residual_out", None),
]


def _params(obj):
    return [(n, p.default) for n, p in inspect.signature(obj).parameters.items() if n != "self"]


def test_signatures_match_flash_attn():
    assert culmen.flash_attn.__version__ == "2.8.3"
    assert _params(layer_norm_fn) == _LN_FN_PARAMS
    assert _params(LayerNormFn.apply) == _LN_FN_PARAMS
    assert _params(rms_norm_fn) == [p for p in _LN_FN_PARAMS if p[0] != "is_rms_norm"]
    assert _params(RMSNorm) == [("hidden_size", _EMPTY), ("eps", 1e-5), ("dropout_p", 0.0),
                                ("zero_centered_weight", False), ("device", None), ("dtype", None)]
    assert _params(RMSNorm.forward) == [("x", _EMPTY), ("residual", None), ("prenorm", False),
                                        ("residual_in_fp32", False)]
    linear = [("x", _EMPTY), ("norm_weight", _EMPTY), ("norm_bias", _EMPTY), ("linear_weight", _EMPTY),
              ("linear_bias", _EMPTY), ("residual", None), ("eps", 1e-6), ("prenorm", False),
              ("residual_in_fp32", False), ("is_rms_norm", False)]
    assert _params(layer_norm_linear_fn) == linear
    assert _params(LayerNormLinearFn.apply) == linear
    # The references are culmen's own, re-exported (one oracle, not a copy).
    assert fa_ln.layer_norm_ref is reference.layer_norm_ref and fa_ln.rms_norm_ref is reference.rms_norm_ref


# ---------------------------------------------------------------------------------------------
# Forward and backward of every input against the float64 reference
# ---------------------------------------------------------------------------------------------


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)


def _as_list(ret):
    return list(ret) if isinstance(ret, tuple) else [ret]


CASES = {
    # name: (is_rms, x dtype, param dtype, shape, residual dtype | None, x1 + weight1, bias1, rowscale,
    #        residual_in_fp32, zero_centered, out_dtype, prenorm, non-contiguous)
    "ln_fp16_res32_prenorm": (False, torch.float16, torch.float32, (3, 63), torch.float32, False, False, False,
                              False, False, None, True, False),
    "rms_bf16_parallel_zc": (True, torch.bfloat16, torch.bfloat16, (2, 5, 40), torch.bfloat16, True, True, False,
                             False, True, None, True, True),
    "ln_bf16_rowscale_fp32res": (False, torch.bfloat16, torch.float32, (4, 257), None, False, False, True,
                                 True, False, torch.float32, True, True),
    "rms_fp32_x1_nobias": (True, torch.float32, torch.float32, (3, 63), None, True, False, True,
                           False, False, None, False, False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_layer_norm_fn_matches_float64(request, backend, case):
    request.getfixturevalue(f"{backend}_backend")
    (rms, dt, pdt, shape, res_dt, has_x1, has_b1, has_rowscale, res_fp32, zc, out_dtype, prenorm,
     noncontig) = CASES[case]
    n = shape[-1]
    x = randn(shape, dt)
    residual = randn(shape, res_dt) if res_dt is not None else None
    x1 = randn(shape, dt) if has_x1 else None
    offset = 0.0 if zc else 0.5  # zero-centred weights are stored as w - 1
    weight = (torch.rand(n) + offset).to(pdt)
    bias = None if rms else (randn(n) * 0.2).to(pdt)
    weight1 = (torch.rand(n) + offset).to(pdt) if has_x1 else None
    bias1 = (randn(n) * 0.2).to(pdt) if has_b1 else None
    rowscale = (torch.rand(shape[:-1]) + 0.5).to(dt) if has_rowscale else None
    tensors = [x, weight, bias, residual, x1, weight1, bias1]

    def call(fn, ts, **extra):
        xx, w, b, r, xx1, w1, b1 = ts
        rs = rowscale.to(xx.dtype) if rowscale is not None else None
        return _as_list(fn(xx, w, b, residual=r, x1=xx1, weight1=w1, bias1=b1, eps=1e-5, rowscale=rs,
                           prenorm=prenorm, zero_centered_weight=zc, **extra))

    ins = [_leaf(t) for t in tensors]
    if noncontig:
        ins = [make_noncontiguous(t).requires_grad_(True) if t is not None and t.dim() > 1 else t for t in ins]
    outs = call(layer_norm_fn, ins, is_rms_norm=rms, residual_in_fp32=res_fp32, out_dtype=out_dtype)
    assert len(outs) == 1 + has_x1 + prenorm
    want_out = out_dtype or dt
    assert all(o.dtype == want_out for o in outs[: 1 + has_x1])
    if prenorm:
        assert outs[-1].dtype == (res_dt or (torch.float32 if res_fp32 else dt))
    grads_out = [randn(o.shape).to(o.dtype).float() for o in outs]  # representable in every output dtype

    def backward(os):
        sum((o * g.to(o.dtype)).sum() for o, g in zip(os, grads_out)).backward()

    backward(outs)
    ref = reference.rms_norm_ref if rms else reference.layer_norm_ref
    hi_ins = [_leaf(t, torch.float64) for t in tensors]
    hi = call(ref, hi_ins)
    backward(hi)
    lo_ins = [_leaf(t) for t in tensors]
    lo = call(ref, lo_ins, residual_in_fp32=res_fp32, out_dtype=out_dtype)
    backward(lo)
    names = ["y", "y1", "residual_out"] if has_x1 else ["y", "residual_out"]
    for name, a, h, low in zip(names, outs, hi, lo):
        assert_close_tolerance(a, h, low, name=name)
    for name, a, h, low in zip(("dx", "dweight", "dbias", "dresidual", "dx1", "dweight1", "dbias1"), ins, hi_ins,
                               lo_ins):
        if a is None:
            continue
        assert a.grad is not None and a.grad.dtype == a.dtype, name
        assert_close_tolerance(a.grad, h.grad, low.grad, name=name)


# ---------------------------------------------------------------------------------------------
# Return structure, dropout, buffers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("has_w1", [False, True])
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("return_mask", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_return_structure_follows_flash_attn(has_w1, prenorm, return_mask, dropout_p):
    x = randn((3, 16))
    w = torch.rand(16) + 0.5
    x1 = randn((3, 16)) if has_w1 else None
    ret = layer_norm_fn(x, w, None, x1=x1, weight1=w if has_w1 else None, dropout_p=dropout_p, prenorm=prenorm,
                        return_dropout_mask=return_mask)
    n_out = 1 + has_w1 + prenorm + 2 * return_mask
    if n_out == 1:
        assert isinstance(ret, torch.Tensor)
        return
    assert isinstance(ret, tuple) and len(ret) == n_out
    assert all(isinstance(t, torch.Tensor) for t in ret[: 1 + has_w1 + prenorm])
    if return_mask:
        mask, mask1 = ret[-2:]
        if dropout_p == 0.0:
            assert mask is None and mask1 is None
        else:
            assert mask.dtype == torch.bool and mask.shape == x.shape
            assert (mask1 is not None) == has_w1


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_statistics_and_replay(request, backend):
    request.getfixturevalue(f"{backend}_backend")
    p = 0.3
    shape = (16, 257)
    x = randn(shape, requires_grad=True)
    x1 = randn(shape, requires_grad=True)
    w = torch.rand(257) + 0.5
    b = randn(257) * 0.2
    y, res, mask, mask1 = layer_norm_fn(x, w, b, x1=x1, dropout_p=p, prenorm=True, return_dropout_mask=True)
    for m in (mask, mask1):
        assert m.dtype == torch.bool and m.shape == shape
        assert abs(m.float().mean().item() - (1 - p)) < 0.03
    assert not torch.equal(mask, mask1)  # independent masks for x and x1
    # The pre-norm sum is exactly dropout(x) + dropout(x1): dropped elements are zero, kept ones scaled.
    expect_res = torch.where(mask, x.detach() / (1 - p), 0.0) + torch.where(mask1, x1.detach() / (1 - p), 0.0)
    torch.testing.assert_close(res.detach(), expect_res)
    g = randn(shape)
    y.backward(g)
    # Backward replays the forward masks: no gradient reaches dropped elements.
    assert (x.grad[~mask] == 0).all() and (x1.grad[~mask1] == 0).all()
    assert (x.grad[mask] != 0).float().mean() > 0.99
    xr, x1r = _leaf(x, torch.float64), _leaf(x1, torch.float64)
    y_ref = reference.layer_norm_ref(xr, w.double(), b.double(), x1=x1r, eps=1e-6, dropout_p=p, dropout_mask=mask,
                                     dropout_mask1=mask1)
    y_ref.backward(g.double())
    assert_close_tolerance(y, y_ref, None, name="y")
    assert_close_tolerance(x.grad, xr.grad, None, name="dx")
    assert_close_tolerance(x1.grad, x1r.grad, None, name="dx1")
    # A second call draws a fresh mask.
    _, mask_again, _ = layer_norm_fn(x, w, b, dropout_p=p, return_dropout_mask=True)
    assert not torch.equal(mask, mask_again)


def test_bad_dropout_and_shapes_raise():
    x = randn((2, 8))
    w = torch.ones(8)
    for p in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="dropout_p"):
            layer_norm_fn(x, w, None, dropout_p=p)
    with pytest.raises(ValueError, match="x1"):
        layer_norm_fn(x, w, None, x1=randn((2, 9)))
    with pytest.raises(ValueError, match="out"):
        layer_norm_fn(x, w, None, out=torch.empty(2, 9))
    with pytest.raises(TypeError, match="floating-point"):
        rms_norm_fn(torch.ones(2, 8, dtype=torch.int32), w, None)


def test_out_and_residual_out_buffers_are_filled_in_place():
    shape = (3, 2, 20)
    x = randn(shape, torch.bfloat16, requires_grad=True)
    r = randn(shape, torch.bfloat16)
    w = torch.rand(20) + 0.5
    out = poison_(torch.empty(shape, dtype=torch.float32))
    res_out = poison_(torch.empty(shape, dtype=torch.bfloat16))
    y, res = layer_norm_fn(x, w, None, residual=r, prenorm=True, out=out, residual_out=res_out)
    assert y is out and res is res_out
    y_plain, res_plain = layer_norm_fn(x.detach(), w, None, residual=r, prenorm=True, out_dtype=torch.float32)
    torch.testing.assert_close(out.detach(), y_plain, rtol=0, atol=0)
    torch.testing.assert_close(res_out, res_plain, rtol=0, atol=0)
    # Gradients flow through the filled buffer.
    y.sum().backward()
    xr = x.detach().requires_grad_(True)
    layer_norm_fn(xr, w, None, residual=r, out_dtype=torch.float32).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    # Without prenorm the residual buffer is still filled; an fp32 buffer makes the stream fp32.
    res32 = poison_(torch.empty(shape, dtype=torch.float32))
    y2 = rms_norm_fn(x.detach(), w, None, residual_out=res32)
    assert isinstance(y2, torch.Tensor) and not torch.isnan(res32).any()
    torch.testing.assert_close(res32, x.detach().float(), rtol=0, atol=0)


def test_layer_norm_fn_apply_shim_is_positional():
    x = randn((3, 16))
    w, b = torch.rand(16) + 0.5, randn(16)
    r = randn((3, 16))
    got = LayerNormFn.apply(x, w, b, r, None, None, None, 1e-5, 0.0, None, True, False, False, True, False, None,
                            None, None)
    want = rms_norm_fn(x, w, b, residual=r, eps=1e-5, prenorm=True)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


# ---------------------------------------------------------------------------------------------
# RMSNorm module, layer_norm_linear_fn
# ---------------------------------------------------------------------------------------------


def test_rms_norm_module():
    m = RMSNorm(24, eps=1e-5)
    assert torch.equal(m.weight, torch.ones(24)) and m.bias is None and m.drop is None
    zc = RMSNorm(24, zero_centered_weight=True, dtype=torch.float64)
    assert torch.equal(zc.weight, torch.zeros(24, dtype=torch.float64))
    x = randn((2, 3, 24))
    torch.testing.assert_close(m(x), F.rms_norm(x, (24,), eps=1e-5))
    torch.testing.assert_close(zc(x.double()), F.rms_norm(x.double(), (24,), eps=1e-5))
    r = randn((2, 3, 24))
    y, res = m(x, residual=r, prenorm=True, residual_in_fp32=True)
    torch.testing.assert_close(res, x + r)

    drop = RMSNorm(24, dropout_p=0.5)
    drop.eval()
    torch.testing.assert_close(drop(x), m(x))  # no dropout in eval mode
    drop.train()
    y_train = drop(x)
    assert not torch.allclose(y_train, m(x))


def test_layer_norm_linear_fn_matches_unfused():
    x = randn((2, 3, 16), requires_grad=True)
    r = randn((2, 3, 16))
    nw, nb = _leaf(torch.rand(16) + 0.5), _leaf(randn(16) * 0.2)
    lw, lb = _leaf(randn((8, 16)) * 0.25), _leaf(randn(8))
    out, res = layer_norm_linear_fn(x, nw, nb, lw, lb, residual=r, eps=1e-5, prenorm=True)
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(res, x.detach() + r)
    xr, nwr, nbr, lwr, lbr = (_leaf(t) for t in (x, nw, nb, lw, lb))
    want = F.linear(F.layer_norm(xr + r, (16,), nwr, nbr, 1e-5), lwr, lbr)
    torch.testing.assert_close(out, want)
    g = randn(out.shape)
    out.backward(g)
    want.backward(g)
    for a, b in ((x, xr), (nw, nwr), (nb, nbr), (lw, lwr), (lb, lbr)):
        torch.testing.assert_close(a.grad, b.grad)
    # RMS flavour, no prenorm: returns one tensor.
    out_rms = LayerNormLinearFn.apply(x.detach(), nw, None, lw, None, None, 1e-5, False, False, True)
    torch.testing.assert_close(out_rms, F.linear(F.rms_norm(x.detach(), (16,), nw, 1e-5), lw))


def test_layer_norm_linear_fn_cpu_autocast():
    x = randn((4, 16), requires_grad=True)
    nw = torch.rand(16) + 0.5
    lw = _leaf(randn((8, 16)) * 0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer_norm_linear_fn(x, nw, None, lw, None, is_rms_norm=True)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lw.grad.dtype == torch.float32
    want = F.linear(F.rms_norm(x.detach(), (16,), nw, 1e-6).bfloat16().float(), lw.detach().bfloat16().float())
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
