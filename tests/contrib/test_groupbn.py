"""``culmen.contrib.groupbn.BatchNorm2d_NHWC`` (Apex's ``apex.contrib.groupbn``): bn / bn+ReLU / bn+add+ReLU on
explicit NHWC input against float64 ``F.batch_norm`` (output, gradients of x, z, weight and bias, running
statistics, eval), on the Triton kernels and the reference path; argument errors; ``bn_group=2`` and
``bn_group=1`` on 2 gloo ranks (and over NCCL on 2 GPUs); the alias."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from culmen.contrib.groupbn import BatchNorm2d_NHWC
from culmen.ops.backend import use_backend
from culmen.testing import randn
from culmen.testing.tolerance import assert_close_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from bn_checks import rank_device, relative_failures  # noqa: E402
from dist_harness import run_group  # noqa: E402


def _ref(x, z, w, b, rm, rv, mode, training=True):
    """Apex's test oracle: ``BatchNorm2d`` on NCHW (+ z) (+ ReLU), back to NHWC."""
    y = F.batch_norm(x.permute(0, 3, 1, 2), rm, rv, w, b, training, 0.1, 1e-5).permute(0, 2, 3, 1)
    if mode == "bn_add_relu":
        y = y + z
    return F.relu(y) if mode != "bn" else y


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("mode", ["bn", "bn_relu", "bn_add_relu"])
def test_against_float64(backend, mode):
    C = 6
    m = BatchNorm2d_NHWC(C, fuse_relu=mode != "bn")
    with torch.no_grad():
        m.weight.copy_(torch.rand(C) + 0.5)
        m.bias.copy_(torch.randn(C))
    x0 = randn((3, 5, 7, C)) * 2 + torch.linspace(-1, 1, C)
    z0 = randn((3, 5, 7, C)) if mode == "bn_add_relu" else None
    x = x0.clone().requires_grad_()
    z = z0.clone().requires_grad_() if z0 is not None else None
    dy = randn(x0.shape)
    with use_backend(backend):
        y = m(x, z)
        y.backward(dy)
    leaves_hi = [t.double().requires_grad_() if t is not None else None
                 for t in (x0, z0, m.weight.detach(), m.bias.detach())]
    leaves_lo = [t.clone().requires_grad_() if t is not None else None
                 for t in (x0, z0, m.weight.detach(), m.bias.detach())]
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    y_hi = _ref(*leaves_hi, rm, rv, mode)
    y_lo = _ref(*leaves_lo, None, None, mode)
    y_hi.backward(dy.double())
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    got = [x.grad, z.grad if z is not None else None, m.weight.grad, m.bias.grad]
    for name, g, h, lo in zip(("dx", "dz", "dweight", "dbias"), got, leaves_hi, leaves_lo):
        if h is not None:
            assert_close_tolerance(g, h.grad, lo.grad, name=name)
    torch.testing.assert_close(m.running_mean.double(), rm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.running_var.double(), rv, rtol=1e-5, atol=1e-6)
    m.eval()
    with use_backend(backend), torch.no_grad():
        ye = m(x0, z0)
    want = _ref(x0.double(), None if z0 is None else z0.double(), m.weight.double(), m.bias.double(), rm, rv, mode,
                training=False)
    torch.testing.assert_close(ye.double(), want, rtol=1e-5, atol=1e-5)


def test_apex_arguments_and_errors():
    m = BatchNorm2d_NHWC(4, fuse_relu=True, bn_group=1, max_cta_per_sm=3, cta_launch_margin=5, multi_stream=True)
    assert (m.eps, m.momentum, m.max_cta_per_sm, m.cta_launch_margin, m.multi_stream) == (1e-5, 0.1, 3, 5, True)
    assert m.minibatch_mean.shape == (4,) and m.minibatch_riv.shape == (4,)
    with pytest.raises(ValueError, match="z .* needs fuse_relu=True"):
        BatchNorm2d_NHWC(4)(randn((2, 3, 3, 4)), randn((2, 3, 3, 4)))
    with pytest.raises(ValueError, match=r"x must be \(N, H, W, 4\), got shape \(2, 4, 3, 3\)"):
        m(randn((2, 4, 3, 3)))
    with pytest.raises(ValueError, match="max_cta_per_sm must be a positive int, got 0"):
        BatchNorm2d_NHWC(4, max_cta_per_sm=0)
    with pytest.raises(ValueError, match="bn_group=2 needs torch.distributed"):
        BatchNorm2d_NHWC(4, bn_group=2)
    with pytest.raises(ValueError, match="z must have the input's shape"):
        m(randn((2, 3, 3, 4)), randn((2, 3, 2, 4)))


