"""``culmen.ops.batch_norm`` (single process) against a float64 oracle, on both CPU paths.

Every numerical case runs on the pure-PyTorch reference path and on the Triton kernels under the CPU
interpreter. The oracle is ``sync_batch_norm_ref`` (``F.batch_norm``) on float64 copies; the baseline
of the tolerance rule is the same oracle run by PyTorch in the inputs' own dtype. Checked: the output,
the gradient of every input (x, weight, bias, z) and the running statistics. The multi-rank behaviour
(all-gather of statistics, uneven batches) is tested in ``tests/parallel/test_syncbn.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from culmen.ops.backend import set_backend
from culmen.ops.batch_norm import launch as bn_launch
from culmen.ops.batch_norm import op as bn_op
from culmen.ops.batch_norm import sync_batch_norm, sync_batch_norm_ref
from culmen.ops.batch_norm.reference import pack_stats, packed_counts
from culmen.testing import assert_close_tolerance, make_noncontiguous

BACKENDS = ["reference", "triton"]
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
EPS = 1e-5


@pytest.fixture(params=BACKENDS)
def backend(request):
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    dtype: torch.dtype = F32
    layout: str = "nchw"  # "nchw", "fmt" (NCHW shape stored channels_last), "flag" (channel_last=True, C last)
    affine: bool = True
    relu: bool = False
    z: bool = False
    training: bool = True
    running: bool = True
    momentum: float = 0.1
    noncontig: bool = False
    param_dtype: torch.dtype = F32

    def __str__(self):
        short = {F32: "f32", F16: "f16", BF16: "bf16", F64: "f64"}
        s = ["x".join(map(str, self.shape)), short[self.dtype], self.layout]
        for name in ("relu", "z", "noncontig"):
            if getattr(self, name):
                s.append(name)
        if not self.affine:
            s.append("noaffine")
        if not self.training:
            s.append("eval")
        if not self.running:
            s.append("norunning")
        if self.param_dtype != F32:
            s.append(f"params={short[self.param_dtype]}")
        return "-".join(s)


def _channels(c: Case) -> int:
    return c.shape[-1] if (c.layout == "flag" or len(c.shape) == 2) else c.shape[1]


def _act(c: Case, scale=1.0, shift=0.0):
    t = (torch.randn(c.shape) * scale + shift).to(c.dtype)
    if c.layout == "fmt":
        t = t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    if c.noncontig:
        t = make_noncontiguous(t)
    return t.requires_grad_()


def check_case(c: Case) -> None:
    C = _channels(c)
    # Per-channel offsets so a wrong channel mapping shows up.
    x = _act(c, scale=2.0, shift=0.5)
    with torch.no_grad():
        offs = torch.linspace(-3, 3, C)
        x += (offs.view(-1) if (c.layout == "flag" or x.dim() == 2) else offs.view(-1, *([1] * (x.dim() - 2)))
              ).to(c.dtype)
    z = _act(c) if c.z else None
    w = (torch.rand(C) + 0.5).to(c.param_dtype).requires_grad_() if c.affine else None
    b = torch.randn(C).to(c.param_dtype).requires_grad_() if c.affine else None
    rm = torch.randn(C) if c.running else None
    rv = (torch.rand(C) + 0.5) if c.running else None
    use_batch = c.training
    cl = c.layout == "flag"

    rms = {k: (None if rm is None else rm.clone(), None if rv is None else rv.clone()) for k in ("op", "hi", "lo")}
    y = sync_batch_norm(x, w, b, *rms["op"], use_batch, c.momentum, EPS, channel_last=cl, fuse_relu=c.relu, z=z)
    assert y.shape == x.shape and y.dtype == x.dtype
    if c.layout == "fmt" and not c.noncontig:
        assert y.stride() == x.stride(), "output must keep the input's memory format"
    gy = torch.randn(c.shape).to(c.dtype)
    inputs = {"x": x, "z": z, "weight": w, "bias": b}
    names = [k for k, v in inputs.items() if v is not None]
    got = dict(zip([f"d{k}" for k in names], torch.autograd.grad((y * gy).sum(), [inputs[k] for k in names])))
    got["y"] = y

    refs = {}
    for hi in (True, False):
        cp = {k: (None if v is None else v.detach().to(F64 if hi else v.dtype).requires_grad_())
              for k, v in inputs.items()}
        rr = rms["hi" if hi else "lo"]
        # PyTorch's batch_norm wants running stats of the parameters' dtype.
        rdt = F64 if hi else c.param_dtype
        rr = (None if rr[0] is None else rr[0].to(rdt), None if rr[1] is None else rr[1].to(rdt))
        yr = sync_batch_norm_ref(cp["x"], cp["weight"], cp["bias"], rr[0], rr[1], use_batch, c.momentum, EPS,
                                 z=cp["z"], channel_last=cl, fuse_relu=c.relu)
        g = gy.to(F64) if hi else gy
        vals = dict(zip([f"d{k}" for k in names], torch.autograd.grad((yr * g).sum(), [cp[k] for k in names])))
        vals["y"] = yr
        if c.running and use_batch:
            vals["running_mean"], vals["running_var"] = rr
        refs[hi] = vals
    if c.running and use_batch:
        got["running_mean"], got["running_var"] = rms["op"]
    for name, actual in got.items():
        assert torch.isfinite(actual).all(), f"{name} has non-finite values [{c}]"
        if name.startswith("d"):
            src = inputs[name[1:]]
            assert actual.dtype == src.dtype and actual.shape == src.shape, name
        assert_close_tolerance(actual, refs[True][name], refs[False][name], name=f"{name} [{c}]")
    # Eval never touches the running stats; training without running stats has none.
    if c.running and not use_batch:
        assert torch.equal(rms["op"][0], rm) and torch.equal(rms["op"][1], rv)


CASES = [
    # NCHW 2D-5D, odd sizes.
    Case((5, 3, 7, 9)),
    Case((37, 6)),  # 2-D: channel-last kernels
    Case((4, 6, 33), dtype=BF16),
    Case((2, 3, 4, 5, 6), dtype=F16),
    Case((3, 5, 1, 1)),  # L = 1
    Case((2, 7, 70), dtype=BF16, noncontig=True),
    Case((9, 2, 3, 3), dtype=F16, relu=True, z=True),
    # Stored channels_last (NCHW shape), and Apex's channel_last flag (C last in the shape).
    Case((5, 3, 7, 9), layout="fmt"),
    Case((4, 6, 5, 3), dtype=BF16, layout="fmt", relu=True, z=True),
    Case((2, 3, 4, 5, 6), dtype=F16, layout="fmt"),
    Case((6, 4, 5, 3), layout="flag", relu=True, z=True),
    Case((3, 5, 70), dtype=BF16, layout="flag"),
    Case((2, 3, 4, 130), dtype=F16, layout="flag", noncontig=True),
    # Affine / running-stats variants, eval mode, momentum.
    Case((5, 3, 7, 9), affine=False),
    Case((5, 3, 7, 9), dtype=BF16, running=False),
    Case((5, 3, 7, 9), training=False),
    Case((4, 6, 5, 3), dtype=BF16, layout="fmt", training=False, relu=True),
    Case((6, 4, 5, 3), layout="flag", training=False, z=True, relu=True),
    Case((5, 3, 7, 9), momentum=1.0),
    Case((4, 6, 33), dtype=BF16, param_dtype=BF16),
    Case((4, 6, 33), dtype=F64, param_dtype=F64, relu=True, z=True),  # fp64 always takes the reference path
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(backend, case):
    check_case(case)


SPLIT_CASES = [Case((4, 3, 5, 7), dtype=BF16), Case((2, 3, 40)), Case((10, 3, 3, 2), layout="fmt"),
               Case((41, 5), dtype=F16), Case((12, 4, 3), layout="flag", relu=True, z=True)]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_tolerance_rule_many_splits(triton_backend, monkeypatch, case):
    """Tiny tiles: the reductions split every channel over many programs, the combine merges them."""
    monkeypatch.setitem(bn_launch.TUNING, "reduce_tile", 16)
    monkeypatch.setitem(bn_launch.TUNING, "elem_tile", 32)
    monkeypatch.setitem(bn_launch.TUNING, "max_block_c", 2)
    check_case(case)


def test_stats_rows_do_not_depend_on_the_batch(triton_backend):
    """Every rank must send the same number of statistics rows, whatever its share of the batch."""
    shapes = [(1, 3, 40), (2, 3, 40), (9, 3, 40), (20, 3, 40)]
    assert len({bn_op.stats_rows(torch.randn(s), False).shape for s in shapes}) == 1
    assert len({bn_op.stats_rows(torch.randn(n, 5), True).shape for n in (1, 2, 7, 100)}) == 1


def test_splits_are_used(triton_backend, monkeypatch):
    monkeypatch.setitem(bn_launch.TUNING, "reduce_tile", 16)
    block_r, block_l, rows_per, s_r, cols_per, s_l = bn_launch._nchw_reduce_plan(2, 3, 40, torch.device("cpu"))
    assert s_r == 2 and s_l > 1 and cols_per * s_l >= 40 and cols_per * (s_l - 1) < 40
    assert bn_launch._nchw_reduce_plan(9, 3, 35, torch.device("cpu"))[3] > 1
    monkeypatch.setitem(bn_launch.TUNING, "max_block_c", 2)
    block_m, block_c, rows_per, s = bn_launch._nhwc_reduce_plan(41, 5, torch.device("cpu"))
    assert s > 1 and rows_per * s >= 41 and rows_per * (s - 1) < 41


# ---------------------------------------------------------------------------------------------
# Statistics and the parallel combine
# ---------------------------------------------------------------------------------------------


def test_stats_match_float64(backend):
    """The Welford partials: mean and M2 of data far from zero (the naive formula would cancel)."""
    x = (torch.randn(7, 5, 33) * 0.01 + 1000.0).float()
    rows = bn_op.stats_rows(x, False)
    assert rows.dim() == 2 and rows.shape[1] == 2 * 5 + 2 and rows.dtype == F32
    assert int(packed_counts(rows).sum()) == 7 * 33
    mean, invstd, cnt = bn_op.combine_rows(rows, None, None, 0.0, EPS)
    x64 = x.double()
    ref_mean = x64.mean((0, 2))
    m2 = (x64 - ref_mean.view(1, -1, 1)).square().sum((0, 2))
    torch.testing.assert_close(mean.double(), ref_mean, rtol=5e-7, atol=0)
    torch.testing.assert_close((invstd.double() ** -2 - EPS) * (7 * 33), m2, rtol=2e-3, atol=0)
    assert int(cnt) == 7 * 33


def test_combine_unequal_and_empty_parts(backend):
    """Merging per-rank statistics with unequal (and zero) counts equals the statistics of the union."""
    parts = [torch.randn(n, 4) * (i + 1) + i for i, n in enumerate((3, 17, 0, 1, 40))]
    rows = torch.cat([bn_op.stats_rows(p, True) for p in parts])
    rm, rv = torch.zeros(4), torch.ones(4)
    mean, invstd, cnt = bn_op.combine_rows(rows, rm, rv, 0.25, EPS)
    allx = torch.cat(parts).double()
    assert int(cnt) == allx.shape[0]
    torch.testing.assert_close(mean.double(), allx.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(invstd.double(), torch.rsqrt(allx.var(0, unbiased=False) + EPS), rtol=1e-5, atol=0)
    torch.testing.assert_close(rm.double(), 0.25 * allx.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rv.double(), 0.75 + 0.25 * allx.var(0), rtol=1e-5, atol=0)


def test_pack_roundtrip_large_count():
    """Counts are int64 in the packed row: exact beyond fp32's 2^24."""
    n = 2**40 + 3
    row = pack_stats(torch.ones(3), torch.ones(3), n)
    assert int(packed_counts(row)) == n and int(packed_counts(torch.stack([row, row]))[1]) == n


