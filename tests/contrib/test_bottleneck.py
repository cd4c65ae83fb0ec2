"""``culmen.contrib.bottleneck`` (Apex's ``apex.contrib.bottleneck``): the fused ``Bottleneck`` against the plain
block in float64 (output and the gradients of the input and every convolution weight), explicit NHWC, argument
errors, and on 2 gloo ranks the halo exchangers and ``SpatialBottleneck`` against the unsplit block."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

from culmen.contrib.bottleneck import Bottleneck, SpatialBottleneck
from culmen.contrib.bottleneck.halo_exchangers import HaloExchangerNoComm, HaloPadder
from culmen.ops.backend import use_backend
from culmen.testing import randn
from culmen.testing.tolerance import assert_close_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

CL = torch.channels_last


def _randomize_norms(m: Bottleneck, gen: torch.Generator) -> None:
    with torch.no_grad():
        for bn in m._norms():
            n = bn.weight.numel()
            bn.weight.copy_(torch.rand(n, generator=gen) + 0.5)
            bn.bias.copy_(torch.randn(n, generator=gen))
            bn.running_mean.copy_(torch.randn(n, generator=gen) * 0.3)
            bn.running_var.copy_(torch.rand(n, generator=gen) + 0.5)


def _block_case(cin, cb, cout, stride, seed=0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = Bottleneck(cin, cb, cout, stride=stride, use_cudnn=True)
    _randomize_norms(m, gen)
    return m


def _grads(m, x, y, dy):
    y.backward(dy)
    return [x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("cin,cb,cout,stride,hw", [(8, 4, 8, 1, (5, 7)), (6, 3, 10, 2, (7, 6))])
def test_fused_block_against_float64(backend, cin, cb, cout, stride, hw):
    m = _block_case(cin, cb, cout, stride)
    ref = copy.deepcopy(m).double()
    ref.use_cudnn = False  # Apex's plain-modules path, in float64
    lo = copy.deepcopy(ref).float()  # the same plain path in fp32: PyTorch's own error
    x0 = randn((2, cin, *hw)).contiguous(memory_format=CL)
    dy = randn((2, cout, (hw[0] - 1) // stride + 1, (hw[1] - 1) // stride + 1))
    x = x0.clone().requires_grad_()
    with use_backend(backend):
        y = m(x)
        got = _grads(m, x, y, dy)
    assert y.is_contiguous(memory_format=CL)
    xh, xl = x0.double().requires_grad_(), x0.clone().requires_grad_()
    yh, yl = ref(xh), lo(xl)
    want, base = _grads(ref, xh, yh, dy.double()), _grads(lo, xl, yl, dy)
    assert_close_tolerance(y, yh, yl, name="y")
    names = ["dx"] + [n for n, _ in m.named_parameters()]
    assert len(got) == (5 if m.downsample is not None else 4)
    for name, g, w, b in zip(names, got, want, base):
        assert_close_tolerance(g, w, b, name=name)


def test_explicit_nhwc_and_scale_bias_callable():
    m = _block_case(6, 4, 6, 1, seed=3)
    nhwc = copy.deepcopy(m)
    with torch.no_grad():
        for p in nhwc.parameters():
            p.data = p.data.permute(0, 2, 3, 1).contiguous()
    nhwc.explicit_nhwc = True
    x = randn((2, 6, 5, 4), torch.float64)
    m.double()
    nhwc.double()
    y = m(x.contiguous(memory_format=CL))
    y2 = nhwc(x.permute(0, 2, 3, 1).contiguous())
    assert y2.shape == (2, 5, 4, 6)
    torch.testing.assert_close(y2, y.permute(0, 2, 3, 1), rtol=1e-12, atol=1e-12)
    refresh = nhwc.get_scale_bias_callable()
    assert nhwc.w_scale[0].shape == (1, 1, 1, 4)
    with torch.no_grad():
        nhwc.bn1.running_var.mul_(4.0)  # frozen statistics changed: the precomputed factors are stale ...
    torch.testing.assert_close(nhwc(x.permute(0, 2, 3, 1).contiguous()), y2, rtol=1e-12, atol=1e-12)
    refresh()  # ... until recomputed
    assert not torch.allclose(nhwc(x.permute(0, 2, 3, 1).contiguous()), y2)
    # Apex's module layout: explicit_nhwc permutes the parameters at construction; plain ops refuse it.
    e = Bottleneck(4, 2, 4, explicit_nhwc=True)
    assert e.conv2.weight.shape == (2, 3, 3, 2)
    with pytest.raises(RuntimeError, match="explicit nhwc with native ops"):
        e(randn((1, 3, 3, 4)))


def test_bad_arguments():
    with pytest.raises(RuntimeError, match="groups == 1"):
        Bottleneck(4, 2, 4, groups=2)
    with pytest.raises(RuntimeError, match="frozen BN"):
        Bottleneck(4, 2, 4, norm_func=torch.nn.BatchNorm2d)
    with pytest.raises(ValueError, match="stride must be a positive int, got 0"):
        Bottleneck(4, 2, 4, stride=0)
    with pytest.raises(ValueError, match="spatial_method must be 1, 2 or 3, got 0"):
        SpatialBottleneck(4, 2, 4, spatial_parallel_args=(2, 0, None, HaloExchangerNoComm([0, 1], 0), 0))
    with pytest.raises(ValueError, match="spatial_group_rank must be in"):
        SpatialBottleneck(4, 2, 4, spatial_parallel_args=(2, 2, None, None, 1, False))
    with pytest.raises(ValueError, match="spatial_halo_exchanger must be a halo exchanger"):
        SpatialBottleneck(4, 2, 4, spatial_parallel_args=(2, 0, None, None, 1))
    with pytest.raises(ValueError, match="rank_in_group must be in"):
        HaloExchangerNoComm([0, 1], 5)
    m = Bottleneck(4, 2, 4, use_cudnn=True)
    with pytest.raises(ValueError, match="x must be 4-D"):
        m(randn((4, 3, 3)))


def test_no_comm_exchanger_and_padder():
    ex = HaloExchangerNoComm([0, 1, 2], 1)
    assert (ex.left_rank, ex.right_rank, ex.left_zero, ex.right_zero) == (0, 2, False, False)
    a, b = randn((1, 2, 1, 3)), randn((1, 2, 1, 3))
    left, right = ex.left_right_halo_exchange(a, b)
    assert left is b and right is a  # Apex's stand-in swaps its inputs
    la, lb = torch.empty_like(a), torch.empty_like(b)
    assert ex.left_right_halo_exchange(a, b, la, lb) is None
    assert torch.equal(la, b) and torch.equal(lb, a)
    y = randn((1, 5, 4, 2))  # explicit NHWC, split along H, halo 1
    p = HaloPadder(ex)(y, 1, True, True)
    assert p.shape == (1, 7, 4, 2) and torch.equal(p[:, 1:6], y)
    assert torch.equal(p[:, :1], y[:, 4:]) and torch.equal(p[:, 6:], y[:, :1])


# ------------------------------------------------------------------------------------- 2 gloo ranks


def _spatial_worker(rank, world, device="cpu"):
    import torch.distributed as dist

    from culmen.contrib.bottleneck import (
        HaloExchangerAllGather,
        HaloExchangerPeer,
        HaloExchangerSendRecv,
    )
    from culmen.contrib.bottleneck.halo_exchangers import halo_pad
    from culmen.ops.backend import set_backend

    failures = []
    dev = torch.device("cpu") if device == "cpu" else torch.device("cuda", rank)
    if dev.type == "cuda":  # cuDNN convolutions default to TF32 (errors ~1e-3): the checks are for fp32
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    ranks = list(range(world))
    comm = dist.new_group(ranks)
    exchangers = {"allgather": HaloExchangerAllGather(ranks, rank, comm),
                  "sendrecv": HaloExchangerSendRecv(ranks, rank),
                  "peer": HaloExchangerPeer(ranks, rank, None, False)}
    # 1. The exchange itself: rank r sends rows filled with 10r+1 (left) and 10r+2 (right).
    for name, ex in exchangers.items():
        left_out = torch.full((2, 3, 1, 4), 10.0 * rank + 1, device=dev)
        right_out = torch.full((2, 3, 1, 4), 10.0 * rank + 2, device=dev)
        li, ri = ex.left_right_halo_exchange(left_out, right_out)
        want_l = 0.0 if rank == 0 else 10.0 * (rank - 1) + 2
        want_r = 0.0 if rank == world - 1 else 10.0 * (rank + 1) + 1
        if not (torch.all(li == want_l) and torch.all(ri == want_r)):
            failures.append(f"{name}: got left {li.flatten()[0]} right {ri.flatten()[0]}")
        bufs = torch.full_like(left_out, float("nan")), torch.full_like(right_out, float("nan"))
        ex.left_right_halo_exchange(left_out, right_out, *bufs)
        if not (torch.all(bufs[0] == want_l) and torch.all(bufs[1] == want_r)):
            failures.append(f"{name}: in-place exchange wrong")
    # 2. halo_pad's gradient: sum(w * pad(y)) has d/dy = w's middle rows + the neighbours' halo-row weights.
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 3, 4 * world, 5, generator=gen, dtype=torch.float64)
    wfull = torch.randn(2, 3, 4 * world + 2, 5, generator=gen, dtype=torch.float64)
    y = full[:, :, 4 * rank:4 * rank + 4].to(dev).requires_grad_()
    p = halo_pad(y, exchangers["sendrecv"])
    zero = torch.zeros(2, 3, 1, 5, dtype=torch.float64)
    want = torch.cat([zero, full, zero], 2)[:, :, 4 * rank:4 * rank + 6]
    if not torch.equal(p.detach().cpu(), want):
        failures.append("halo_pad: padded values wrong")
    # Each rank's window of the globally padded image uses its own weights; the global gradient of y:
    wloc = wfull[:, :, 4 * rank:4 * rank + 6]
    (p * wloc.to(dev)).sum().backward()
    gfull = torch.zeros_like(full)
    for r in range(world):  # every rank's window adds its weights onto the rows it read
        lo_, hi_ = max(4 * r - 1, 0), min(4 * r + 5, 4 * world)
        gfull[:, :, lo_:hi_] += wfull[:, :, 4 * r:4 * r + 6][:, :, lo_ - (4 * r - 1):hi_ - (4 * r - 1)]
    if not torch.allclose(y.grad.cpu(), gfull[:, :, 4 * rank:4 * rank + 4], rtol=0, atol=1e-12):
        failures.append("halo_pad: gradient wrong")
    # 3. SpatialBottleneck on H slices == Bottleneck on the whole image (fused and plain paths).
    for backend, dtype, fused, method, stride in (("reference", torch.float64, True, 1, 1),
                                                 ("reference", torch.float64, False, 2, 2),
                                                 ("triton", torch.float32, True, 3, 2)):
        set_backend(backend)
        if dev.type == "cuda":  # fp32 on the GPUs (cuDNN convolutions), the float64 oracle on the CPU
            dtype = torch.float32
        name = f"spatial[{backend},{'fused' if fused else 'plain'},stride={stride}]"
        torch.manual_seed(5)
        cin, cout = (6, 6) if stride == 1 else (4, 8)
        whole = Bottleneck(cin, 3, cout, stride=stride, use_cudnn=fused)
        _randomize_norms(whole, torch.Generator().manual_seed(2))
        whole = whole.to(dtype)
        ex = exchangers["allgather" if method == 1 else "sendrecv"]
        part = SpatialBottleneck(cin, 3, cout, stride=stride, use_cudnn=fused,
                                 spatial_parallel_args=(world, rank, comm, ex, method)).to(dtype)
        part.load_state_dict(whole.state_dict())
        Hs = 4
        xf = torch.randn(2, cin, Hs * world, 5, generator=gen).to(dtype).contiguous(memory_format=CL)
        ho = Hs // stride
        dyf = torch.randn(2, cout, ho * world, (5 - 1) // stride + 1, generator=gen).to(dtype)
        xw = xf.double().clone().requires_grad_()
        ref = copy.deepcopy(whole).double()
        ref.use_cudnn = False
        yw = ref(xw)
        yw.backward(dyf.double())
        part = part.to(dev)
        xs = xf[:, :, Hs * rank:Hs * (rank + 1)].to(dev).contiguous(memory_format=CL).requires_grad_()
        ys = part(xs)
        ys.backward(dyf[:, :, ho * rank:ho * (rank + 1)].to(dev))
        tol = 1e-10 if dtype == torch.float64 else 2e-4
        checks = [("y", ys, yw[:, :, ho * rank:ho * (rank + 1)]),
                  ("dx", xs.grad, xw.grad[:, :, Hs * rank:Hs * (rank + 1)])]
        for (pn, pp), (_, pw) in zip(part.named_parameters(), ref.named_parameters()):
            g = pp.grad.clone()
            dist.all_reduce(g)  # this rank's share; the shares add up to the whole block's gradient
            checks.append((pn, g, pw.grad))
        for what, got, exp in checks:
            err = (got.double().cpu() - exp).abs().max().item()
            if not err <= tol * max(1.0, exp.abs().max().item()):
                failures.append(f"{name}: {what} max err {err:.3g}")
    return failures


def test_spatial_bottleneck_and_exchangers_on_two_ranks():
    results = run_group(_spatial_worker, 2, timeout=180)
    assert results == [[], []], results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank per GPU)")
def test_spatial_bottleneck_and_exchangers_over_nccl_on_two_gpus():
    """The same checks with the halos exchanged over NCCL between two GPUs (the blocks in fp32 there)."""
    results = run_group(_spatial_worker, 2, "cuda", backend="nccl", timeout=300, pg_timeout=120)
    assert results == [[], []], results


def test_apex_alias():
    import culmen.compat as compat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compat.install()
    try:
        from apex.contrib.bottleneck import Bottleneck as B
        from apex.contrib.bottleneck import HaloExchangerPeer
        from apex.contrib.bottleneck.halo_exchangers import HaloExchangerAllGather

        assert B is Bottleneck and HaloExchangerPeer.__module__ == "culmen.contrib.bottleneck.halo_exchangers"
        assert HaloExchangerAllGather.__name__ == "HaloExchangerAllGather"
    finally:
        compat.uninstall()


@pytest.mark.gpu
@pytest.mark.parametrize("stride,cin", [(1, 256), (2, 256)])
def test_gpu_fp16_resnet_block(stride, cin):
    """A ResNet-50 stage-1/2 block in fp16 channels-last against the float64 plain block."""
    dev = torch.device("cuda")
    m = _block_case(cin, 64 if stride == 1 else 128, 256 if stride == 1 else 512, stride).to(dev)
    lo = copy.deepcopy(m).half()
    lo.use_cudnn = False
    ref = copy.deepcopy(m).double()
    ref.use_cudnn = False
    m.half()
    x0 = randn((8, cin, 56, 56), torch.float16, dev).contiguous(memory_format=CL)
    x, xl, xh = x0.clone().requires_grad_(), x0.clone().requires_grad_(), x0.double().requires_grad_()
    y, yl, yh = m(x), lo(xl), ref(xh)
    dy = randn(y.shape, torch.float16, dev)
    got, base, want = _grads(m, x, y, dy), _grads(lo, xl, yl, dy), _grads(ref, xh, yh, dy.double())
    assert_close_tolerance(y, yh, yl, name="y")
    for name, g, w, b in zip(["dx"] + [n for n, _ in m.named_parameters()], got, want, base):
        assert_close_tolerance(g, w, b, name=name)
