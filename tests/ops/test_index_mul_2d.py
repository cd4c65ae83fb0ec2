"""``culmen.ops.index_mul_2d`` against a float64 oracle (``in1[idx] * in2`` under autograd), on both CPU paths.

Forward, the gradients of ``in1`` (a scatter-add over repeated indices) and ``in2``, and the double
backward, under the tolerance rule (DESIGN.md); the deterministic (sorted segmented sum) and the atomic
scatter both run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from culmen.ops.index_mul_2d import index_mul_2d, index_mul_2d_ref
from culmen.ops.index_mul_2d import launch as im_launch
from culmen.testing import assert_close_tolerance, make_noncontiguous, poisoned_allocations, randn

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@pytest.fixture(params=["reference", "atomic", "sorted"])
def path(request, monkeypatch):
    """The reference, or the Triton kernels with the atomic or the deterministic scatter (small tiles)."""
    request.getfixturevalue("reference_backend" if request.param == "reference" else "triton_backend")
    monkeypatch.setitem(im_launch.TUNING, "tile", 64)
    monkeypatch.setitem(im_launch.TUNING, "max_block_f", 16)
    monkeypatch.setitem(im_launch.TUNING, "segment_block_f", 16)
    monkeypatch.setitem(im_launch.TUNING, "segment_tile", 64)
    monkeypatch.setitem(im_launch.TUNING, "scatter", "atomic" if request.param == "atomic" else "segment")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param == "sorted")
    yield request.param
    torch.use_deterministic_algorithms(previous)


@dataclass(frozen=True)
class Case:
    M: int
    N: int
    F: int
    dtype: torch.dtype = F32
    noncontig: bool = False
    idx_dtype: torch.dtype = torch.int64

    def __str__(self) -> str:
        dt = {F16: "f16", BF16: "bf16", F32: "f32"}
        s = f"M{self.M}-N{self.N}-F{self.F}-{dt[self.dtype]}"
        return s + ("-noncontig" if self.noncontig else "") + ("-i32" if self.idx_dtype == torch.int32 else "")


CASES = [
    Case(7, 19, 13),
    Case(5, 33, 40, F16),
    Case(11, 23, 3, BF16, idx_dtype=torch.int32),
    Case(3, 17, 37, F32, noncontig=True),
]


def _inputs(case: Case):
    in1 = randn((case.M, case.F), case.dtype)
    in2 = randn((case.N, case.F), case.dtype)
    if case.noncontig:
        in1, in2 = make_noncontiguous(in1), make_noncontiguous(in2)
    idx = torch.randint(0, case.M, (case.N,), dtype=case.idx_dtype)
    idx[:3] = case.M - 1  # a repeated index: the scatter-add really adds
    return in1.requires_grad_(), in2.requires_grad_(), idx


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(path, case):
    in1, in2, idx = _inputs(case)
    with poisoned_allocations():
        out = index_mul_2d(in1, in2, idx)
    g = randn(out.shape, out.dtype)
    with poisoned_allocations():
        gin1, gin2 = torch.autograd.grad(out, (in1, in2), g)
    assert out.dtype == gin1.dtype == gin2.dtype == case.dtype
    refs = {}
    for hi in (True, False):
        a, b = (t.detach().to(F64 if hi else case.dtype).requires_grad_() for t in (in1, in2))
        r = index_mul_2d_ref(a, b, idx.long())
        refs[hi] = (r, *torch.autograd.grad(r, (a, b), g.to(r.dtype)))
    for name, got, i in (("out", out, 0), ("grad_in1", gin1, 1), ("grad_in2", gin2, 2)):
        assert_close_tolerance(got, refs[True][i], refs[False][i], name=f"{name} [{case}]")


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=str)
def test_double_backward(path, case):
    """Gradients of a function of the first-order gradients (create_graph=True) against autograd of the oracle."""
    in1, in2, idx = _inputs(case)
    g = randn((case.N, case.F), case.dtype, requires_grad=True)
    w1, w2 = randn((case.M, case.F), case.dtype), randn((case.N, case.F), case.dtype)

    def second(fn, a, b, gg):
        ga, gb = torch.autograd.grad(fn(a, b, idx), (a, b), gg, create_graph=True)
        return torch.autograd.grad((ga * w1.to(ga.dtype)).sum() + (gb * w2.to(gb.dtype)).sum(), (a, b, gg))

    got = second(index_mul_2d, in1, in2, g)
    refs = {}
    for hi in (True, False):
        cp = [t.detach().to(F64 if hi else case.dtype).requires_grad_() for t in (in1, in2, g)]
        refs[hi] = second(lambda a, b, i: index_mul_2d_ref(a, b, i.long()), *cp)
    for name, got_t, hi_t, lo_t in zip(("in1", "in2", "grad_out"), got, refs[True], refs[False]):
        assert_close_tolerance(got_t, hi_t, lo_t, name=f"dd{name} [{case}]")


def test_gradgradcheck_fp64(reference_backend):
    """The autograd wiring (backward of the backward) by finite differences; the kernels' double backward
    is checked against the oracle in ``test_double_backward`` (gradgradcheck is too slow interpreted)."""
    in1 = randn((4, 6), F64, requires_grad=True)
    in2 = randn((9, 6), F64, requires_grad=True)
    idx = torch.tensor([0, 3, 3, 1, 0, 2, 3, 3, 1])
    assert torch.autograd.gradgradcheck(lambda a, b: index_mul_2d(a, b, idx), (in1, in2))


def test_deterministic_scatter_matches_atomic(triton_backend, monkeypatch):
    """The sorted segmented sum and the atomic scatter agree; the sorted one is bitwise reproducible."""
    monkeypatch.setitem(im_launch.TUNING, "segment_block_f", 8)
    in1, in2 = randn((6, 20), F32), randn((40, 20), F32)
    idx = torch.randint(0, 5, (40,))  # row 5 of in1 is never indexed: its gradient must be zeros
    g = randn((40, 20))
    monkeypatch.setitem(im_launch.TUNING, "scatter", "atomic")
    atomic = im_launch.index_mul_2d_bwd(g, in1, in2, idx, True, True, deterministic=False)
    monkeypatch.setitem(im_launch.TUNING, "scatter", "segment")
    default = im_launch.index_mul_2d_bwd(g, in1, in2, idx, True, True, deterministic=False)
    sorted_a = im_launch.index_mul_2d_bwd(g, in1, in2, idx, True, True, deterministic=True)
    sorted_b = im_launch.index_mul_2d_bwd(g, in1, in2, idx, True, True, deterministic=True)
    assert torch.equal(sorted_a[0], sorted_b[0]) and torch.equal(sorted_a[1], sorted_b[1])
    assert torch.equal(sorted_a[0], default[0]) and torch.equal(sorted_a[1], default[1])
    torch.testing.assert_close(sorted_a[0], atomic[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(sorted_a[0][5], torch.zeros(20))


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_segment_kernel_out_of_range_indices(triton_backend, monkeypatch, block_m):  # rows per program
    """Indices outside [0, M) (unchecked on a GPU) touch no memory: NaN rows of grad_in2 (as the forward's
    output), nothing scattered; the valid rows are exact. Runs of different lengths walk in lockstep."""
    monkeypatch.setitem(im_launch.TUNING, "segment_tile", 8 * block_m)
    monkeypatch.setitem(im_launch.TUNING, "segment_block_f", 8)
    in1, in2, g = randn((7, 12), F32), randn((30, 12), F32), randn((30, 12), F32)
    idx = torch.randint(0, 7, (30,))
    idx[:8] = 3  # a long run
    bad = torch.tensor([2, 11, 17, 29])
    idx[bad] = torch.tensor([-3, 7, 1 << 40, -1])
    gin1, gin2 = im_launch.index_mul_2d_bwd(g, in1, in2, idx, True, True, deterministic=False)
    ok = (idx >= 0) & (idx < 7)
    want1 = torch.zeros(7, 12, dtype=torch.float64).index_add_(0, idx[ok], (g * in2)[ok].double())
    torch.testing.assert_close(gin1.double(), want1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gin2[ok], g[ok] * in1[idx[ok]])
    assert bool(torch.isnan(gin2[bad]).all())


def test_contrib_and_compat(path):
    """``culmen.contrib.index_mul_2d`` and the ``fused_index_mul_2d`` extension API (writes into its outputs)."""
    from culmen.contrib.index_mul_2d import fused_index_mul_2d
    from culmen.contrib.index_mul_2d import index_mul_2d as contrib_fn
    from culmen.contrib.index_mul_2d.index_mul_2d import IndexMul2d_, index_mul_2d_backward

    in1, in2 = randn((5, 8)), randn((12, 8))
    idx = torch.randint(0, 5, (12,))
    g, gg1, gg2 = randn((12, 8)), randn((5, 8)), randn((12, 8))
    ref = index_mul_2d_ref(in1, in2, idx)
    torch.testing.assert_close(contrib_fn(in1, in2, idx), ref)
    torch.testing.assert_close(IndexMul2d_.apply(in1, in2, idx), ref)
    out = torch.empty_like(in2)
    fused_index_mul_2d.float_forward(out, in1, in2, idx)
    torch.testing.assert_close(out, ref)
    gi1, gi2 = torch.zeros_like(in1), torch.empty_like(in2)
    fused_index_mul_2d.half_backward(gi1, gi2, g, in1, in2, idx)
    e1, e2 = index_mul_2d_backward(in1, in2, idx, g)
    torch.testing.assert_close(gi1, e1)
    torch.testing.assert_close(gi2, e2)
    ggo, gi1, gi2 = torch.empty_like(g), torch.zeros_like(in1), torch.empty_like(in2)
    fused_index_mul_2d.float_backward_backward(ggo, gi1, gi2, g, gg1, gg2, in1, in2, idx)
    torch.testing.assert_close(ggo, gg1[idx] * in2 + gg2 * in1[idx])
    torch.testing.assert_close(gi1, torch.zeros_like(in1).index_add_(0, idx, gg2 * g))
    torch.testing.assert_close(gi2, gg1[idx] * g)


def test_torch_compile_fullgraph(triton_backend):
    """``fullgraph=True`` fails on any graph break: the custom ops and their fake impls trace."""
    torch._dynamo.reset()
    in1, in2 = randn((5, 8), requires_grad=True), randn((12, 8), requires_grad=True)
    idx = torch.randint(0, 5, (12,))

    def fn(a, b):
        return index_mul_2d(a, b, idx) * 2.0

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    res = [(y, *torch.autograd.grad(y.sum(), (in1, in2))) for y in (fn(in1, in2), compiled(in1, in2))]
    for e, c in zip(*res):
        torch.testing.assert_close(c, e)


def test_bad_arguments():
    in1, in2, idx = randn((4, 3)), randn((5, 3)), torch.tensor([0, 1, 2, 3, 0])
    with pytest.raises(ValueError, match=r"idx1 must be in \[0, 4\) \(the rows of in1\), got values in \[0, 4\]"):
        index_mul_2d(in1, in2, torch.tensor([0, 1, 2, 4, 0]))
    with pytest.raises(ValueError, match=r"got values in \[-1, 3\]"):
        index_mul_2d(in1, in2, torch.tensor([0, -1, 2, 3, 0]))
    with pytest.raises(TypeError, match="in1 and in2 must share a dtype, got torch.float32 and torch.float16"):
        index_mul_2d(in1, in2.half(), idx)
    with pytest.raises(TypeError, match="idx1 must be an integer tensor, got torch.float32"):
        index_mul_2d(in1, in2, idx.float())
    with pytest.raises(TypeError, match="in1 must be a float16/bfloat16/float32/float64 tensor, got torch.int64"):
        index_mul_2d(in1.long(), in2.long(), idx)
    with pytest.raises(ValueError, match=r"must be 2-D, got shapes \(4, 3, 1\) and \(5, 3\)"):
        index_mul_2d(in1[..., None], in2, idx)
    with pytest.raises(ValueError, match="in2 has 5 rows but idx1 has 4 indices"):
        index_mul_2d(in1, in2, idx[:4])
    with pytest.raises(ValueError, match=r"same number of columns \(no broadcast\), got 3 and 2"):
        index_mul_2d(in1, in2[:, :2], idx)
    with pytest.raises(ValueError, match=r"idx1 must be 1-D, got shape \(5, 1\)"):
        index_mul_2d(in1, in2, idx[:, None])


def test_opcheck(path):
    """The traced op's schema and fake impl hold (torch.library.opcheck), row-padded inputs included."""
    in1, in2 = make_noncontiguous(randn((6, 9))), randn((14, 9))
    idx = torch.randint(0, 6, (14,))
    torch.library.opcheck(torch.ops.culmen.index_mul_2d_fwd.default, (in1, in2, idx),
                          test_utils=("test_schema", "test_faketensor"))
