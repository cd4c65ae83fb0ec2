"""``culmen.ops.index_mul_2d`` on a real GPU at real sizes (run by ``scripts/gpu-check``).

Tolerance rule as in ``test_index_mul_2d.py`` (oracle: ``in1[idx] * in2`` under autograd on float64
copies) for both scatters of ``grad_in1`` (sorted segments, fp32 atomics), the double backward, and the
deterministic scatter (bitwise reproducible under ``torch.use_deterministic_algorithms(True)``).
"""

from __future__ import annotations

import pytest
import torch

from culmen.ops.index_mul_2d import index_mul_2d, index_mul_2d_ref
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DEV = "cuda"


@pytest.fixture(params=["segment", "atomic", "deterministic"])
def deterministic(request, monkeypatch):
    """The scatter of grad_in1: sorted segments, fp32 atomics (L2-blocked), or deterministic mode."""
    from culmen.ops.index_mul_2d import launch as im_launch

    monkeypatch.setitem(im_launch.TUNING, "scatter", "atomic" if request.param == "atomic" else "segment")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param == "deterministic")
    yield request.param == "deterministic"
    torch.use_deterministic_algorithms(previous)


def _inputs(M, N, F, dtype, noncontig=False):
    in1, in2 = randn((M, F), dtype, DEV), randn((N, F), dtype, DEV)
    if noncontig:
        in1, in2 = make_noncontiguous(in1), make_noncontiguous(in2)
    return in1.requires_grad_(), in2.requires_grad_(), torch.randint(0, M, (N,), device=DEV)


@pytest.mark.parametrize("M, N, F, dtype, noncontig", [
    (262144, 1048576, 64, F32, False),
    (262144, 1048576, 128, F16, False),
    (1000, 50000, 37, BF16, True),
    (7, 100000, 16, F32, False),  # heavy duplicates: ~14000 rows per index
], ids=lambda v: str(v))
def test_tolerance_rule(M, N, F, dtype, noncontig, deterministic):
    in1, in2, idx = _inputs(M, N, F, dtype, noncontig)
    out = index_mul_2d(in1, in2, idx)
    g = randn(out.shape, dtype, DEV)
    got = (out, *torch.autograd.grad(out, (in1, in2), g))
    refs = {}
    for hi in (True, False):
        a, b = (t.detach().to(F64 if hi else dtype).requires_grad_() for t in (in1, in2))
        r = index_mul_2d_ref(a, b, idx)
        refs[hi] = (r, *torch.autograd.grad(r, (a, b), g.to(r.dtype)))
    for name, t, hi, lo in zip(("out", "grad_in1", "grad_in2"), got, refs[True], refs[False]):
        assert_close_tolerance(t, hi, lo, name=f"{name} [{M}x{N}x{F} {dtype}]")


def test_double_backward(deterministic):
    in1, in2, idx = _inputs(5000, 20000, 64, F32)
    g = randn((20000, 64), F32, DEV, requires_grad=True)
    w1, w2 = randn((5000, 64), F32, DEV), randn((20000, 64), F32, DEV)

    def second(fn, a, b, gg):
        ga, gb = torch.autograd.grad(fn(a, b, idx), (a, b), gg, create_graph=True)
        return torch.autograd.grad((ga * w1.to(ga.dtype)).sum() + (gb * w2.to(gb.dtype)).sum(), (a, b, gg))

    got = second(index_mul_2d, in1, in2, g)
    refs = {hi: second(index_mul_2d_ref, *[t.detach().to(F64 if hi else F32).requires_grad_() for t in (in1, in2, g)])
            for hi in (True, False)}
    for name, t, hi, lo in zip(("in1", "in2", "grad_out"), got, refs[True], refs[False]):
        assert_close_tolerance(t, hi, lo, name=f"dd{name}")


def test_deterministic_is_bitwise_reproducible():
    in1, in2, idx = _inputs(64, 400000, 64, F32)  # ~6000 rows per index: atomics reorder the sums
    g = randn((400000, 64), F32, DEV)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        a = torch.autograd.grad(index_mul_2d(in1, in2, idx), in1, g)[0]
        b = torch.autograd.grad(index_mul_2d(in1, in2, idx), in1, g)[0]
        torch.use_deterministic_algorithms(False)
        c = torch.autograd.grad(index_mul_2d(in1, in2, idx), in1, g)[0]
    finally:
        torch.use_deterministic_algorithms(previous)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------- the call path (issue 13)


@pytest.fixture
def fresh_plans():
    from culmen.ops.common.plans import clear_plans

    clear_plans()
    yield
    clear_plans()


def test_fast_launch_bitwise(fresh_plans):
    """The direct launch path (second call of a plan) gives what Triton's own launch gives, for the
    forward, the segmented backward and the double backward."""
    from culmen.ops.common.launch import set_fast_launch
    from culmen.ops.index_mul_2d.launch import PLANS

    in1, in2, idx = _inputs(1000, 50000, 37, BF16, noncontig=True)
    g = randn((50000, 37), BF16, DEV, requires_grad=True)
    w1 = randn((1000, 37), BF16, DEV)
    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)
            for _ in range(2):
                out = index_mul_2d(in1, in2, idx)
                ga, gb = torch.autograd.grad(out, (in1, in2), g, create_graph=True)
                dd = torch.autograd.grad((ga.float() * w1.float()).sum() + gb.float().sum(), (in1, in2, g))
                results[mode] = (out, ga, gb, *dd)
            launches = [la for p in PLANS.values() for la in (p.fwd, *p._seg.values(), *p._bwd_bwd.values())]
            assert len(launches) >= 3
            for la in launches:
                assert (la._run is not None) == mode, f"{la.fn.fn.__name__}: {la.error}"
    finally:
        set_fast_launch(True)
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor(dynamic):
    """Under torch.compile (Inductor, fullgraph) the kernels are traced (triton_op + wrap_triton): output and
    gradients equal eager's, and with dynamic shapes new row counts do not recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def fn(a, b, idx):
        return index_mul_2d(a, b, idx) * 2.0

    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    for M, N in ((500, 3000), (733, 4099), (1000, 8192)):
        in1, in2, idx = _inputs(M, N, 64, F32)
        g = randn((N, 64), F32, DEV)
        outs = [(y, *torch.autograd.grad(y, (in1, in2), g)) for y in (f(in1, in2, idx) for f in (fn, compiled))]
        for e, c in zip(*outs):
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1
