"""``culmen.ops.focal_loss`` against a float64 oracle, on the reference path and the Triton kernels.

The oracle ``focal_loss_ref`` is the textbook formula (sigmoid, BCE-with-logits, pow) differentiated by
autograd, independent of the kernels' hand-derived stable form and gradient. Tolerance rule
(DESIGN.md): the op's error must be at most 2x that of the same formula run by PyTorch in the
input's dtype, plus a small atol, for the loss and for the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from culmen.ops.focal_loss import focal_loss, focal_loss_ref
from culmen.ops.focal_loss import launch as fl_launch
from culmen.testing import assert_close_tolerance, make_noncontiguous, poisoned_allocations, randn

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
BACKENDS = ["reference", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    request.getfixturevalue(f"{request.param}_backend")
    # Small tiles so that the persistent forward loops several times over row tiles and column blocks.
    monkeypatch.setitem(fl_launch.TUNING, "fwd_tile", 64)
    monkeypatch.setitem(fl_launch.TUNING, "bwd_tile", 64)
    return request.param


def make_labels(shape, num_real: int, p_ignore=0.15, p_background=0.5) -> torch.Tensor:
    """Labels with ignored (-2), background (-1) and positive anchors, a whole ignored row included."""
    u = torch.rand(shape)
    lab = torch.randint(0, max(num_real, 1), shape)
    lab = torch.where(u < p_background + p_ignore, torch.full_like(lab, -1), lab)
    lab = torch.where(u < p_ignore, torch.full_like(lab, -2), lab)
    lab.view(-1)[0] = -2
    lab.view(-1)[-1] = num_real - 1
    return lab


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]  # (..., C)
    num_real: int
    dtype: torch.dtype = F32
    gamma: float = 2.0
    alpha: float = 0.25
    smoothing: float = 0.0
    noncontig: bool = False
    label_dtype: torch.dtype = torch.int64

    def __str__(self) -> str:
        dt = {F16: "f16", BF16: "bf16", F32: "f32"}
        s = f"{'x'.join(map(str, self.shape))}-r{self.num_real}-{dt[self.dtype]}-g{self.gamma:g}-s{self.smoothing:g}"
        return s + ("-noncontig" if self.noncontig else "") + ("-i32" if self.label_dtype == torch.int32 else "")


CASES = [
    Case((37, 13), 10),
    Case((2, 21, 9), 9, BF16, gamma=1.5, smoothing=0.1),
    Case((45, 8), 6, F16, gamma=0.0, alpha=0.6, smoothing=0.05, noncontig=True),
    Case((3, 1000), 997, F32, gamma=3.0, label_dtype=torch.int32),
    # Enough rows that each persistent forward program walks several row tiles.
    Case((300, 24), 20, BF16, gamma=2.0),
]


def check_case(case: Case) -> None:
    x = randn(case.shape, case.dtype, scale=2.0)
    if case.noncontig:
        x = make_noncontiguous(x)
    x.requires_grad_()
    labels = make_labels(case.shape[:-1], case.num_real).to(case.label_dtype)
    nps = torch.tensor([7.0])
    args = (case.num_real, case.alpha, case.gamma, case.smoothing)
    with poisoned_allocations():
        loss = focal_loss(x, labels, nps, *args)
    assert loss.shape == () and loss.dtype == F32
    with poisoned_allocations():
        (dx,) = torch.autograd.grad(loss, x, torch.tensor(1.7))
    assert dx.shape == x.shape and dx.dtype == x.dtype
    refs = {}
    for hi in (True, False):
        xr = x.detach().to(F64 if hi else case.dtype).requires_grad_()
        lr = focal_loss_ref(xr, labels.long(), nps.to(xr.dtype), *args)
        refs[hi] = (lr, torch.autograd.grad(lr, xr, torch.tensor(1.7, dtype=lr.dtype))[0])
    assert_close_tolerance(loss, refs[True][0], refs[False][0], name=f"loss [{case}]")
    assert_close_tolerance(dx, refs[True][1], refs[False][1], name=f"dx [{case}]")
    # Ignored anchors and padded classes get exactly zero gradient.
    ignored = (labels == -2).unsqueeze(-1).expand(case.shape)
    assert torch.all(dx[ignored] == 0)
    assert torch.all(dx[..., case.num_real:] == 0)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(backend, case):
    check_case(case)


def test_matches_torchvision_formula(backend):
    """With every label a real class (Apex's test): per-element ``sigmoid_focal_loss`` summed, divided by N+."""
    x = randn((12, 8), F32, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    target = torch.randint(0, 8, (12,))
    y = torch.nn.functional.one_hot(target, 8).to(F64)
    p = torch.sigmoid(x64)
    ce = torch.nn.functional.binary_cross_entropy_with_logits(x64, y, reduction="none")
    p_t = p * y + (1 - p) * (1 - y)
    expected = ((0.24 * y + 0.76 * (1 - y)) * ce * (1 - p_t) ** 2).sum() / 3.0
    actual = focal_loss(x, target, torch.tensor([3.0]), 8, 0.24, 2.0)
    torch.testing.assert_close(actual.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    ge, ga = torch.autograd.grad(expected, x64)[0], torch.autograd.grad(actual, x)[0]
    torch.testing.assert_close(ga.double(), ge, rtol=1e-5, atol=1e-7)


def test_saturated_logits_stay_finite(backend):
    """Logits far beyond the sigmoid's fp32 range: loss and gradient stay finite and correct."""
    x = torch.tensor([[40.0, -40.0, 90.0], [-90.0, 30.0, -30.0]], requires_grad=True)
    labels = torch.tensor([0, 2])
    loss = focal_loss(x, labels, torch.tensor([2.0]), 3, 0.25, 2.0, 0.1)
    (dx,) = torch.autograd.grad(loss, x)
    xr = x.detach().double().requires_grad_()
    ref = focal_loss_ref(xr, labels, torch.tensor([2.0], dtype=F64), 3, 0.25, 2.0, 0.1)
    (dr,) = torch.autograd.grad(ref, xr)
    assert torch.isfinite(loss) and torch.isfinite(dx).all()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dr, rtol=1e-5, atol=1e-5)


def test_partial_grad_and_compat_module(backend):
    """``focal_loss_cuda.forward/backward`` (Apex's extension API) reproduce the autograd gradient."""
    from culmen.contrib.focal_loss import focal_loss_cuda

    x = randn((9, 16), F32, requires_grad=True)
    labels = make_labels((9,), 14)
    nps = torch.tensor([4.0])
    loss = focal_loss(x, labels, nps, 14, 0.25, 2.0, 0.1)
    (dx,) = torch.autograd.grad(loss, x, torch.tensor(0.5))
    loss2, partial = focal_loss_cuda.forward(x.detach(), labels, nps, 14, 0.25, 2.0, 0.1)
    torch.testing.assert_close(loss2, loss.detach())
    out = focal_loss_cuda.backward(torch.tensor(0.5), partial, nps)
    assert out is partial
    torch.testing.assert_close(out, dx, rtol=1e-6, atol=1e-7)


def test_contrib_api(backend):
    """``from culmen.contrib.focal_loss import focal_loss`` is the module, as in Apex."""
    from culmen.contrib.focal_loss import focal_loss as mod

    x = randn((5, 8), requires_grad=True)
    labels = make_labels((5,), 8)
    a = mod.FocalLoss.apply(x, labels, torch.tensor([2.0]), 8, 0.25, 2.0, 0.0)
    b = mod.focal_loss(x, labels, torch.tensor([2.0]), 8, 0.25, 2.0)
    torch.testing.assert_close(a, b)
    a.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_torch_compile_fullgraph(triton_backend):
    """``fullgraph=True`` fails on any graph break: the custom ops and their fake impls trace."""
    torch._dynamo.reset()
    x = randn((6, 10), requires_grad=True)
    labels = make_labels((6,), 9)
    nps = torch.tensor([3.0])

    def fn(x):
        return focal_loss(x, labels, nps, 9, 0.25, 2.0, 0.05) * 3.0

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    res = [(lambda v: (v, torch.autograd.grad(v, x)[0]))(f(x)) for f in (fn, compiled)]
    torch.testing.assert_close(res[1][0], res[0][0])
    torch.testing.assert_close(res[1][1], res[0][1])


def test_bad_arguments():
    x = randn((4, 8))
    lab = torch.tensor([0, -1, -2, 5])
    nps = torch.tensor([1.0])
    with pytest.raises(ValueError, match=r"must be -2 \(ignore\), -1 \(background\) or a class in \[0, 6\); got \[7\]"):
        focal_loss(x, torch.tensor([0, -1, 7, 5]), nps, 6, 0.25, 2.0)
    with pytest.raises(ValueError, match=r"got \[-3\]"):
        focal_loss(x, torch.tensor([0, -3, 1, 5]), nps, 6, 0.25, 2.0)
    with pytest.raises(ValueError, match=r"shape cls_output.shape\[:-1\] = \(4,\), got \(3,\)"):
        focal_loss(x, lab[:3], nps, 6, 0.25, 2.0)
    with pytest.raises(TypeError, match="cls_targets_at_level must be an integer tensor, got torch.float32"):
        focal_loss(x, lab.float(), nps, 6, 0.25, 2.0)
    with pytest.raises(TypeError, match="cls_output must be a float16/bfloat16/float32/float64 tensor"):
        focal_loss(x.long(), lab, nps, 6, 0.25, 2.0)
    with pytest.raises(ValueError, match=r"num_real_classes must be in \[0, 8\].*got 9"):
        focal_loss(x, lab, nps, 9, 0.25, 2.0)
    with pytest.raises(ValueError, match="one-element float tensor, got shape \\(2,\\)"):
        focal_loss(x, lab, torch.tensor([1.0, 2.0]), 6, 0.25, 2.0)
    with pytest.raises(ValueError, match="gamma must be >= 0, got -1"):
        focal_loss(x, lab, nps, 6, 0.25, -1.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got 1.5"):
        focal_loss(x, lab, nps, 6, 0.25, 2.0, 1.5)


def test_opcheck(backend):
    """The traced op's schema and fake impl hold (torch.library.opcheck)."""
    x = randn((7, 12), BF16)
    labels = make_labels((7,), 10)
    torch.library.opcheck(torch.ops.culmen.focal_loss_fwd.default, (x, labels, torch.tensor([3.0]), 10, 0.25, 2.0,
                                                                    0.1), test_utils=("test_schema", "test_faketensor"))
