"""Scaled masked softmax on a real GPU at real sizes (run by ``scripts/gpu-check``).

Same tolerance rule as ``test_softmax.py`` (float64 oracle on the GPU vs PyTorch's error in the
input dtype), forward and backward. Covers Megatron's shapes (padding and causal, sk 2048 / 4096),
rows past Apex's 16384 limit (the chunked kernels, causal too), odd sizes and dtypes, fully masked
rows, int64 indexing past 2^31 elements, the Apex module, and ``torch.compile`` with inductor.
"""

from __future__ import annotations

import pytest
import torch

from culmen.ops.softmax import scaled_masked_softmax, scaled_masked_softmax_ref
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn
from culmen.transformer import AttnMaskType
from culmen.transformer.functional import FusedScaleMaskSoftmax

pytestmark = pytest.mark.gpu

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DEV = torch.device("cuda")


def _mask(kind: str, B: int, SQ: int, SK: int):
    if kind == "b1qk":
        return torch.rand(B, 1, SQ, SK, device=DEV) < 0.25
    if kind == "b11k":
        lens = torch.randint(1, SK + 1, (B,), device=DEV)
        return (torch.arange(SK, device=DEV)[None] >= lens[:, None]).view(B, 1, 1, SK)
    return None


@pytest.mark.parametrize("shape,dtype,mask_kind,causal", [
    ((4, 16, 2048, 2048), BF16, "b1qk", False),
    ((4, 16, 2048, 2048), BF16, "", True),
    ((2, 8, 1024, 4096), F16, "b11k", False),
    ((1, 8, 4096, 4096), BF16, "", True),
], ids=["pad2048", "causal2048", "keypad4096-f16", "causal4096"])
def test_megatron_shapes(shape, dtype, mask_kind, causal):
    x_grad_check(shape, dtype, mask_kind, causal)


def x_grad_check(shape, dtype, mask_kind, causal, **kw):
    B, NP, SQ, SK = shape
    x = randn(shape, dtype, DEV, scale=4.0)
    if kw.get("noncontig"):
        x = make_noncontiguous(x, pad=5)
    mask = _mask(mask_kind, B, SQ, SK)
    scale = kw.get("scale", 0.125)
    xg = x.detach().clone().requires_grad_()
    y = scaled_masked_softmax(xg, mask, scale, causal)
    g = randn(shape, dtype, DEV)
    y.backward(g)
    hi, lo = x.detach().to(F64).requires_grad_(), x.detach().clone().requires_grad_()
    y_hi = scaled_masked_softmax_ref(hi, mask, scale, causal)
    y_lo = scaled_masked_softmax_ref(lo, mask, scale, causal)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    (d_hi,) = torch.autograd.grad(y_hi, hi, g.to(F64))
    (d_lo,) = torch.autograd.grad(y_lo, lo, g)
    assert_close_tolerance(xg.grad, d_hi, d_lo, name="dx")
    if causal:
        assert not bool(y.triu(1).any())
    return y


@pytest.mark.parametrize("shape,mask_kind,causal", [
    ((1, 4, 64, 32768), "b11k", False),
    ((1, 2, 16, 65536), "b1qk", False),
    ((1, 1, 17000, 17000), "", True),
], ids=["keypad32k", "pad64k", "causal17k"])
def test_long_rows_chunked(shape, mask_kind, causal):
    x_grad_check(shape, BF16, mask_kind, causal)


@pytest.mark.parametrize("sk", [1, 7, 1000, 4097, 16385])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_odd_sizes(sk, dtype):
    x_grad_check((3, 5, 7, sk), dtype, "b1qk", False, noncontig=True, scale=0.7)


def test_fully_masked_rows_are_zero():
    B, NP, SQ, SK = 2, 4, 128, 20000
    mask = torch.rand(B, 1, SQ, SK, device=DEV) < 0.5
    mask[:, :, ::7] = True
    x = randn((B, NP, SQ, SK), BF16, DEV)
    y = scaled_masked_softmax(x, mask, 0.3)
    assert not bool(y[:, :, ::7].any())
    rows = y.float().sum(-1)
    keep = torch.ones(SQ, dtype=torch.bool, device=DEV)
    keep[::7] = False
    torch.testing.assert_close(rows[:, :, keep], torch.ones_like(rows[:, :, keep]), rtol=0, atol=2e-2)


