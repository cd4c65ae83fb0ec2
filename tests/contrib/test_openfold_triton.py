"""contrib.openfold_triton attention (ops.pair_attention) and LayerNorm against float64 references.

The kernels run under the Triton interpreter at small odd sizes (N = 19 crosses the interpreter's
16-wide tiles); every test checks the output and the gradients of q, k, v and the bias, the bias
gradient summed over whatever dims the bias is broadcast on.
"""

from __future__ import annotations

import math

import pytest
import torch
from fresh_python import run_python

from culmen.contrib.openfold_triton import (
    AttnBiasJIT,
    AttnNoBiasJIT,
    AttnTri,
    CanSchTriMHA,
    LayerNormSmallShapeOptImpl,
    mha,
)
from culmen.ops.pair_attention import pair_attention, pair_attention_ref
from culmen.testing import assert_close_tolerance, poisoned_allocations, randn


def _key_mask(shape, dtype=torch.float32, p=0.35):
    """A random 0/1 mask that keeps key 0, so no row is fully masked."""
    m = torch.rand(shape) > p
    m[..., 0] = True
    return m if dtype == torch.bool else m.to(dtype)


def _grads(out, inputs, do):
    want = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(out, want, do)


def _leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_(t.requires_grad)


def _check(fn, q, k, v, bias, mask, *, names=("q", "k", "v", "bias"), inf=1e9):
    """``fn(q, k, v, bias, mask)`` and its gradients against the float64 reference (tolerance rule)."""
    do = randn(q.shape, q.dtype, q.device)
    out = fn(q, k, v, bias, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    grads = _grads(out, (q, k, v, bias), do)
    lo_dtype = q.dtype
    refs = {}
    for dt in (torch.float64, lo_dtype):
        args = [None if t is None else _leaf(t, dt) for t in (q, k, v, bias)]
        o = pair_attention_ref(*args, mask, inf, compute_dtype=dt)
        refs[dt] = (o, _grads(o, args, do.to(dt)))
    assert_close_tolerance(out, refs[torch.float64][0], refs[lo_dtype][0], name="out")
    for name, g, hi, lo in zip(names, grads, refs[torch.float64][1], refs[lo_dtype][1]):
        assert_close_tolerance(g, hi, lo, name=f"d{name}")
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triangle_attention_layout(triton_backend, dtype):
    """OpenFold's triangle attention: q/k/v [B, I, H, N, D] transposed views, bias [B, 1, H, N, N] summed over
    I in the gradient, mask [B, I, 1, 1, N]."""
    B, R, H, N, D = 1, 3, 2, 19, 12
    q, k, v = (randn((B, R, N, H, D), dtype).transpose(-2, -3).requires_grad_() for _ in range(3))
    assert not q.is_contiguous()
    bias = randn((B, 1, H, N, N), dtype, requires_grad=True)
    mask = _key_mask((B, R, 1, 1, N))
    with poisoned_allocations():
        _check(lambda *a: AttnTri(a[0], a[1], a[2], a[4], a[3], 1e9, True), q, k, v, bias, mask)


def test_4d_cross_lengths_full_bias_bool_mask(triton_backend):
    """[Z, H, M, D] x [Z, H, N, D] with M != N, a full (unbroadcast) bias: the dQ kernel stores dS directly."""
    Z, H, M, N, D = 2, 3, 7, 21, 8
    q = randn((Z, H, M, D), requires_grad=True)
    k, v = (randn((Z, H, N, D), requires_grad=True) for _ in range(2))
    bias = randn((Z, H, M, N), requires_grad=True)
    mask = _key_mask((Z, 1, M, N), torch.bool)
    _check(lambda q, k, v, b, m: pair_attention(q, k, v, b, m), q, k, v, bias, mask)


def test_bias_broadcast_over_heads_rows_and_keys(triton_backend):
    """A bias [Z, 1, M, 1] (broadcast over heads and keys: kernel sum over H, then PyTorch over N), a 6-d q
    with 3 batch dims (merged), and no mask."""
    q = randn((2, 1, 2, 2, 5, 16), requires_grad=True)
    k, v = (randn((2, 1, 2, 2, 17, 16), requires_grad=True) for _ in range(2))
    bias = randn((2, 1, 1, 1, 5, 1), requires_grad=True)
    _check(lambda q, k, v, b, m: pair_attention(q, k, v, b, m), q, k, v, bias, None)


def test_no_bias_and_attn_jit_entry_points(triton_backend):
    """AttnNoBiasJIT (mask only) and AttnBiasJIT (bias over the batch dim: [1, H, N, N]) against the reference."""
    Z, H, N, D = 3, 2, 13, 32
    q, k, v = (randn((Z, H, N, D), requires_grad=True) for _ in range(3))
    mask = _key_mask((Z, 1, 1, N))
    _check(lambda q, k, v, b, m: AttnNoBiasJIT(q, k, v, m, 1e9), q, k, v, None, mask, names=("q", "k", "v"))
    bias = randn((1, H, N, N), requires_grad=True)
    _check(lambda q, k, v, b, m: AttnBiasJIT(q, k, v, m, b, 1e9), q, k, v, bias, mask)


def test_soft_mask_values_follow_the_formula(triton_backend):
    """A non-binary float mask adds (mask - 1) * inf exactly as the formula does (small inf, visible effect)."""
    q, k, v = (randn((1, 2, 9, 16), requires_grad=True) for _ in range(3))
    mask = torch.rand(1, 1, 9, 9)
    _check(lambda q, k, v, b, m: pair_attention(q, k, v, b, m, inf=3.0), q, k, v, None, mask,
           names=("q", "k", "v"), inf=3.0)


@pytest.fixture
def pair_tuning():
    """Set ``culmen.ops.pair_attention.launch.TUNING`` entries for one test; the old values come back after."""
    from culmen.ops.pair_attention.launch import TUNING

    saved = dict(TUNING)
    yield TUNING.update
    TUNING.update(saved)


@pytest.mark.parametrize("setting", [{"dq_nodbias": "staged", "dbias_reduce": "torch"},
                                     {"dq_nodbias": "recompute", "interp_unroll": 4}])
def test_backward_variants(triton_backend, pair_tuning, setting):
    """The switchable backward paths: dQ from the stored dS or recomputed when the bias gets no gradient, the
    bias gradient summed over I by torch.sum or by the reduce kernel (an unroll longer than I = 3)."""
    pair_tuning(setting)
    B, R, H, N, D = 1, 3, 2, 19, 12
    q, k, v = (randn((B, R, N, H, D), torch.bfloat16).transpose(-2, -3).requires_grad_() for _ in range(3))
    mask = _key_mask((B, R, 1, 1, N))
    fn = lambda q, k, v, b, m: AttnTri(q, k, v, m, b, 1e9, True)  # noqa: E731
    _check(fn, q, k, v, randn((B, 1, H, N, N), torch.bfloat16, requires_grad=True), mask)
    _check(fn, q, k, v, randn((B, 1, H, N, N), torch.bfloat16), mask, names=("q", "k", "v"))


def test_fp32_inputs_half_bias_and_reproducible(triton_backend):
    """fp32 q/k/v with an unbroadcast bf16 bias: dS is kept in fp32 for dQ and rounded once for the bias
    gradient; two backward passes agree bitwise."""
    Z, H, M, N, D = 2, 2, 9, 18, 8
    q = randn((Z, H, M, D), requires_grad=True)
    k, v = (randn((Z, H, N, D), requires_grad=True) for _ in range(2))
    bias = randn((Z, H, M, N), torch.bfloat16, requires_grad=True)
    do = randn((Z, H, M, D))
    out = pair_attention(q, k, v, bias)
    grads = torch.autograd.grad(out, (q, k, v, bias), do)
    assert grads[3].dtype == torch.bfloat16
    again = torch.autograd.grad(pair_attention(q, k, v, bias), (q, k, v, bias), do)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    args = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref = torch.autograd.grad(pair_attention_ref(*args), args, do.double())
    lo_args = [t.detach().float().requires_grad_() for t in (q, k, v, bias)]
    lo = torch.autograd.grad(pair_attention_ref(*lo_args), lo_args, do)
    for name, g, hi, glo in zip(("q", "k", "v", "bias"), grads, ref, lo):
        assert_close_tolerance(g, hi, glo.to(g.dtype), name=f"d{name}")


def test_no_grad_forward_and_reference_backend(reference_backend):
    q, k, v = (randn((2, 2, 11, 8)) for _ in range(3))
    bias = randn((1, 2, 11, 11))
    mask = _key_mask((2, 1, 1, 11))
    out = AttnTri(q, k, v, mask, bias, 1e9, False)
    ref = pair_attention_ref(q.double(), k.double(), v.double(), bias.double(), mask.double())
    assert_close_tolerance(out, ref, pair_attention_ref(q, k, v, bias, mask))


def test_bad_arguments():
    q = randn((2, 2, 5, 8))
    with pytest.raises(ValueError, match="bias"):
        pair_attention(q, q, q, randn((2, 3, 5, 5)))
    with pytest.raises(ValueError, match="k and v"):
        pair_attention(q, q, randn((2, 2, 6, 8)))
    with pytest.raises(TypeError, match="q"):
        pair_attention(q.to(torch.int32), q, q)
    with pytest.raises(TypeError, match="share one dtype"):
        pair_attention(q, q.double(), q)
    with pytest.raises(ValueError, match="at least 3 dims"):
        pair_attention(q[0, 0], q, q)
    with pytest.raises(ValueError, match="inf"):
        pair_attention(q, q, q, inf=-1.0)


def test_mha_switches_and_can_schedule():
    assert mha.is_enabled() is False
    mha.enable()
    try:
        assert mha.is_enabled() is True
    finally:
        mha.disable()
    assert mha.is_enabled() is False
    assert CanSchTriMHA([1, 256, 4, 256, 32]) and CanSchTriMHA([1, 37, 3, 41, 24], has_bias=False)
    assert not CanSchTriMHA([1, 4, 8, 512])  # head dim above 256
    assert not CanSchTriMHA([8, 16])
    with pytest.raises(TypeError, match="in_shape"):
        CanSchTriMHA(None)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7, 33)])