def test_empty_local_batch(backend):
    """A rank with no samples contributes count 0 (uneven data-parallel batches)."""
    x = torch.empty(0, 3, 4)
    stats = bn_op.stats_rows(x, False)
    assert int(packed_counts(stats).sum()) == 0
    other = bn_op.stats_rows(torch.randn(6, 3, 4), False)
    mean, _, cnt = bn_op.combine_rows(torch.cat([stats, other]), None, None, 0.1, EPS)
    assert int(cnt) == 24 and torch.isfinite(mean).all()


# ---------------------------------------------------------------------------------------------
# API behaviour
# ---------------------------------------------------------------------------------------------


def test_errors():
    x = torch.randn(4, 3, 5)
    with pytest.raises(ValueError, match="2D-5D"):
        sync_batch_norm(torch.randn(4), None, None, None, None)
    with pytest.raises(ValueError, match="channels"):
        sync_batch_norm(x, torch.ones(4), None, None, None)
    with pytest.raises(ValueError, match="more than 1 value"):
        sync_batch_norm(torch.randn(1, 3), None, None, None, None)
    with pytest.raises(ValueError, match="running"):
        sync_batch_norm(x, None, None, None, None, use_batch_stats=False)
    with pytest.raises(ValueError, match="z must"):
        sync_batch_norm(x, None, None, None, None, z=torch.randn(4, 3, 6))


