"""``culmen.ops.softmax`` against a float64 oracle, on the reference path and the Triton interpreter.

Tolerance rule (DESIGN.md): the op's error against ``scaled_masked_softmax_ref`` on float64 copies
must be at most 2x the error of the same reference run by PyTorch in the input's dtype, plus a small
atol; for the probabilities and for the gradient of x. Launcher outputs are poisoned with NaN. The
``chunked`` fixture forces the long-row (online softmax) kernels at tiny sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from culmen.ops.backend import set_backend
from culmen.ops.softmax import launch as sm_launch
from culmen.ops.softmax import scaled_masked_softmax, scaled_masked_softmax_ref, softmax_backward, softmax_forward
from culmen.testing import assert_close_tolerance, make_noncontiguous, poisoned_allocations, randn

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


@pytest.fixture(autouse=True)
def poisoned():
    """Every output buffer the ops allocate (``torch.empty`` / ``empty_like``) starts as NaN."""
    with poisoned_allocations():
        yield


@pytest.fixture
def chunked(monkeypatch):
    """Rows longer than 16 take the chunked kernels, in chunks of 16."""
    monkeypatch.setitem(sm_launch.TUNING, "fwd_max_resident", 16)
    monkeypatch.setitem(sm_launch.TUNING, "bwd_max_resident", 16)
    monkeypatch.setitem(sm_launch.TUNING, "chunk", 16)


@dataclass(frozen=True)
class Case:
    shape: tuple[int, int, int, int]  # (B, NP, SQ, SK)
    dtype: torch.dtype = F32
    mask: str = ""  # "", "b1qk" (B,1,SQ,SK), "11qk", "b11k" (padding of keys), "dead" (+ fully masked rows)
    causal: bool = False
    scale: float = 1.0
    noncontig: bool = False

    def __str__(self) -> str:
        dt = {F32: "f32", F16: "f16", BF16: "bf16"}[self.dtype]
        parts = ["x".join(map(str, self.shape)), dt]
        parts += [f"mask={self.mask}"] if self.mask else []
        parts += ["causal"] if self.causal else []
        parts += [f"scale={self.scale}"] if self.scale != 1.0 else []
        parts += ["noncontig"] if self.noncontig else []
        return "-".join(parts)


def _mask(kind: str, B: int, SQ: int, SK: int) -> torch.Tensor | None:
    if not kind:
        return None
    if kind == "b11k":  # key padding: the last keys of each batch entry
        lens = torch.randint(1, SK + 1, (B,))
        return (torch.arange(SK)[None] >= lens[:, None]).view(B, 1, 1, SK)
    shape = (1, 1, SQ, SK) if kind == "11qk" else (B, 1, SQ, SK)
    m = torch.rand(shape) < 0.3
    if kind == "dead":
        m[0, 0, SQ // 2] = True  # a fully masked row: all zeros
        return m.to(torch.uint8)
    return m


CASES = [
    Case((2, 3, 5, 37), mask="b1qk", scale=0.37),
    Case((2, 2, 7, 7), BF16, causal=True, scale=2.0),
    Case((1, 3, 4, 1), F16, mask="b1qk"),  # sk = 1
    Case((3, 2, 6, 33), BF16, mask="11qk"),
    Case((2, 2, 3, 20), F16, mask="b11k", noncontig=True),
    Case((2, 1, 9, 9), mask="dead", causal=True),
    Case((2, 2, 4, 100), BF16, scale=0.125),
]


def _run(case: Case):
    B, NP, SQ, SK = case.shape
    x = randn(case.shape, case.dtype, scale=3.0)
    if case.noncontig:
        x = make_noncontiguous(x, pad=3)
        assert not x.is_contiguous()
    mask = _mask(case.mask, B, SQ, SK)
    xg = x.detach().clone().requires_grad_()
    y = scaled_masked_softmax(xg, mask, case.scale, case.causal)
    g = randn(y.shape, case.dtype)
    y.backward(g)
    hi, lo = x.detach().to(F64).requires_grad_(), x.detach().clone().requires_grad_()
    y_hi = scaled_masked_softmax_ref(hi, mask, case.scale, case.causal)
    y_lo = scaled_masked_softmax_ref(lo, mask, case.scale, case.causal)
    assert_close_tolerance(y, y_hi, y_lo, name=f"{case} y")
    (d_hi,) = torch.autograd.grad(y_hi, hi, g.to(F64))
    (d_lo,) = torch.autograd.grad(y_lo, lo, g)
    assert_close_tolerance(xg.grad, d_hi, d_lo, name=f"{case} dx")
    assert y.dtype == x.dtype and y.is_contiguous()
    return y, mask


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(backend, case):
    y, mask = _run(case)
    if case.mask == "dead":
        assert torch.equal(y[0, :, case.shape[2] // 2], torch.zeros_like(y[0, :, 0]))
    if case.causal:
        assert torch.equal(y.float().triu(1), torch.zeros_like(y.float()))


CHUNKED = [
    Case((1, 2, 3, 37), mask="b1qk", scale=0.37),
    Case((1, 1, 5, 20), F16, mask="b11k", noncontig=True),
    # Several chunks per row, a fully masked row, and causal rows that end inside a chunk.
    Case((1, 1, 20, 40), BF16, mask="dead", causal=True, scale=0.5),
]


@pytest.mark.parametrize("case", CHUNKED, ids=str)
def test_chunked_kernels(backend, chunked, case):
    y, _ = _run(case)
    if case.mask == "dead":
        assert torch.equal(y[0, :, case.shape[2] // 2], torch.zeros_like(y[0, :, 0]))


@pytest.mark.parametrize("form", ["2d-mask", "uint8-strided-mask", "transposed-scores", "expanded-grad"])
def test_masks_and_layouts_read_in_place(backend, form):
    """Masks of fewer dims or any strides are read through broadcast strides (no expand, view or cast);
    scores with a strided last dim and an expanded output gradient are copied once; every call of a
    cached plan honours its own data and scale."""
    B, NP, SQ, SK = 2, 3, 5, 11
    for scale in (0.5, 1.7):  # the plan, then the cached plan with another scale
        x = randn((B, NP, SQ, SK), BF16, scale=3.0)
        mask = None
        if form == "2d-mask":
            mask = torch.rand(SQ, SK) < 0.3
        elif form == "uint8-strided-mask":
            mask = (torch.rand(B, 1, SK, SQ) < 0.3).to(torch.uint8).transpose(2, 3)  # (B, 1, SQ, SK), strided
        elif form == "transposed-scores":
            x = x.transpose(2, 3).contiguous().transpose(2, 3)
            assert x.stride(-1) != 1
        xg = x.detach().clone().requires_grad_()
        y = scaled_masked_softmax(xg, mask, scale)
        g = torch.ones_like(y) if form == "expanded-grad" else randn(y.shape, BF16)
        if form == "expanded-grad":
            y.float().sum().backward()  # dy arrives expanded (stride 0)
        else:
            y.backward(g)
        hi, lo = x.detach().to(F64).requires_grad_(), x.detach().clone().requires_grad_()
        y_hi, y_lo = (scaled_masked_softmax_ref(t, mask, scale) for t in (hi, lo))
        assert_close_tolerance(y, y_hi, y_lo, name=f"{form} y")
        (d_hi,) = torch.autograd.grad(y_hi, hi, g.to(F64))
        (d_lo,) = torch.autograd.grad(y_lo, lo, g)
        assert_close_tolerance(xg.grad, d_hi, d_lo, name=f"{form} dx")
        assert y.is_contiguous()


def test_three_d_halves(backend):
    """``softmax_forward`` / ``softmax_backward`` also take Apex's 3-D ``(attn_batches, sq, sk)`` scores."""
    x = randn((6, 7, 9), F16, requires_grad=True)
    y = softmax_forward(x.detach(), None, 0.4, causal=True)
    ref = scaled_masked_softmax_ref(x.detach().to(F64)[None], None, 0.4, True)[0]
    assert_close_tolerance(y, ref, scaled_masked_softmax_ref(x.detach()[None], None, 0.4, True)[0], name="y3")
    g = randn(y.shape, F16)
    dx = softmax_backward(g, y, 0.4, causal=True)
    y4 = scaled_masked_softmax(x[None], None, 0.4, causal=True)
    (d4,) = torch.autograd.grad(y4, x, g[None])
    assert torch.equal(y, y4[0]) and torch.equal(dx, d4)