def test_int64_indexing_past_2_31_elements():
    x = randn((1, 1, 65536, 32769), BF16, DEV)  # 2.15e9 elements
    y = scaled_masked_softmax(x, None, 0.5)
    tail = x[:, :, -16:]
    assert_close_tolerance(y[:, :, -16:], scaled_masked_softmax_ref(tail.to(F64), None, 0.5),
                           scaled_masked_softmax_ref(tail, None, 0.5), name="tail")


@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.causal])
def test_apex_module_at_megatron_size(kind):
    b, np_, s = 4, 16, 2048
    sm = FusedScaleMaskSoftmax(False, True, kind, True, lambda t, m: t.masked_fill(m, -10000.0), True, 0.125)
    x = randn((b, np_, s, s), BF16, DEV, scale=4.0)
    mask = (torch.rand(b, 1, s, s, device=DEV) < 0.2) if kind == AttnMaskType.padding else \
        torch.ones(s, s, dtype=torch.bool, device=DEV).triu(1)[None, None]
    y = sm(x, mask)
    torch_path = sm.forward_torch_softmax(x, mask)
    ref = scaled_masked_softmax_ref(x.to(F64), mask, 0.125)
    assert_close_tolerance(y, ref, torch_path, name=str(kind))


def test_torch_compile_inductor():
    mask = torch.rand(2, 1, 512, 1024, device=DEV) < 0.2

    def fn(x):
        return scaled_masked_softmax(x * 1.5, mask, 0.25) * 2.0

    x = randn((2, 8, 512, 1024), BF16, DEV, requires_grad=True)
    torch._dynamo.reset()
    comp = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(comp(x), fn(x), rtol=0, atol=1e-2)
    ga = torch.autograd.grad(fn(x).float().sum(), x)[0]
    gb = torch.autograd.grad(comp(x).float().sum(), x)[0]
    torch.testing.assert_close(gb, ga, rtol=0, atol=1e-2)


# ------------------------------------------------------------------- call path: launches and compile

N_FORMS = 5


def _forms(SK: int, dev=DEV):
    """The call forms of the family: ``{name: (fn, make)}``; ``make(B, SQ)`` draws fresh inputs
    ``(x, *extra)`` for ``fn(x, *extra)``, which returns the outputs whose gradients the tests take."""
    from culmen.transformer.functional.fused_softmax import ScaledUpperTriangMaskedSoftmax

    module = FusedScaleMaskSoftmax(False, True, AttnMaskType.padding, True, lambda t, m: t.masked_fill(m, -1e4),
                                   True, 0.125)

    def scores(*shape):
        return randn(shape, BF16, dev, scale=4.0, requires_grad=True)

    def padded(B, SQ):
        return scores(B, 4, SQ, SK), torch.rand(B, 1, SQ, SK, device=dev) < 0.25

    def keypad(B, SQ):
        lens = torch.randint(1, SK + 1, (B,), device=dev)
        mask = (torch.arange(SK, device=dev)[None] >= lens[:, None]).to(torch.uint8)
        return scores(B, 4, SQ, SK), mask[:, None, None]

    return {
        "padding-bool": (lambda x, m: (scaled_masked_softmax(x, m, 0.125),), padded),
        "keypad-uint8": (lambda x, m: (scaled_masked_softmax(x, m, 0.7),), keypad),
        "causal": (lambda x: (scaled_masked_softmax(x, None, 0.3, causal=True),),
                   lambda B, SQ: (scores(B, 4, SQ, SK),)),
        "apex-module": (lambda x, m: (module(x, m),), padded),
        "apex-3d-causal": (lambda x: (ScaledUpperTriangMaskedSoftmax.apply(x, 0.5),),
                           lambda B, SQ: (scores(B * 4, SQ, SK),)),
    }


