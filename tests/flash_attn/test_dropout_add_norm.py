"""flash_attn's legacy dropout-add-norm API (culmen.flash_attn.ops.layer_norm / rms_norm)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from culmen.flash_attn.ops import layer_norm as legacy_ln
from culmen.flash_attn.ops import rms_norm as legacy_rms
from culmen.flash_attn.ops.layer_norm import (
    DropoutAddLayerNorm,
    dropout_add_layer_norm,
    dropout_add_layer_norm_parallel_residual,
    dropout_add_layer_norm_subset,
)
from culmen.flash_attn.ops.rms_norm import (
    DropoutAddRMSNorm,
    RMSNorm,
    dropout_add_rms_norm,
    dropout_add_rms_norm_parallel_residual,
    dropout_add_rms_norm_subset,
    rms_norm,
)
from culmen.ops.layer_norm.reference import layer_norm_ref
from culmen.testing import assert_close_tolerance, randn

BACKENDS = ["reference", "triton"]
_E = inspect.Parameter.empty


def _params(obj):
    return [(n, p.default) for n, p in inspect.signature(obj).parameters.items() if n != "self"]


_DROPOUT_ADD = [("x0", _E), ("residual", _E), ("weight", _E), ("bias", _E), ("dropout_p", _E), ("epsilon", _E),
                ("rowscale", None), ("layerscale", None), ("prenorm", False), ("residual_in_fp32", False),
                ("return_dropout_mask", False)]
_SUBSET = [("x0", _E), ("residual", _E), ("weight", _E), ("bias", _E), ("dropout_p", _E), ("epsilon", _E),
           ("layerscale", None), ("x0_subset", None), ("out_subset", None), ("rowscale_const", 1.0),
           ("out_numrows", 0), ("prenorm", False), ("residual_in_fp32", False), ("return_dropout_mask", False)]
_PARALLEL = [("x0", _E), ("x1", _E), ("residual", _E), ("weight0", _E), ("bias0", _E), ("weight1", _E),
             ("bias1", _E), ("dropout_p", _E), ("epsilon", _E), ("prenorm", False), ("residual_in_fp32", False),
             ("return_dropout_mask", False)]
_MODULE = [("hidden_size", _E), ("prenorm", False), ("p", 0.0), ("eps", 1e-5), ("residual_in_fp32", False),
           ("device", None), ("dtype", None)]


def test_signatures_match_flash_attn():
    assert _params(dropout_add_layer_norm) == _DROPOUT_ADD == _params(dropout_add_rms_norm)
    assert _params(dropout_add_layer_norm_subset) == _SUBSET == _params(dropout_add_rms_norm_subset)
    assert _params(dropout_add_layer_norm_parallel_residual) == _PARALLEL
    assert _params(dropout_add_rms_norm_parallel_residual) == _PARALLEL
    assert _params(DropoutAddLayerNorm) == _MODULE == _params(DropoutAddRMSNorm)
    assert _params(DropoutAddLayerNorm.forward) == [("x0", _E), ("residual", None)]
    assert _params(legacy_ln.layer_norm) == [("x", _E), ("weight", _E), ("bias", _E), ("epsilon", _E)]
    assert _params(rms_norm) == [("x", _E), ("weight", _E), ("epsilon", _E)]
    assert _params(RMSNorm) == [("hidden_size", _E), ("eps", 1e-5), ("device", None), ("dtype", None)]


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)


def _as_list(ret):
    return list(ret) if isinstance(ret, tuple) else [ret]


def _ref_dropout_add(x0, residual, weight, bias, p, eps, rowscale, layerscale, mask, rms, prenorm):
    """Unfused ``norm(dropout(x0 * rowscale * layerscale) + residual)`` in the dtype of its inputs."""
    x = x0 * layerscale.to(x0.dtype) if layerscale is not None else x0
    return layer_norm_ref(x, weight, bias, residual=residual, eps=eps, dropout_p=p, rowscale=rowscale,
                          dropout_mask=mask, is_rms_norm=rms, prenorm=prenorm)


CASES = {
    # name: (rms, x0 dtype, weight dtype, residual dtype | None, rowscale, layerscale, dropout_p, prenorm, fp32 res)
    "ln_fp16_rowscale_layerscale_prenorm": (False, torch.float16, torch.float32, torch.float16, True, True, 0.0,
                                            True, False),
    "rms_bf16_layerscale_nores_prenorm": (True, torch.bfloat16, torch.bfloat16, None, False, True, 0.0, True, False),
    "ln_fp32_dropout_residual": (False, torch.float32, torch.float32, torch.float32, True, False, 0.2, False, False),
    "rms_fp16_dropout_fp32res": (True, torch.float16, torch.float32, None, False, True, 0.2, True, True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_dropout_add_norm_matches_float64(request, backend, case):
    request.getfixturevalue(f"{backend}_backend")
    rms, dt, wdt, res_dt, has_rs, has_ls, p, prenorm, res_fp32 = CASES[case]
    shape, n = (2, 5, 40), 40
    x0 = randn(shape, dt)
    residual = randn(shape, res_dt) if res_dt is not None else None
    weight = (torch.rand(n) + 0.5).to(wdt)
    bias = (randn(n) * 0.2).to(wdt) if not rms else None
    rowscale = (torch.rand(shape[:-1]) + 0.5).to(dt) if has_rs else None
    layerscale = (torch.rand(n) + 0.5).to(wdt) if has_ls else None
    fn = dropout_add_rms_norm if rms else dropout_add_layer_norm
    ins = [_leaf(t) for t in (x0, residual, weight, bias, layerscale)]
    outs = _as_list(fn(ins[0], ins[1], ins[2], ins[3], p, 1e-5, rowscale=rowscale, layerscale=ins[4],
                       prenorm=prenorm, residual_in_fp32=res_fp32, return_dropout_mask=True))
    mask = outs.pop()
    assert mask.dtype == torch.uint8 and mask.shape == shape
    if p == 0.0:
        assert bool((mask == 1).all())
    else:
        assert abs(mask.float().mean().item() - (1 - p)) < 0.06
    assert len(outs) == 1 + prenorm
    assert outs[0].dtype == dt
    if prenorm:
        assert outs[1].dtype == (res_dt or (torch.float32 if res_fp32 else dt))
    grads = [randn(o.shape).to(o.dtype).float() for o in outs]

    def backward(os):
        sum((o * g.to(o.dtype)).sum() for o, g in zip(os, grads)).backward()

    backward(outs)
    keep = mask.bool() if p > 0 else None

    def ref(dtype):
        ts = [_leaf(t, dtype) for t in (x0, residual, weight, bias, layerscale)]
        rs = rowscale.to(dtype or dt) if rowscale is not None else None
        os = _as_list(_ref_dropout_add(ts[0], ts[1], ts[2], ts[3], p, 1e-5, rs, ts[4], keep, rms, prenorm))
        backward(os)
        return os, ts

    hi, hi_ins = ref(torch.float64)
    lo, lo_ins = ref(None)
    for name, a, h, low in zip(("out", "residual_out"), outs, hi, lo):
        assert_close_tolerance(a, h, low, name=name)
    for name, a, h, low in zip(("dx0", "dresidual", "dweight", "dbias", "dlayerscale"), ins, hi_ins, lo_ins):
        if a is not None:
            assert a.grad.dtype == a.dtype, name
            assert_close_tolerance(a.grad, h.grad, low.grad, name=name)
    if p > 0:
        # Backward replays the forward mask.
        assert bool((ins[0].grad[mask == 0] == 0).all())


def _droppath(batch, seqlen, keep):
    """flash_attn's subset encoding: 1-based row index among the kept rows, 0 for dropped rows."""
    mask_batch = torch.tensor(keep)
    rows = mask_batch.repeat_interleave(seqlen)
    subset = torch.cumsum(rows, 0, dtype=torch.int32).masked_fill_(~rows, 0).reshape(batch, seqlen)
    return mask_batch, int(mask_batch.sum()) * seqlen, subset


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rms, dropout_p, prenorm", [(False, 0.0, True), (True, 0.3, False)])
def test_subset_matches_gather_scatter_reference(request, backend, rms, dropout_p, prenorm):
    request.getfixturevalue(f"{backend}_backend")
    batch, seqlen, n = 4, 3, 24
    x0_mask, _, x0_subset = _droppath(batch, seqlen, [True, False, True, True])
    out_mask, out_numrows, out_subset = _droppath(batch, seqlen, [False, True, True, False])
    scale = 1 / 0.6
    x0 = randn((int(x0_mask.sum()), seqlen, n), torch.float16, requires_grad=True)
    residual = randn((batch, seqlen, n), torch.float32, requires_grad=True)
    weight = _leaf(torch.rand(n) + 0.5)
    bias = _leaf(randn(n) * 0.2) if not rms else None
    layerscale = _leaf(torch.rand(n) + 0.5)
    fn = dropout_add_rms_norm_subset if rms else dropout_add_layer_norm_subset
    outs = _as_list(fn(x0, residual, weight, bias, dropout_p, 1e-5, layerscale=layerscale, x0_subset=x0_subset,
                       out_subset=out_subset, rowscale_const=scale, out_numrows=out_numrows, prenorm=prenorm,
                       return_dropout_mask=True))
    mask = outs.pop()
    assert mask.shape == x0.shape and mask.dtype == torch.uint8
    out = outs[0]
    assert out.shape == (int(out_mask.sum()), seqlen, n) and out.dtype == torch.float16
    if prenorm:
        assert outs[1].shape == (batch, seqlen, n) and outs[1].dtype == torch.float32
    grads = [randn(o.shape).to(o.dtype).float() for o in outs]
    sum((o * g.to(o.dtype)).sum() for o, g in zip(outs, grads)).backward()

    # Reference: scatter x0 to the full batch, run the unfused norm on every row, keep the output subset.
    x0r, resr, wr, lsr = (_leaf(t, torch.float64) for t in (x0, residual, weight, layerscale))
    br = _leaf(bias, torch.float64)
    full = torch.zeros(batch, seqlen, n, dtype=torch.float64)
    full[x0_mask] = x0r * scale
    keep_full = torch.zeros(batch, seqlen, n, dtype=torch.bool)
    keep_full[x0_mask] = mask.bool()
    ref = _as_list(_ref_dropout_add(full, resr, wr, br, dropout_p, 1e-5, None, lsr,
                                    keep_full if dropout_p > 0 else None, rms, prenorm))
    ref[0] = ref[0][out_mask]
    sum((o * g.double()).sum() for o, g in zip(ref, grads)).backward()
    assert_close_tolerance(out, ref[0], None, name="out")
    if prenorm:
        assert_close_tolerance(outs[1], ref[1], None, name="residual_out")
    for name, a, h in (("dx0", x0, x0r), ("dresidual", residual, resr), ("dweight", weight, wr),
                       ("dlayerscale", layerscale, lsr), ("dbias", bias, br)):
        if a is not None:
            assert_close_tolerance(a.grad, h.grad, None, name=name)
    if dropout_p > 0:
        assert bool((x0.grad[mask == 0] == 0).all())


