"""culmen.normalization against Apex's API and a float64 reference.

Kernel cases run on both backends (the PyTorch reference path and the Triton kernels under the CPU
interpreter); API, dtype-rule and error cases run on the default (reference) path only.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from culmen.flash_attn.ops.triton.layer_norm import rms_norm_fn
from culmen.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from culmen.normalization import fused_layer_norm as fln
from culmen.ops.layer_norm.reference import layer_norm_ref
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

BACKENDS = ["reference", "triton"]
_EMPTY = inspect.Parameter.empty


def _params(obj) -> list[tuple[str, object]]:
    sig = inspect.signature(obj)
    return [(n, p.default) for n, p in sig.parameters.items() if n != "self"]


@pytest.mark.parametrize(
    "obj, expected",
    [
        (fln.fused_layer_norm_affine,
         [("input", _EMPTY), ("weight", _EMPTY), ("bias", _EMPTY), ("normalized_shape", _EMPTY), ("eps", 1e-6),
          ("memory_efficient", False)]),
        (fln.mixed_dtype_fused_layer_norm_affine,
         [("input", _EMPTY), ("weight", _EMPTY), ("bias", _EMPTY), ("normalized_shape", _EMPTY), ("eps", 1e-6),
          ("memory_efficient", False)]),
        (fln.fused_layer_norm,
         [("input", _EMPTY), ("normalized_shape", _EMPTY), ("eps", 1e-6), ("memory_efficient", False)]),
        (fln.fused_rms_norm_affine,
         [("input", _EMPTY), ("weight", _EMPTY), ("normalized_shape", _EMPTY), ("eps", 1e-6),
          ("memory_efficient", False)]),
        (fln.mixed_dtype_fused_rms_norm_affine,
         [("input", _EMPTY), ("weight", _EMPTY), ("normalized_shape", _EMPTY), ("eps", 1e-6),
          ("memory_efficient", False)]),
        (fln.fused_rms_norm,
         [("input", _EMPTY), ("normalized_shape", _EMPTY), ("eps", 1e-6), ("memory_efficient", False)]),
        (fln.manual_rms_norm, [("input", _EMPTY), ("normalized_shape", _EMPTY), ("weight", _EMPTY), ("eps", _EMPTY)]),
        (FusedLayerNorm,
         [("normalized_shape", _EMPTY), ("eps", 1e-5), ("elementwise_affine", True), ("memory_efficient", False),
          ("device", None), ("dtype", None)]),
        (FusedRMSNorm,
         [("normalized_shape", _EMPTY), ("eps", 1e-5), ("elementwise_affine", True), ("memory_efficient", False),
          ("device", None), ("dtype", None)]),
        (MixedFusedLayerNorm, [("normalized_shape", _EMPTY), ("eps", 1e-5), ("memory_efficient", False),
                               ("kwargs", _EMPTY)]),
        (MixedFusedRMSNorm, [("normalized_shape", _EMPTY), ("eps", 1e-5), ("memory_efficient", False),
                             ("kwargs", _EMPTY)]),
        (fln.FusedLayerNormAffineFunction.apply,
         [("input", _EMPTY), ("weight", _EMPTY), ("bias", _EMPTY), ("normalized_shape", _EMPTY), ("eps", _EMPTY),
          ("memory_efficient", False)]),
    ],
    ids=lambda v: getattr(v, "__qualname__", None) or "",
)
def test_signatures_match_apex(obj, expected):
    assert _params(obj) == expected
    if obj in (MixedFusedLayerNorm, MixedFusedRMSNorm):
        assert inspect.signature(obj).parameters["memory_efficient"].kind is inspect.Parameter.KEYWORD_ONLY


def test_module_attributes_and_init():
    m = FusedLayerNorm([5, 7])
    assert m.normalized_shape == torch.Size([5, 7]) and isinstance(m.normalized_shape, torch.Size)
    assert m.eps == 1e-5 and m.elementwise_affine and not m.memory_efficient
    assert torch.equal(m.weight, torch.ones(5, 7)) and torch.equal(m.bias, torch.zeros(5, 7))
    assert repr(m) == "FusedLayerNorm(torch.Size([5, 7]), eps=1e-05, elementwise_affine=True)"
    with torch.no_grad():
        m.weight.mul_(3.0)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.ones(5, 7))

    r = FusedRMSNorm(9, eps=1e-3, dtype=torch.float64)
    assert r.normalized_shape == (9,) and r.eps == 1e-3 and r.weight.dtype == torch.float64
    assert [n for n, _ in r.named_parameters()] == ["weight"]

    plain = FusedLayerNorm(9, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None and list(plain.parameters()) == []
    assert "elementwise_affine=False" in repr(plain)
    assert list(FusedRMSNorm(9, elementwise_affine=False).parameters()) == []

    mixed = MixedFusedLayerNorm(9, dtype=torch.bfloat16)
    assert mixed.elementwise_affine and mixed.weight.dtype == torch.bfloat16 and mixed.bias.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Forward and backward against the float64 reference
# ---------------------------------------------------------------------------------------------


def _ref(x, w, b, shape, eps, rms, out_dtype=None):
    """Reference over the flattened trailing dims, in the dtype of its inputs."""
    n = math.prod(shape)
    lead = x.shape[: x.dim() - len(shape)]
    y = layer_norm_ref(x.reshape(*lead, n), w.reshape(n) if w is not None else None,
                       b.reshape(n) if b is not None else None, eps=eps, is_rms_norm=rms, out_dtype=out_dtype)
    return y.reshape(x.shape)


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)


def _fwd_bwd(fn, inputs, g):
    y = fn(*inputs)
    y.backward(g.to(y.dtype))
    return y, [t.grad if t is not None else None for t in inputs]


def _affine_params(shape, dtype, bias=True):
    w = (torch.rand(shape) + 0.5).to(dtype)  # away from 0 so memory_efficient's y / w stays well conditioned
    b = (randn(shape) * 0.2).to(dtype) if bias else None
    return w, b


CASES = [
    # kind, dtype, input shape, normalized_shape, non-contiguous, memory_efficient, affine
    ("ln", torch.float32, (3, 63), (63,), False, False, True),
    ("ln", torch.float16, (2, 5, 40), (5, 40), True, False, True),
    ("ln", torch.bfloat16, (2, 3, 4, 10), (3, 4, 10), False, True, True),
    ("ln", torch.float32, (4, 257), (257,), True, True, False),
    ("rms", torch.float32, (3, 63), (63,), True, False, True),
    ("rms", torch.bfloat16, (2, 5, 40), (5, 40), False, True, True),
    ("rms", torch.float16, (4, 257), 257, False, False, False),
    ("rms", torch.float16, (2, 3, 4, 10), (3, 4, 10), True, True, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, dtype, shape, nshape, noncontig, mem_eff, affine", CASES)
def test_forward_backward_matches_float64(request, backend, kind, dtype, shape, nshape, noncontig, mem_eff, affine):
    request.getfixturevalue(f"{backend}_backend")
    rms = kind == "rms"
    ns = (nshape,) if isinstance(nshape, int) else nshape
    eps = 1e-5
    x = randn(shape, dtype)
    w, b = _affine_params(ns, dtype, bias=not rms) if affine else (None, None)
    g = randn(shape)

    if kind == "ln":
        module = FusedLayerNorm(nshape, eps=eps, elementwise_affine=affine, memory_efficient=mem_eff, dtype=dtype)
    else:
        module = FusedRMSNorm(nshape, eps=eps, elementwise_affine=affine, memory_efficient=mem_eff, dtype=dtype)
    if affine:
        with torch.no_grad():
            module.weight.copy_(w)
            if b is not None:
                module.bias.copy_(b)
    xin = make_noncontiguous(x).requires_grad_(True) if noncontig else _leaf(x)
    assert xin.is_contiguous() is not noncontig
    y = module(xin)
    y.backward(g.to(y.dtype))
    assert y.dtype == dtype and y.shape == x.shape

    params = [w, b]
    ref = lambda xx, ww, bb: _ref(xx, ww, bb, ns, eps, rms)
    y_hi, grads_hi = _fwd_bwd(ref, [_leaf(x, torch.float64)] + [_leaf(p, torch.float64) for p in params], g.double())
    y_lo, grads_lo = _fwd_bwd(ref, [_leaf(x)] + [_leaf(p) for p in params], g)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    assert_close_tolerance(xin.grad, grads_hi[0], grads_lo[0], name="dx")
    if affine:
        assert module.weight.grad.dtype == dtype
        assert_close_tolerance(module.weight.grad, grads_hi[1], grads_lo[1], name="dweight")
        if not rms:
            assert_close_tolerance(module.bias.grad, grads_hi[2], grads_lo[2], name="dbias")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rms", [False, True])
def test_mixed_output_has_parameter_dtype(request, backend, rms):
    request.getfixturevalue(f"{backend}_backend")
    shape, ns = (2, 5, 40), (5, 40)
    x = randn(shape, torch.bfloat16)
    w, b = _affine_params(ns, torch.float32, bias=not rms)
    g = randn(shape)
    m = (MixedFusedRMSNorm if rms else MixedFusedLayerNorm)(ns)
    with torch.no_grad():
        m.weight.copy_(w)
        if not rms:
            m.bias.copy_(b)
    xin = _leaf(x)
    y = m(xin)
    assert y.dtype == torch.float32
    y.backward(g)
    assert xin.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32

    def ref(xx, ww, bb):
        return _ref(xx, ww, bb, ns, 1e-5, rms, out_dtype=ww.dtype)

    y_hi, grads_hi = _fwd_bwd(ref, [_leaf(x, torch.float64), _leaf(w, torch.float64), _leaf(b, torch.float64)],
                              g.double())
    # Baseline: PyTorch with everything in fp32 (the mixed op's own compute precision, bf16 input exact in fp32).
    y_lo, grads_lo = _fwd_bwd(ref, [_leaf(x, torch.float32), _leaf(w), _leaf(b)], g)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    assert_close_tolerance(xin.grad, grads_hi[0], grads_lo[0].to(torch.bfloat16), name="dx")
    assert_close_tolerance(m.weight.grad, grads_hi[1], grads_lo[1], name="dweight")

    # The other direction: bf16 parameters, fp32 activations -> bf16 output.
    m2 = (MixedFusedRMSNorm if rms else MixedFusedLayerNorm)(ns, dtype=torch.bfloat16)
    assert m2(randn(shape)).dtype == torch.bfloat16


def test_functionals_match_modules_and_function_shims():
    ns = (4, 9)
    x = randn((3, 4, 9))
    w, b = _affine_params(ns, torch.float32)
    y = fln.fused_layer_norm_affine(x, w, b, ns, 1e-5)
    torch.testing.assert_close(y, F.layer_norm(x, ns, w, b, 1e-5))
    torch.testing.assert_close(fln.FusedLayerNormAffineFunction.apply(x, w, b, ns, 1e-5), y)
    torch.testing.assert_close(fln.FusedLayerNormAffineMixedDtypesFunction.apply(x, w, b, ns, 1e-5), y)
    torch.testing.assert_close(fln.fused_layer_norm(x, ns), F.layer_norm(x, ns, eps=1e-6))
    torch.testing.assert_close(fln.FusedLayerNormFunction.apply(x, ns, 1e-6), fln.fused_layer_norm(x, ns))
    torch.testing.assert_close(fln.fused_rms_norm_affine(x, w, ns), F.rms_norm(x, ns, w, 1e-6))
    torch.testing.assert_close(fln.FusedRMSNormAffineFunction.apply(x, w, ns, 1e-6), F.rms_norm(x, ns, w, 1e-6))
    torch.testing.assert_close(fln.FusedRMSNormAffineMixedDtypesFunction.apply(x, w, ns, 1e-6),
                               F.rms_norm(x, ns, w, 1e-6))
    torch.testing.assert_close(fln.fused_rms_norm(x, ns), F.rms_norm(x, ns, eps=1e-6))
    torch.testing.assert_close(fln.FusedRMSNormFunction.apply(x, ns, 1e-6), F.rms_norm(x, ns, eps=1e-6))
    torch.testing.assert_close(fln.mixed_dtype_fused_rms_norm_affine(x, w, ns), F.rms_norm(x, ns, w, 1e-6))
    # memory_efficient changes what is saved, not the result.
    xg = _leaf(x)
    fln.fused_layer_norm_affine(xg, w, b, ns, 1e-5, True).sum().backward()
    xr = _leaf(x)
    F.layer_norm(xr, ns, w, b, 1e-5).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)


def test_manual_rms_norm_keeps_apex_dtype_rules():
    x = randn((3, 4, 6), torch.float16)
    out = fln.manual_rms_norm(x, (4, 6), None, 1e-6)
    assert out.dtype == torch.float32  # the fp32 mean square promotes the product, as in Apex
    xd = x.double()
    expect = xd / torch.sqrt(xd.pow(2).mean((-2, -1), keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), expect, rtol=1e-3, atol=1e-3)
    w = (torch.rand(4, 6) + 0.5).half()
    out_w = fln.manual_rms_norm(x, (4, 6), w, 1e-6)
    assert out_w.dtype == torch.float16
    torch.testing.assert_close(out_w.double(), expect * w.double(), rtol=2e-3, atol=2e-3)
    assert fln.manual_rms_norm(x, 6, w[0].float(), 1e-6).dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Autocast (Apex casts input and parameters to the autocast dtype, then runs with autocast off)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_cpu_autocast_casts_like_apex(cls):
    ns = (3, 10)
    m = cls(ns)
    with torch.no_grad():
        m.weight.copy_(torch.rand(ns) + 0.5)
    x = randn((2, 3, 10), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32
    rms = cls in (FusedRMSNorm, MixedFusedRMSNorm)
    b = getattr(m, "bias", None)
    expect = _ref(x.detach().bfloat16().double(), m.weight.detach().bfloat16().double(),
                  b.detach().bfloat16().double() if b is not None else None, ns, m.eps, rms)
    assert_close_tolerance(y, expect, None, atol=2e-2, name="y")
    # Outside autocast the same module keeps fp32.
    assert m(x).dtype == torch.float32


def test_autocast_on_other_device_type_does_not_cast_cpu_tensors():
    x = randn((2, 8))
    w = torch.rand(8) + 0.5
    with torch.autocast("cuda", dtype=torch.float16, enabled=torch.cuda.is_available()):
        assert fln.fused_rms_norm_affine(x, w, 8).dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_normalized_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(5, 7\).*\(2, 5, 6\)"):
        FusedLayerNorm((5, 7))(randn((2, 5, 6)))
    with pytest.raises(ValueError, match="normalized_shape"):
        fln.fused_rms_norm(randn((4,)), (2, 4))
    with pytest.raises(ValueError, match="weight"):
        fln.fused_layer_norm_affine(randn((2, 6)), torch.ones(5), torch.zeros(5), 6)


def test_dtype_mismatch_points_to_mixed_variant():
    m = FusedLayerNorm(8)  # fp32 parameters
    with pytest.raises(TypeError, match=r"torch\.float32.*torch\.bfloat16.*MixedFusedLayerNorm"):
        m(randn((2, 8), torch.bfloat16))
    with pytest.raises(TypeError, match=r"torch\.float16.*MixedFusedRMSNorm"):
        fln.fused_rms_norm_affine(randn((2, 8), torch.float16), torch.ones(8), 8)
    # The mixed variant accepts the same call.
    assert MixedFusedLayerNorm(8)(randn((2, 8), torch.bfloat16)).dtype == torch.float32


def test_integer_input_is_a_type_error():
    with pytest.raises(TypeError, match="floating-point"):
        FusedLayerNorm(4)(torch.arange(8).reshape(2, 4))
    with pytest.raises(TypeError, match="floating-point"):
        fln.fused_rms_norm(torch.ones(2, 4, dtype=torch.int32), 4)


def test_mixed_rejects_elementwise_affine_false_like_apex():
    for cls in (MixedFusedLayerNorm, MixedFusedRMSNorm):
        with pytest.warns(UserWarning, match="elementwise_affine"), pytest.raises(RuntimeError, match="False"):
            cls(8, elementwise_affine=False)
        with pytest.warns(UserWarning, match="elementwise_affine"):
            assert cls(8, elementwise_affine=True).weight.shape == (8,)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = FusedLayerNorm((4, 8))
        self.proj = torch.nn.Linear(32, 32)
        self.w = torch.nn.Parameter(torch.rand(32) + 0.5)
        with torch.no_grad():
            self.ln.weight.copy_(torch.rand(4, 8) + 0.5)

    def forward(self, x):
        h = self.proj(self.ln(x).flatten(-2))
        y, res = rms_norm_fn(h, self.w, None, residual=x.flatten(-2), eps=1e-6, prenorm=True)
        return y * torch.sigmoid(res)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_matches_eager(request, backend):
    request.getfixturevalue(f"{backend}_backend")
    torch._dynamo.reset()
    model = _Tiny()
    x = randn((3, 4, 8))
    g = randn((3, 32))

    def run(fn):
        model.zero_grad()
        xx = _leaf(x)
        y = fn(xx)
        y.backward(g)
        return y.detach(), xx.grad, [p.grad.clone() for p in model.parameters()]

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    y_c, dx_c, dp_c = run(compiled)
    y_e, dx_e, dp_e = run(model)
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(dx_c, dx_e)
    for a, b in zip(dp_c, dp_e):
        torch.testing.assert_close(a, b)