def test_layer_norm_small_shape(shape):
    """LayerNormSmallShapeOptImpl over the last two dims (and a non-contiguous input over the last)."""
    ns = shape[-2:] if len(shape) == 4 else shape[-1:]
    x = randn(shape, requires_grad=True)
    xin = x.transpose(0, 1).contiguous().transpose(0, 1) if len(shape) == 3 else x
    w, b = randn(ns, requires_grad=True), randn(ns, requires_grad=True)
    y = LayerNormSmallShapeOptImpl.apply(xin, ns, w, b, 1e-5)
    dy = randn(shape)
    g = torch.autograd.grad(y, (x, w, b), dy)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    yr = torch.nn.functional.layer_norm(xd, ns, wd, bd, 1e-5)
    gr = torch.autograd.grad(yr, (xd, wd, bd), dy.double())
    ylo = torch.nn.functional.layer_norm(x, ns, w, b, 1e-5)
    glo = torch.autograd.grad(ylo, (x, w, b), dy)
    assert_close_tolerance(y, yr, ylo, name="y")
    for name, a, hi, lo in zip(("dx", "dw", "db"), g, gr, glo):
        assert_close_tolerance(a, hi, lo, name=name)
    with pytest.raises(ValueError, match="normalized_shape"):
        LayerNormSmallShapeOptImpl.apply(x, (9,), None, None)


