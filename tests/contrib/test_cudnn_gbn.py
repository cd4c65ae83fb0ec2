"""``culmen.contrib.cudnn_gbn.GroupBatchNorm2d`` (Apex's ``apex.contrib.cudnn_gbn``): one rank against float64
``F.batch_norm`` (NCHW and channels-last, gradients of x, weight and bias, running statistics, eval); argument
errors; ``group_size=2`` on 2 gloo ranks against the whole batch (Apex's convention: each rank's weight / bias
gradient is the batch's gradient divided by the group size); the alias."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from culmen.contrib.cudnn_gbn import GroupBatchNorm2d
from culmen.ops.backend import use_backend
from culmen.testing import randn
from culmen.testing.tolerance import assert_close_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from bn_checks import rank_device, relative_failures  # noqa: E402
from dist_harness import run_group  # noqa: E402

CL = torch.channels_last


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_one_rank_against_float64(backend, layout):
    C = 7
    m = GroupBatchNorm2d(C, group_size=1, momentum=None)
    with torch.no_grad():
        m.weight.copy_(torch.rand(C) + 0.5)
        m.bias.copy_(torch.randn(C))
    x0 = randn((3, C, 5, 6)) * 3 + 1
    if layout == "cl":
        x0 = x0.contiguous(memory_format=CL)
    x = x0.clone().requires_grad_()
    dy = randn(x0.shape)
    with use_backend(backend):
        y = m(x)
        y.backward(dy)
    assert y.is_contiguous(memory_format=CL) == (layout == "cl")
    hi = [t.double().requires_grad_() for t in (x0, m.weight.detach(), m.bias.detach())]
    lo = [t.clone().requires_grad_() for t in (x0, m.weight.detach(), m.bias.detach())]
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    y_hi = F.batch_norm(hi[0], rm, rv, hi[1], hi[2], True, 1.0, 1e-5)  # momentum=None, first step: factor 1
    y_lo = F.batch_norm(lo[0], None, None, lo[1], lo[2], True, 0.1, 1e-5)
    y_hi.backward(dy.double())
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    for name, g, h, lw in zip(("dx", "dweight", "dbias"), (x.grad, m.weight.grad, m.bias.grad), hi, lo):
        assert_close_tolerance(g, h.grad, lw.grad, name=name)
    torch.testing.assert_close(m.running_mean.double(), rm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.running_var.double(), rv, rtol=1e-5, atol=1e-6)
    m.eval()
    torch.testing.assert_close(m(x0).double(), F.batch_norm(x0.double(), rm, rv, m.weight.double(),
                                                            m.bias.double(), False, 0.0, 1e-5), rtol=1e-5, atol=1e-5)


def test_errors():
    m = GroupBatchNorm2d(4, 1)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        m(randn((2, 4, 3)))
    with pytest.raises(ValueError, match="input has 5 channels, GroupBatchNorm2d expects 4"):
        m(randn((2, 5, 3, 3)))
    with pytest.raises(ValueError, match="group_size=2 needs torch.distributed"):
        GroupBatchNorm2d(4, 2)
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        GroupBatchNorm2d(4, 0)


def _dist_worker(rank, world, device="cpu"):
    dev, dt, tol = rank_device(rank, device)
    C = 6
    gen = torch.Generator().manual_seed(4)
    full = torch.rand(world, C, 5, 3, generator=gen, dtype=torch.float64)  # Apex's test: one sample per rank
    dyfull = torch.rand(world, C, 5, 3, generator=gen, dtype=torch.float64)
    weight, bias = torch.rand(C, generator=gen, dtype=torch.float64), torch.rand(C, generator=gen, dtype=torch.float64)
    m = GroupBatchNorm2d(C, group_size=2).to(dev, dt)
    with torch.no_grad():
        m.weight.copy_(weight)
        m.bias.copy_(bias)
    x = full[rank:rank + 1].to(dev, dt).contiguous(memory_format=CL).requires_grad_()
    y = m(x)
    y.backward(dyfull[rank:rank + 1].to(dev, dt))
    xr = full.clone().requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    yr = F.batch_norm(xr, rm, rv, w, b, True, 0.1, 1e-5)
    yr.backward(dyfull)
    return relative_failures((("y", y, yr[rank:rank + 1]), ("dx", x.grad, xr.grad[rank:rank + 1]),
                              ("dweight", m.weight.grad, w.grad / world), ("dbias", m.bias.grad, b.grad / world),
                              ("running_mean", m.running_mean, rm), ("running_var", m.running_var, rv)), tol=tol)


def test_group_size_two_on_two_ranks():
    assert run_group(_dist_worker, 2, timeout=120) == [[], []]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank per GPU)")
def test_group_size_two_over_nccl_on_two_gpus():
    assert run_group(_dist_worker, 2, "cuda", backend="nccl", timeout=240, pg_timeout=120) == [[], []]


def test_apex_alias():
    import culmen.compat as compat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compat.install()
    try:
        from apex.contrib.cudnn_gbn import GroupBatchNorm2d as Aliased

        assert Aliased is GroupBatchNorm2d
    finally:
        compat.uninstall()


@pytest.mark.gpu
def test_gpu_fp16_channels_last_autocast():
    """Apex's usage: fp32 module, channels-last input, autocast to fp16."""
    dev = torch.device("cuda")
    m = GroupBatchNorm2d(256, 1).to(dev)
    x0 = torch.rand(4, 256, 48, 72, device=dev).contiguous(memory_format=CL)
    x = x0.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.float16):
        y = m(x)
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=CL)
    dy = torch.rand(y.shape, device=dev, dtype=torch.float16)
    y.backward(dy)
    hi = x0.half().double().requires_grad_()
    lo = x0.half().requires_grad_()
    y_hi = F.batch_norm(hi, None, None, torch.ones(256, device=dev, dtype=torch.float64), None, True)
    y_lo = F.batch_norm(lo, None, None, torch.ones(256, device=dev, dtype=torch.float16), None, True)
    y_hi.backward(dy.double())
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    assert_close_tolerance(x.grad.half(), hi.grad, lo.grad, name="dx")