def test_two_halves_match_autograd(backend):
    """``softmax_forward`` / ``softmax_backward`` (the extension-style halves) equal the autograd op."""
    x = randn((2, 3, 6, 19), BF16, requires_grad=True)
    mask = torch.rand(2, 1, 6, 19) < 0.2
    y = scaled_masked_softmax(x, mask, 0.5)
    g = randn(y.shape, BF16)
    y.backward(g)
    y2 = softmax_forward(x.detach(), mask, torch.tensor(0.5))
    assert torch.equal(y, y2)
    assert torch.equal(softmax_backward(g, y2, 0.5), x.grad)


def test_empty(backend):
    assert scaled_masked_softmax(torch.empty(2, 3, 0, 5)).shape == (2, 3, 0, 5)
    assert scaled_masked_softmax(torch.empty(2, 3, 4, 0)).shape == (2, 3, 4, 0)


@pytest.mark.parametrize("compile_backend", ["reference", "triton"])
def test_torch_compile_fullgraph(compile_backend, monkeypatch):
    set_backend(compile_backend)
    torch._dynamo.reset()
    mask = torch.rand(2, 1, 5, 13) < 0.3

    def fn(x):
        return scaled_masked_softmax(x, mask, 0.7) + scaled_masked_softmax(x[:, :, :, :5], None, 1.3, causal=True).sum()

    x = randn((2, 3, 5, 13), requires_grad=True)
    g = randn((2, 3, 5, 13))

    def run(f):
        y = f(x)
        return (y, *torch.autograd.grad((y * g).sum(), x))

    eager = run(fn)
    comp = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    for e, c, name in zip(eager, comp, ("y", "dx")):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6, msg=name)
    assert torch._dynamo.explain(fn)(x).graph_break_count == 0


def test_bad_input():
    x = randn((2, 3, 4, 5))
    with pytest.raises(ValueError, match="4-D"):
        scaled_masked_softmax(x[0])
    with pytest.raises(TypeError, match="floating-point"):
        scaled_masked_softmax(x.to(torch.int64))
    with pytest.raises(TypeError, match="bool or uint8"):
        scaled_masked_softmax(x, torch.zeros(2, 1, 4, 5))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 3, 5\) does not broadcast"):
        scaled_masked_softmax(x, torch.zeros(2, 1, 3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="scale must be a float"):
        scaled_masked_softmax(x, None, "2")
    with pytest.raises(ValueError, match="one shape"):
        softmax_backward(x, x[:, :, :3])
