"""``culmen.ops.group_norm`` on a real GPU at real sizes (run by ``scripts/gpu-check``).

Same tolerance rule as ``test_group_norm.py``: against ``group_norm_ref`` (``F.group_norm`` + SiLU) on
float64 copies, the op's error must be at most 2x PyTorch's own in the input dtype, plus a small atol,
for ``y`` and every gradient. Both kernel families (rows, channels-last) under several chunkings run; the
look-back schedule's counters are checked to reset themselves, across two concurrent streams and
inside a CUDA graph; the direct launch path against Triton's own, bit for bit; ``torch.compile`` with
Inductor (static and dynamic shapes).
"""

from __future__ import annotations

import pytest
import torch

from culmen.ops.group_norm import group_norm, group_norm_ref
from culmen.ops.group_norm import launch as gn_launch
from culmen.testing import assert_close_tolerance, randn

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
EPS = 1e-5
DEV = "cuda"


def _x(shape, dtype, layout):
    x = randn(shape, F32, DEV, 1.5).add_(0.3).to(dtype)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "crop":  # a channels-last view with cropped rows: strided, no copy
        x = x.contiguous(memory_format=torch.channels_last)[:, :, 1:-1]
    return x.requires_grad_()


def check(shape, G, dtype, layout, silu, param_dtype=None, affine=True):
    C = shape[1]
    pdt = param_dtype or dtype
    x = _x(shape, dtype, layout)
    w = (1.0 + 0.5 * randn(C, F32, DEV)).to(pdt).requires_grad_() if affine else None
    b = (0.5 * randn(C, F32, DEV)).to(pdt).requires_grad_() if affine else None
    y = group_norm(x, G, w, b, EPS, "silu" if silu else "")
    assert y.dtype == x.dtype and y.shape == x.shape
    if layout == "nhwc":
        assert y.is_contiguous(memory_format=torch.channels_last)
    dy = randn(y.shape, y.dtype, DEV)
    leaves = [t for t in (x, w, b) if t is not None]
    got = (y, *torch.autograd.grad(y, leaves, dy))
    refs = {}
    for hi in (True, False):
        cp = [t.detach().to(F64 if hi else t.dtype).requires_grad_() for t in leaves]
        yr = group_norm_ref(cp[0], G, *(cp[1:] if affine else (None, None)), EPS, silu)
        refs[hi] = (yr, *torch.autograd.grad(yr, cp, dy.to(yr.dtype)))
    label = f"{shape} G{G} {dtype} {layout}{' silu' if silu else ''}"
    for name, a, hi, lo in zip(("y", "dx", "dweight", "dbias"), got, refs[True], refs[False]):
        assert torch.isfinite(a).all(), f"{name} [{label}] has non-finite values"
        assert_close_tolerance(a, hi, lo, name=f"{name} [{label}]")


CASES = [
    ((8, 512, 64, 64), 32, BF16, "nhwc", True),
    ((8, 512, 64, 64), 32, BF16, "nchw", False),
    ((8, 1280, 32, 32), 32, F16, "nchw", True),
    ((8, 1280, 32, 32), 32, F16, "nhwc", False),
    ((16, 320, 128, 128), 32, BF16, "nhwc", True),
    ((1, 640, 64, 64), 32, BF16, "nhwc", True),  # few groups: the split schedule
    ((1, 320, 96, 80), 32, F32, "nchw", True),  # few groups, NCHW split
    ((2, 4096, 8, 8), 32, F32, "nhwc", False),  # 128 channels per group: channel-block loop
    ((3, 96, 33, 17), 24, F16, "crop", True),  # odd sizes, strided view
    ((5, 60, 7, 9, 3), 6, BF16, "nchw", True),  # 5-D
    ((64, 512), 16, F32, "nchw", False),  # (N, C): one position per channel
    ((1, 128, 256, 256), 32, BF16, "nchw", True),  # large groups: many chunks per group
    ((2, 2560, 16, 16), 32, BF16, "nhwc", True),  # wide channels-last rows (4096-channel tiles)
]