def test_apex_alias_imports():
    code = """
import culmen.compat as compat
compat.install()
from apex.contrib.openfold_triton import (AttnBiasJIT, AttnNoBiasJIT, AttnTri, CanSchTriMHA,
    LayerNormSmallShapeOptImpl, sync_triton_auto_tune_cache_across_gpus, _tuneable_triton_kernels)
from apex.contrib.openfold_triton.mha import enable, disable, is_enabled
from apex.contrib.openfold_triton.fused_adam_swa import AdamMathType, FusedAdamSWA
import culmen.contrib.openfold_triton as c
assert AttnTri is c.AttnTri and FusedAdamSWA is c.FusedAdamSWA
assert set(_tuneable_triton_kernels) == {"layer_norm", "pair_attention"}
print("OK")
"""
    assert run_python(code) == "OK"


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,d", [(256, 32), (131, 16), (200, 64)])
def test_triangle_attention_gpu(dtype, n, d):
    torch.manual_seed(1)
    dev = "cuda"
    B, R, H = 1, 24, 4
    q, k, v = ((torch.randn(B, R, n, H, d, device=dev) * 0.5).to(dtype).transpose(-2, -3).requires_grad_()
               for _ in range(3))
    bias = torch.randn(B, 1, H, n, n, device=dev, dtype=dtype).requires_grad_()
    mask = _key_mask((B, R, 1, 1, n)).to(dev, dtype)
    out, grads = _check(lambda *a: AttnTri(a[0], a[1], a[2], a[4], a[3], 1e9, True), q, k, v, bias, mask)
    # Deterministic: the bias gradient is reduced without atomics.
    out2 = AttnTri(q, k, v, mask, bias, 1e9, True)
    do = torch.randn_like(out2)
    g1 = torch.autograd.grad(out2, (q, k, v, bias), do)
    g2 = torch.autograd.grad(AttnTri(q, k, v, mask, bias, 1e9, True), (q, k, v, bias), do)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert math.isfinite(out.float().abs().max().item())
