"""``culmen.ops.focal_loss`` on a real GPU at real sizes (run by ``scripts/gpu-check``).

Tolerance rule as in ``test_focal_loss.py``: against the textbook formula on float64 copies, the op's
error must be at most 2x PyTorch's own in the input dtype, plus a small atol, for the loss and the
gradient.
"""

from __future__ import annotations

import pytest
import torch

from culmen.ops.focal_loss import focal_loss, focal_loss_ref
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DEV = "cuda"


def _labels(R: int, num_real: int) -> torch.Tensor:
    u = torch.rand(R, device=DEV)
    lab = torch.randint(0, num_real, (R,), device=DEV)
    lab = torch.where(u < 0.9, -1, lab)
    return torch.where(u < 0.05, -2, lab)


@pytest.mark.parametrize("R, C, num_real, dtype, gamma, smoothing, noncontig", [
    (120087, 272, 264, F16, 2.0, 0.0, False),  # one RetinaNet image, classes padded to 272
    (120087, 272, 264, BF16, 2.0, 0.1, False),
    (50000, 91, 80, BF16, 1.5, 0.0, True),
    (3000, 4097, 4000, F32, 3.0, 0.05, False),
    (77, 13, 13, F16, 0.0, 0.0, False),
], ids=lambda v: str(v))
def test_tolerance_rule(R, C, num_real, dtype, gamma, smoothing, noncontig):
    x = randn((R, C), dtype, DEV, 2.5)
    if noncontig:
        x = make_noncontiguous(x)
    x.requires_grad_()
    labels = _labels(R, num_real)
    nps = (labels >= 0).sum().float().clamp(min=1.0).reshape(1)
    loss = focal_loss(x, labels, nps, num_real, 0.25, gamma, smoothing)
    (dx,) = torch.autograd.grad(loss, x)
    refs = {}
    for hi in (True, False):
        xr = x.detach().to(F64 if hi else dtype).requires_grad_()
        lr = focal_loss_ref(xr, labels, nps.to(xr.dtype), num_real, 0.25, gamma, smoothing)
        refs[hi] = (lr, torch.autograd.grad(lr, xr)[0])
    label = f"{R}x{C} {dtype} g{gamma} s{smoothing}"
    assert torch.isfinite(loss) and torch.isfinite(dx).all()
    assert_close_tolerance(loss, refs[True][0], refs[False][0], name=f"loss [{label}]")
    assert_close_tolerance(dx, refs[True][1], refs[False][1], name=f"dx [{label}]")
    assert torch.all(dx[labels == -2] == 0) and torch.all(dx[:, num_real:] == 0)


def test_bitwise_reproducible():
    x = randn((200000, 96), BF16, DEV, 2.0).requires_grad_()
    labels = _labels(200000, 90)
    nps = torch.tensor([1234.0], device=DEV)
    runs = []
    for _ in range(2):
        loss = focal_loss(x, labels, nps, 90, 0.25, 2.0)
        runs.append((loss, *torch.autograd.grad(loss, x)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# --------------------------------------------------------------------- the call path (issue 13)


@pytest.fixture
def fresh_plans():
    from culmen.ops.common.plans import clear_plans

    clear_plans()
    yield
    clear_plans()


def _launches():
    """The launches of every cached focal-loss plan that a forward + backward uses."""
    from culmen.ops.focal_loss.launch import PLANS

    out = []
    for p in PLANS.values():
        out += [p.fwd, p.finish, p.bwd[True]]
    return out


def test_fast_launch_bitwise(fresh_plans):
    """The direct launch path (second call of a plan) gives what Triton's own launch gives."""
    from culmen.ops.common.launch import set_fast_launch

    x = randn((50000, 91), BF16, DEV, 2.0).requires_grad_()
    labels = _labels(50000, 80)
    nps = torch.tensor([1234.0], device=DEV)
    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)
            for _ in range(2):
                loss = focal_loss(x, labels, nps, 80, 0.25, 2.0, 0.1)
                results[mode] = (loss, *torch.autograd.grad(loss, x))
            for la in _launches():
                assert (la._run is not None) == mode, f"{la.fn.fn.__name__}: {la.error}"
    finally:
        set_fast_launch(True)
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor(dynamic):
    """Under torch.compile (Inductor, fullgraph) the kernels are traced (triton_op + wrap_triton): loss and
    gradient equal eager's, and with dynamic shapes new anchor counts do not recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def fn(x, labels, nps):
        return focal_loss(x, labels, nps, 80, 0.25, 2.0, 0.05) * 2.0

    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    for R in (1000, 1537, 4099):
        x = randn((R, 91), BF16, DEV, 2.0).requires_grad_()
        labels = _labels(R, 80)
        nps = (labels >= 0).sum().float().clamp(min=1.0).reshape(1)
        outs = [(lambda v: (v, *torch.autograd.grad(v, x)))(f(x, labels, nps)) for f in (fn, compiled)]
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1.6e-2, atol=1e-5)
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1