@pytest.mark.parametrize("shape, G, dtype, layout, silu", CASES, ids=lambda v: str(v))
def test_tolerance_rule(shape, G, dtype, layout, silu):
    check(shape, G, dtype, layout, silu)


def test_mixed_dtypes_and_no_affine():
    check((4, 256, 24, 24), 32, BF16, "nhwc", True, param_dtype=F32)
    check((4, 256, 24, 24), 16, F16, "nchw", False, param_dtype=BF16)
    check((4, 256, 24, 24), 32, BF16, "nhwc", True, affine=False)


# TUNING overrides: every layout through the rows kernels; tiny chunks (many chunks per row, merges in
# several steps, many tail programs); the scratch regroup instead of tl.gather; huge chunks (one per row).
FORCED = {
    "rows": {"max_block_c": 0},
    "tiny": {**{f"{f}{k}": 1024 for f in ("", "bwd_", "cl_", "cl_bwd_") for k in ("tile", "chunk")},
             "max_chunks": 4096, "merge_block": 64, "tail_block_c": 16, "tail_block_r": 4},
    "scratch": {"gather": False},
    "huge": {**{f"{f}chunk": 1 << 30 for f in ("", "bwd_", "cl_", "cl_bwd_")}, "min_programs_per_sm": 0},
}


@pytest.mark.parametrize("config", list(FORCED))
def test_forced_configs(config, monkeypatch):
    for key, value in FORCED[config].items():
        monkeypatch.setitem(gn_launch.TUNING, key, value)
    check((2, 320, 64, 64), 32, BF16, "nhwc", True)
    check((2, 320, 64, 64), 32, BF16, "nchw", True)
    check((3, 96, 33, 17), 24, F16, "crop", False)


def test_counters_left_zeroed():
    """The look-back counters reset themselves: after fwd+bwd every counter buffer is zero again."""
    for layout in ("nchw", "nhwc"):
        x = _x((4, 320, 32, 32), BF16, layout)
        w = randn(320, BF16, DEV).requires_grad_()
        b = randn(320, BF16, DEV).requires_grad_()
        y = group_norm(x, 32, w, b, EPS, "silu")
        torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
    torch.cuda.synchronize()
    assert gn_launch._COUNTERS and all(int(c.abs().sum()) == 0 for c in gn_launch._COUNTERS.values())