def test_subset_without_out_subset_returns_every_row():
    x0_mask, _, x0_subset = _droppath(2, 3, [False, True])
    x0 = randn((3, 8))
    w = torch.ones(8)
    out = dropout_add_layer_norm_subset(x0.reshape(1, 3, 8), None, w, None, 0.0, 1e-5, x0_subset=x0_subset,
                                        rowscale_const=2.0)
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out[1], F.layer_norm(2.0 * x0, (8,), w, None, 1e-5))
    assert bool((out[0] == 0).all())  # dropped rows normalize zeros to the bias (none here)


@pytest.mark.parametrize("rms", [False, True])
def test_parallel_residual(rms):
    shape, n = (3, 4, 16), 16
    x0, x1, res = randn(shape), randn(shape), randn(shape)
    w0, w1 = torch.rand(n) + 0.5, torch.rand(n) + 0.5
    b0, b1 = (None, None) if rms else (randn(n), randn(n))
    fn = dropout_add_rms_norm_parallel_residual if rms else dropout_add_layer_norm_parallel_residual
    z0, z1, h, m0, m1 = fn(x0, x1, res, w0, b0, w1, b1, 0.0, 1e-5, prenorm=True, return_dropout_mask=True)
    want = layer_norm_ref(x0, w0, b0, residual=res, x1=x1, weight1=w1, bias1=b1, eps=1e-5, prenorm=True,
                          is_rms_norm=rms)
    for a, b in zip((z0, z1, h), want):
        torch.testing.assert_close(a, b)
    assert m0.dtype == torch.uint8 and bool((m0 == 1).all()) and bool((m1 == 1).all())
    # No weight1: the second output is None; no x1: its mask is all ones even with dropout.
    z0, z1 = fn(x0, None, res, w0, b0, None, None, 0.0, 1e-5)
    assert z1 is None
    torch.testing.assert_close(z0, layer_norm_ref(x0, w0, b0, residual=res, eps=1e-5, is_rms_norm=rms))
    *_, m0, m1 = fn(x0, None, None, w0, b0, w1, b1, 0.4, 1e-5, return_dropout_mask=True)
    assert 0.4 < m0.float().mean().item() < 0.8 and bool((m1 == 1).all())