def _dist_worker(rank, world, sizes, device="cpu"):
    failures = []
    dev, dt, tol = rank_device(rank, device)
    C = 5
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(sum(sizes), 3, 4, C, generator=gen, dtype=torch.float64) + 2
    zfull = torch.randn(sum(sizes), 3, 4, C, generator=gen, dtype=torch.float64)
    dyfull = torch.randn(sum(sizes), 3, 4, C, generator=gen, dtype=torch.float64)
    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])
    for bn_group in (2, 1):
        m = BatchNorm2d_NHWC(C, fuse_relu=True, bn_group=bn_group).to(dev, dt)
        x = full[sl].to(dev, dt).requires_grad_()
        z = zfull[sl].to(dev, dt).requires_grad_()
        y = m(x, z)
        y.backward(dyfull[sl].to(dev, dt))
        # Oracle (float64, CPU): the group's whole batch (both ranks for bn_group=2, this rank's slice for 1).
        gsl = slice(0, sum(sizes)) if bn_group == 2 else sl
        xr = full[gsl].clone().requires_grad_()
        zr = zfull[gsl].clone().requires_grad_()
        w = m.weight.detach().double().cpu().requires_grad_()
        b = m.bias.detach().double().cpu().requires_grad_()
        rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
        yr = _ref(xr, zr, w, b, rm, rv, "bn_add_relu")
        yr.backward(dyfull[gsl])
        off = lo if bn_group == 2 else 0
        mine = slice(off, off + sizes[rank])
        dw, db = m.weight.grad.clone(), m.bias.grad.clone()
        if bn_group == 2:  # this rank's share: the shares add up to the batch's gradient
            torch.distributed.all_reduce(dw)
            torch.distributed.all_reduce(db)
        failures += relative_failures((("y", y, yr[mine]), ("dx", x.grad, xr.grad[mine]), ("dz", z.grad, zr.grad[mine]),
                                       ("dweight", dw, w.grad), ("dbias", db, b.grad),
                                       ("running_mean", m.running_mean, rm), ("running_var", m.running_var, rv)),
                                      f"bn_group={bn_group}: ", tol)
    return failures


def test_bn_group_on_two_ranks():
    assert run_group(_dist_worker, 2, [3, 2], timeout=120) == [[], []]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank per GPU)")
def test_bn_group_over_nccl_on_two_gpus():
    """``bn_group=2`` statistics summed over NCCL (fp32 on the GPUs against the float64 oracle)."""
    assert run_group(_dist_worker, 2, [3, 2], "cuda", backend="nccl", timeout=240, pg_timeout=120) == [[], []]


def test_apex_alias():
    import culmen.compat as compat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compat.install()
    try:
        from apex.contrib.groupbn.batch_norm import BatchNorm2d_NHWC as Aliased

        assert Aliased is BatchNorm2d_NHWC
    finally:
        compat.uninstall()


@pytest.mark.gpu
def test_gpu_fp16_resnet_shape():
    dev = torch.device("cuda")
    m = BatchNorm2d_NHWC(64, fuse_relu=True).to(dev)
    x0 = randn((32, 56, 56, 64), torch.float16, dev)
    z0 = randn((32, 56, 56, 64), torch.float16, dev)
    x, z = x0.clone().requires_grad_(), z0.clone().requires_grad_()
    y = m(x, z)
    dy = randn(y.shape, torch.float16, dev)
    y.backward(dy)
    hi = [x0.double().requires_grad_(), z0.double().requires_grad_()]
    lo = [x0.clone().requires_grad_(), z0.clone().requires_grad_()]
    w = torch.ones(64, device=dev)
    b = torch.zeros(64, device=dev)
    y_hi = _ref(*hi, w.double(), b.double(), None, None, "bn_add_relu")
    y_lo = _ref(*lo, w.half(), b.half(), None, None, "bn_add_relu")
    y_hi.backward(dy.double())
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    assert_close_tolerance(x.grad, hi[0].grad, lo[0].grad, name="dx")
    assert_close_tolerance(z.grad, hi[1].grad, lo[1].grad, name="dz")