def test_paths_agree(monkeypatch):
    """Reference and Triton paths compute the same function (bf16 rounding apart)."""
    x = torch.randn(6, 5, 11).to(BF16)
    w, b = torch.rand(5) + 0.5, torch.randn(5)
    outs = []
    for be in BACKENDS:
        set_backend(be)
        outs.append(sync_batch_norm(x, w, b, None, None).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def test_autocast_keeps_input_dtype(backend):
    x = torch.randn(4, 3, 5).to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        y = sync_batch_norm(x, torch.ones(3), torch.zeros(3), None, None)
    assert y.dtype == BF16


@pytest.mark.parametrize("args", ["train", "train-relu-z-cl", "eval"])
def test_opcheck(backend, args):
    """The traced op's schema and fake impl hold (torch.library.opcheck)."""
    x = torch.randn(3, 4, 5)
    w, b = torch.rand(4) + 0.5, torch.randn(4)
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    xl = torch.randn(7, 4)
    a = {
        "train": (x, None, w, b, rm, rv, True, 0.1, EPS, False, False),
        "train-relu-z-cl": (xl, torch.randn(7, 4), None, b, None, None, True, 0.1, EPS, True, True),
        "eval": (x, None, w, None, rm, rv, False, 0.1, EPS, False, False),
    }[args]
    torch.library.opcheck(torch.ops.culmen.batch_norm_fwd.default, a, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("compile_backend", BACKENDS)
@pytest.mark.parametrize("layout", ["nchw", "fmt", "flag"])
def test_torch_compile_fullgraph(compile_backend, layout):
    """``fullgraph=True`` (no graph break): outputs, gradients of x, z, weight, bias and the running statistics
    equal eager's (the compiled graph runs the reference under the CPU interpreter)."""
    set_backend(compile_backend)
    torch._dynamo.reset()
    c = Case((4, 6, 5, 3), layout=layout, relu=layout != "nchw", z=layout != "nchw")
    C = _channels(c)
    x = _act(c)
    z = _act(c) if c.z else None
    w, b = (torch.rand(C) + 0.5).requires_grad_(), torch.randn(C).requires_grad_()
    gy = torch.randn(c.shape)

    def fn(x, z, w, b, rm, rv):
        return sync_batch_norm(x, w, b, rm, rv, True, 0.1, EPS, channel_last=layout == "flag", fuse_relu=c.relu,
                               z=z) * 2.0

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [t for t in (x, z, w, b) if t is not None]
    res = []
    for f in (fn, compiled):
        rm, rv = torch.zeros(C), torch.ones(C)
        y = f(x, z, w, b, rm, rv)
        res.append((y, *torch.autograd.grad((y * gy).sum(), leaves), rm, rv))
    for e, got in zip(*res):
        torch.testing.assert_close(got, e, rtol=1e-5, atol=1e-5)
    # eval (running statistics) traces too
    ye = torch.compile(lambda x: sync_batch_norm(x, w, b, rm, rv, False, 0.1, EPS, channel_last=layout == "flag"),
                       fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(ye, sync_batch_norm(x, w, b, rm, rv, False, 0.1, EPS, channel_last=layout == "flag"))


# ---------------------------------------------------------------------------------------------
# GPU: real sizes and int64 offsets
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "fmt", "flag"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_gpu_real_sizes(layout, dtype):
    torch.manual_seed(1)
    shape = (32, 256, 28, 28) if layout != "flag" else (32, 28, 28, 256)
    c = Case(shape, dtype=dtype, layout=layout, relu=layout != "nchw", z=layout == "fmt")
    # check_case builds CPU tensors; run it with CUDA as the default device.
    with torch.device("cuda"):
        check_case(c)


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """More than 2^31 elements: channel-last forward/backward offsets must not wrap."""
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    C = 64
    M = 2**31 // C + 1000
    x = torch.randn(M, C, device="cuda", dtype=BF16)
    x[-1000:] += 5.0  # rows past 2^31 elements carry a different mean
    w = torch.ones(C, device="cuda")
    y = sync_batch_norm(x, w, None, None, None)
    mean = x.float().mean(0)
    var = x.float().var(0, unbiased=False)
    tail = ((x[-1000:].float() - mean) * torch.rsqrt(var + EPS))
    torch.testing.assert_close(y[-1000:].float(), tail, rtol=2e-2, atol=2e-2)
    del y
    dx = torch.autograd.grad(sync_batch_norm(x.requires_grad_(), w, None, None, None)[-1000:].sum(), x)[0]
    assert torch.isfinite(dx[-1000:].float()).all() and dx[-1000:].float().abs().sum() > 0


def _bn_launches():
    out = []
    for plan in bn_launch.PLANS.values():
        if plan.use_kernel:
            out += [la for la in (getattr(plan, n, None) for n in ("stats", "final", "running", "fwd", "finalize",
                                                                  "bwd")) if la is not None]
            out += list(plan._bwd.values())
    return out


@pytest.mark.gpu
def test_gpu_fast_launch_bitwise():
    """The direct launch path (second call of a plan) gives what Triton's own launch gives, bit for bit (output,
    every gradient, running statistics), and every launch of the cached plans took it."""
    from culmen.ops.common.launch import set_fast_launch
    from culmen.ops.common.plans import clear_plans

    torch.manual_seed(3)
    cases = [Case((8, 64, 14, 14), dtype=BF16), Case((8, 96, 9, 11), dtype=BF16, layout="fmt", relu=True, z=True),
             Case((6, 7, 7, 160), dtype=F16, layout="flag"), Case((33, 300)),
             Case((8, 64, 14, 14), dtype=BF16, training=False, relu=True)]
    with torch.device("cuda"):
        inputs = []
        for c in cases:
            C = _channels(c)
            inputs.append((c, _act(c), _act(c) if c.z else None, (torch.rand(C) + 0.5).requires_grad_(),
                           torch.randn(C).requires_grad_(), torch.randn(c.shape).to(c.dtype)))

    def run(c, x, z, w, b, gy):
        rm, rv = torch.zeros(w.shape, device="cuda"), torch.ones(w.shape, device="cuda")
        y = sync_batch_norm(x, w, b, rm, rv, c.training, 0.1, EPS, channel_last=c.layout == "flag", fuse_relu=c.relu,
                            z=z)
        leaves = [t for t in (x, z, w, b) if t is not None]
        return (y, *torch.autograd.grad((y * gy).sum(), leaves), rm, rv)

    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)
            results[mode] = [[run(*inp) for _ in range(2)][-1] for inp in inputs]
            launches = _bn_launches()
            assert launches
            for la in launches:
                assert (la._run is not None) == mode, f"{la.fn.fn.__name__}: {la.error}"
    finally:
        set_fast_launch(True)
        clear_plans()
    for slow, fast in zip(results[False], results[True]):
        for a, c in zip(slow, fast):
            assert torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("layout", ["nchw", "fmt", "flag"])
def test_gpu_torch_compile_inductor(dynamic, layout):
    """Under torch.compile (Inductor, fullgraph, one process) the kernels are traced (triton_op + wrap_triton):
    output, gradients of x, z, weight, bias and the running statistics equal eager's; with dynamic shapes new
    batch sizes do not recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    C = 64
    relu = layout != "nchw"
    with torch.device("cuda"):
        w, b = (torch.rand(C) + 0.5).requires_grad_(), torch.randn(C).requires_grad_()

        def fn(x, z, rm, rv):
            return sync_batch_norm(x, w, b, rm, rv, True, 0.1, EPS, channel_last=layout == "flag", fuse_relu=relu,
                                   z=z)

        compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
        for n in (4, 6, 9):
            c = Case((n, 7, 9, C) if layout == "flag" else (n, C, 9, 7), dtype=BF16, layout=layout, relu=relu, z=relu)
            x = _act(c)
            z = _act(c) if c.z else None
            gy = torch.randn(c.shape).to(BF16)
            leaves = [t for t in (x, z, w, b) if t is not None]
            res = []
            for f in (fn, compiled):
                rm, rv = torch.zeros(C), torch.ones(C)
                y = f(x, z, rm, rv)
                res.append((y, *torch.autograd.grad((y.float() * gy.float()).sum(), leaves), rm, rv))
            for e, got in zip(*res):
                assert got.dtype == e.dtype and got.shape == e.shape
                torch.testing.assert_close(got, e, rtol=2e-2, atol=2e-2)
            if layout == "fmt":
                assert res[1][0].is_contiguous(memory_format=torch.channels_last)
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1


@pytest.mark.parametrize("channels_last", [False, True])
def test_output_can_be_modified_in_place(backend, channels_last):
    """The output is a fresh tensor on every path (not a view made inside the autograd Function), so
    ``ReLU(inplace=True)`` after the norm works, and the gradient is that of ``relu(batch_norm(x))``."""
    x0 = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    if channels_last:
        x0 = x0.to(memory_format=torch.channels_last)
    x = x0.clone().requires_grad_()
    y = sync_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    assert y._base is None
    y = torch.relu_(y)
    g = torch.randn_like(y)
    y.backward(g)
    xr = x0.clone().requires_grad_()
    ref = torch.nn.functional.batch_norm(xr, None, None, training=True, eps=1e-5).relu()
    ref.backward(g)
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-7, atol=1e-9)