def _fwd_bwd(fn, x, *extra):
    outs = fn(x, *extra)
    gen = torch.Generator(x.device).manual_seed(0)
    cots = [torch.randn(o.shape, generator=gen, device=x.device, dtype=F32).to(o.dtype) for o in outs]
    (dx,) = torch.autograd.grad(outs, (x,), cots)
    return (*[o.detach().clone() for o in outs], dx)


def _all_launches():
    from culmen.ops.softmax.launch import PLANS, SoftmaxPlan

    out = []
    for plan in PLANS.values():
        if isinstance(plan, SoftmaxPlan):
            out.append(plan.fwd)
            out += [b.bwd for b in plan._bwd.values()]
        else:
            out.append(plan.bwd)
    return out


@pytest.fixture
def fresh_plans():
    from culmen.ops.common.plans import clear_plans

    clear_plans()
    yield
    clear_plans()


@pytest.mark.parametrize("kernels", ["resident", "chunked"])
def test_fast_launch_bitwise(fresh_plans, monkeypatch, kernels):
    """The direct launch path (the compiled kernel's C launcher, from the second call of a plan on) gives
    bit for bit what Triton's own launch gives, for every call form, forward and backward, with the
    row-resident and the chunked kernels."""
    from culmen.ops.common.launch import set_fast_launch
    from culmen.ops.softmax.launch import TUNING

    if kernels == "chunked":  # rows of 1000 take the chunked kernels (every TUNING change drops the plans)
        for key in ("fwd_max_resident", "bwd_max_resident", "chunk"):
            monkeypatch.setitem(TUNING, key, 256)
    forms = _forms(1000)
    assert len(forms) == N_FORMS
    inputs = {name: make(2, 97) for name, (_, make) in forms.items()}
    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)  # (drops every plan)
            for name, (fn, _) in forms.items():
                results[name, mode] = [_fwd_bwd(fn, *inputs[name]) for _ in range(3)][-1]
            launches = _all_launches()
            assert launches
            for la in launches:
                if mode:
                    assert la._run is not None, f"{la.fn.fn.__name__} never took the direct path: {la.error}"
                else:
                    assert la._run is None
            if kernels == "chunked":
                assert all("chunked" in la.fn.fn.__name__ for la in launches)
    finally:
        set_fast_launch(True)
    for name in forms:
        for a, c in zip(results[name, False], results[name, True]):
            assert torch.equal(a, c), name


def test_non_current_device(fresh_plans):
    """Scores on a GPU that is not the current one: the plans launch on the tensors' device, with results
    equal to the current device's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    dev1 = torch.device("cuda", 1)
    forms0, forms1 = _forms(1000), _forms(1000, dev1)
    for name, (fn0, make) in forms0.items():
        args0 = make(2, 97)
        args1 = [a.detach().to(dev1).requires_grad_(a.requires_grad) for a in args0]
        r0 = [_fwd_bwd(fn0, *args0) for _ in range(2)][-1]
        r1 = [_fwd_bwd(forms1[name][0], *args1) for _ in range(2)][-1]
        assert torch.cuda.current_device() == 0
        for a, c in zip(r0, r1):
            assert c.device == dev1 and torch.equal(a, c.to(DEV)), name


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor_call_forms(dynamic):
    """Under torch.compile (Inductor) the kernels are traced (triton_op + wrap_triton) for every call form:
    results and gradients equal eager's, no graph break (fullgraph), and with dynamic shapes new query
    lengths do not recompile (the key length sets the block: it stays)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    forms = _forms(1000)
    compiled = {name: torch.compile(fn, dynamic=dynamic, fullgraph=True) for name, (fn, _) in forms.items()}
    # (Lengths unequal to every other size of the test: dynamo gives equal sizes one symbol.)
    for SQ in (97, 113, 130):
        for name, (fn, make) in forms.items():
            args = make(2, SQ)
            eager, comp = _fwd_bwd(fn, *args), _fwd_bwd(compiled[name], *args)
            for e, c in zip(eager, comp):
                assert c.dtype == e.dtype and c.shape == e.shape, name
                torch.testing.assert_close(c, e, rtol=0, atol=1e-2, msg=f"{name} SQ={SQ}")
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= N_FORMS