def test_modules_and_plain_norms():
    x0, res = randn((2, 3, 12)), randn((2, 3, 12))
    m = DropoutAddLayerNorm(12, prenorm=True, p=0.5, eps=1e-4)
    assert m.epsilon == 1e-4 and m.eps == 1e-4 and m.p == 0.5
    assert torch.equal(m.weight, torch.ones(12)) and torch.equal(m.bias, torch.zeros(12))
    m.eval()
    out, h = m(x0, res)
    torch.testing.assert_close(h, x0 + res)
    torch.testing.assert_close(out, F.layer_norm(x0 + res, (12,), eps=1e-4))
    m.train()
    out_train, h_train = m(x0, res)
    assert not torch.allclose(h_train, h)  # dropout is active in training only

    r = DropoutAddRMSNorm(12, dtype=torch.float64)
    assert r.bias is None and r.weight.dtype == torch.float64
    torch.testing.assert_close(r(x0.double()), F.rms_norm(x0.double(), (12,), eps=1e-5))

    plain = RMSNorm(12, eps=1e-3)
    torch.testing.assert_close(plain(x0), F.rms_norm(x0, (12,), eps=1e-3))
    torch.testing.assert_close(rms_norm(x0, plain.weight, 1e-3), plain(x0))
    w, b = torch.rand(12) + 0.5, randn(12)
    torch.testing.assert_close(legacy_ln.layer_norm(x0, w, b, 1e-5), F.layer_norm(x0, (12,), w, b, 1e-5))
    assert legacy_rms.rms_norm(x0.half(), w, 1e-5).dtype == torch.float16  # output keeps the input dtype


def test_bad_inputs():
    x0 = randn((2, 8))
    w = torch.ones(8)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_add_layer_norm(x0, None, w, None, 1.0, 1e-5)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_add_rms_norm(x0, None, w, None, -0.1, 1e-5)
    with pytest.raises(TypeError, match="floating-point"):
        dropout_add_layer_norm(torch.ones(2, 8, dtype=torch.int64), None, w, None, 0.0, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        dropout_add_layer_norm(x0, randn((2, 9)), w, None, 0.0, 1e-5)