def test_two_streams_at_once():
    """Launches on two streams run concurrently with separate counter buffers and give the same results."""
    xs = [_x((8, 512, 32, 32), BF16, "nhwc"), _x((8, 512, 32, 32), BF16, "nchw")]
    w = randn(512, BF16, DEV)
    b = randn(512, BF16, DEV)
    expected = [group_norm(x.detach(), 32, w, b, EPS, "silu") for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(20):
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[i].append(group_norm(xs[i].detach(), 32, w, b, EPS, "silu"))
    torch.cuda.synchronize()
    for i in range(2):
        for y in outs[i]:
            assert torch.equal(y, expected[i])


def test_cuda_graph_capture():
    """fwd+bwd captured as CUDA graphs (``torch.cuda.make_graphed_callables``: the counters come from a
    zeroed buffer inside the graph) and replayed with new data, equal to eager bitwise."""
    shape = (4, 320, 32, 32)
    x = _x(shape, BF16, "nhwc")
    w = randn(320, BF16, DEV).requires_grad_()
    b = randn(320, BF16, DEV).requires_grad_()

    def fn(x, w, b):
        return group_norm(x, 32, w, b, EPS, "silu")

    graphed = torch.cuda.make_graphed_callables(fn, (x, w, b))
    for seed in range(3):
        torch.manual_seed(seed)
        xs = _x(shape, BF16, "nhwc")
        dy = randn(shape, BF16, DEV).contiguous(memory_format=torch.channels_last)
        ye = fn(xs, w, b)
        eager = (ye, *torch.autograd.grad(ye, (xs, w, b), dy))
        yg = graphed(xs, w, b)
        got = (yg, *torch.autograd.grad(yg, (xs, w, b), dy))
        torch.cuda.synchronize()
        for a, e in zip(got, eager):
            assert torch.equal(a, e)


def test_bitwise_reproducible():
    x = _x((4, 640, 32, 32), BF16, "nhwc")
    w = randn(640, BF16, DEV).requires_grad_()
    b = randn(640, BF16, DEV).requires_grad_()
    dy = randn(x.shape, BF16, DEV)
    runs = []
    for _ in range(2):
        y = group_norm(x, 32, w, b, EPS, "silu")
        runs.append((y, *torch.autograd.grad(y, (x, w, b), dy)))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


def _launches():
    out = []
    for plan in gn_launch.PLANS.values():
        if plan.use_kernel:
            out.append(plan.fwd)
            out.extend(b.launch for b in plan._bwd.values())
    return out


def _fwd_bwd(x, w, b, dy):
    y = group_norm(x, 32, w, b, EPS, "silu")
    return (y, *torch.autograd.grad(y, (x, w, b), dy))


def test_fast_launch_bitwise():
    """The direct launch path (second call of a plan) gives what Triton's own launch gives, bit for bit, and
    every launch of the cached plans took it."""
    from culmen.ops.common.launch import set_fast_launch
    from culmen.ops.common.plans import clear_plans

    cases = []
    for layout in ("nchw", "nhwc", "crop"):
        x = _x((3, 320, 24, 20), BF16, layout)
        w = randn(320, BF16, DEV).requires_grad_()
        b = randn(320, BF16, DEV).requires_grad_()
        cases.append((x, w, b, randn(x.shape, BF16, DEV)))
    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)
            results[mode] = [[_fwd_bwd(*c) for _ in range(2)][-1] for c in cases]
            launches = _launches()
            assert launches
            for la in launches:
                assert (la._run is not None) == mode, f"{la.fn.fn.__name__}: {la.error}"
    finally:
        set_fast_launch(True)
        clear_plans()
    for slow, fast in zip(results[False], results[True]):
        for a, c in zip(slow, fast):
            assert torch.equal(a, c)


def test_non_current_device():
    """A plan of cuda:1 called while cuda:0 is current: Triton's own launch on the right device and stream,
    the same results as on cuda:0."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert torch.cuda.current_device() == 0
    x0 = _x((2, 320, 16, 16), BF16, "nhwc")
    w0, b0 = randn(320, BF16, DEV).requires_grad_(), randn(320, BF16, DEV).requires_grad_()
    dy0 = randn(x0.shape, BF16, DEV)
    x1, w1, b1 = (t.detach().to("cuda:1").requires_grad_() for t in (x0, w0, b0))
    r0 = [_fwd_bwd(x0, w0, b0, dy0) for _ in range(2)][-1]
    r1 = [_fwd_bwd(x1, w1, b1, dy0.to("cuda:1")) for _ in range(2)][-1]
    assert torch.cuda.current_device() == 0
    for a, c in zip(r0, r1):
        assert c.device == torch.device("cuda", 1) and torch.equal(a, c.to("cuda:0"))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_torch_compile_inductor(dynamic, layout):
    """Under torch.compile (Inductor, fullgraph) the kernels are traced (triton_op + wrap_triton): results,
    statistics and gradients equal eager's, and with dynamic shapes new batch sizes do not recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    w, b = randn(320, BF16, DEV).requires_grad_(), randn(320, BF16, DEV).requires_grad_()

    def fn(x):
        y, mean, rstd = group_norm(x, 32, w, b, EPS, "silu", return_stats=True)
        return y * 2.0, mean, rstd

    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    for n in (2, 3, 6):
        x = _x((n, 320, 24, 20), BF16, layout)
        dy = randn(x.shape, BF16, DEV)
        res = []
        for f in (fn, compiled):
            y, mean, rstd = f(x)
            res.append((y, mean, rstd, *torch.autograd.grad(y, (x, w, b), dy)))
        for name, e, c in zip(("y", "mean", "rstd", "dx", "dw", "db"), *res):
            assert c.dtype == e.dtype and c.shape == e.shape, name
            torch.testing.assert_close(c, e, rtol=2e-2, atol=2e-2, msg=name)
        if layout == "nhwc":
            assert res[1][0].is_contiguous(memory_format=torch.channels_last)
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1
