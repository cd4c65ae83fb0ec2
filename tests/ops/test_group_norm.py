"""``culmen.ops.group_norm`` against a float64 oracle, on the reference path and on both Triton schedules.

The tolerance rule (DESIGN.md, Numerics): the op's error against ``group_norm_ref`` (``F.group_norm``
+ SiLU) on float64 copies must be at most 2x the error of the same PyTorch computation in the
inputs' own dtype, plus a small atol, for ``y`` and the gradients of ``x``, ``weight`` and ``bias``.
The Triton kernels run under the CPU interpreter with tiny tiles, so every loop (channel blocks,
position blocks, chunks) takes several trips; ``fused`` and ``split`` force the two schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from culmen.ops.backend import set_backend
from culmen.ops.group_norm import group_norm, group_norm_ref
from culmen.ops.group_norm import launch as gn_launch
from culmen.testing import assert_close_tolerance, poisoned_allocations, randn

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
EPS = 1e-5


# TUNING overrides of the Triton paths (interpreter): tiny tiles so that every loop takes several trips.
CONFIGS = {
    # Chunks of two tiles: many chunks per row, merges in several steps, several tail programs and row steps.
    "many": {**{f"{f}{k}": v for f in ("", "bwd_", "cl_", "cl_bwd_") for k, v in (("tile", 32), ("chunk", 64))},
             "merge_block": 4, "tail_block_c": 4, "tail_block_r": 2},
    # Chunks of several tiles (loops inside a chunk); the cl kernels regroup through scratch, not tl.gather.
    "few": {**{f"{f}{k}": v for f in ("", "bwd_", "cl_", "cl_bwd_") for k, v in (("tile", 16), ("chunk", 64))},
            "min_programs_per_sm": 0, "gather": False},
    # Every layout through the rows kernels, channel blocks of a group split across chunks.
    "rows": {"max_block_c": 0, "tile": 32, "bwd_tile": 32, "chunk": 96, "bwd_chunk": 96, "min_programs_per_sm": 0},
}


def use_path(path: str, monkeypatch) -> None:
    """The reference, or the Triton kernels (interpreter) with one of the ``CONFIGS``."""
    set_backend("reference" if path == "reference" else "triton")
    for key, value in CONFIGS.get(path, {}).items():
        monkeypatch.setitem(gn_launch.TUNING, key, value)


@pytest.fixture(params=["reference", "many", "rows"])
def path(request, monkeypatch):
    use_path(request.param, monkeypatch)
    return request.param


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    groups: int
    dtype: torch.dtype = F32
    layout: str = "nchw"  # nchw | cl (channels-last) | crop (cropped channels-last view) | swapped (copied)
    silu: bool = False
    affine: str = "wb"  # wb | w | none
    param_dtype: torch.dtype | None = None
    offset: float = 0.0

    def __str__(self) -> str:
        dt = {F16: "f16", BF16: "bf16", F32: "f32"}
        parts = ["x".join(map(str, self.shape)), f"G{self.groups}", dt[self.dtype], self.layout, self.affine]
        if self.silu:
            parts.append("silu")
        if self.param_dtype is not None:
            parts.append(f"p{dt[self.param_dtype]}")
        if self.offset:
            parts.append(f"off{self.offset:g}")
        return "-".join(parts)


CASES = [
    Case((2, 12, 5, 7), 3, F32),
    Case((2, 12, 5, 7), 4, BF16, layout="cl", silu=True),
    Case((3, 6, 33), 2, F16, silu=True),
    Case((1, 10, 3, 4, 3), 5, F32, layout="cl", affine="none"),
    Case((1, 8, 7, 9), 8, BF16, layout="cl", silu=True, param_dtype=F32),
    Case((2, 12, 7, 5), 2, F32, layout="crop", affine="w"),
    Case((2, 6, 4, 5), 3, F16, layout="swapped", silu=True, param_dtype=BF16),
    Case((4, 6), 3, F32, silu=True),
    Case((2, 4, 6, 6), 2, F32, offset=300.0),
]


def _make_x(case: Case) -> torch.Tensor:
    shape = case.shape
    if case.layout == "crop":
        shape = shape[:2] + (shape[2] + 2,) + shape[3:]
    x = (randn(shape, F32) * 1.5 + 0.3 + case.offset).to(case.dtype)
    if case.layout in ("cl", "crop"):
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        x = x.contiguous(memory_format=fmt)
    if case.layout == "crop":
        x = x[:, :, 1:-1]
    if case.layout == "swapped":
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    return x.requires_grad_()


def _run(fn, x, w, b, case, hi):
    leaves = [t for t in (x, w, b) if t is not None]
    cp = [t.detach().to(F64 if hi else t.dtype).requires_grad_() for t in leaves]
    it = iter(cp)
    xc = next(it)
    wc = next(it) if w is not None else None
    bc = next(it) if b is not None else None
    y = fn(xc, case.groups, wc, bc, EPS, case.silu)
    return y, cp


def check_case(case: Case) -> None:
    C = case.shape[1]
    pdt = case.param_dtype or case.dtype
    x = _make_x(case)
    w = (1.0 + 0.5 * randn(C, F32)).to(pdt).requires_grad_() if case.affine in ("wb", "w") else None
    b = (0.5 * randn(C, F32)).to(pdt).requires_grad_() if case.affine == "wb" else None
    with poisoned_allocations():
        y = group_norm(x, case.groups, w, b, EPS, "silu" if case.silu else "")
    assert y.shape == x.shape and y.dtype == x.dtype
    if case.layout == "cl":
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        assert y.is_contiguous(memory_format=fmt), "the output keeps the channels-last format"
    dy = randn(y.shape, y.dtype)  # NCHW-contiguous even for channels-last x: the kernels take both
    leaves = [t for t in (x, w, b) if t is not None]
    with poisoned_allocations():
        grads = torch.autograd.grad(y, leaves, dy)

    def ref(xx, g, ww, bb, eps, silu):
        return group_norm_ref(xx, g, ww, bb, eps, silu)

    outs = {}
    for hi in (True, False):
        yr, cp = _run(ref, x, w, b, case, hi)
        gr = torch.autograd.grad(yr, cp, dy.to(yr.dtype))
        outs[hi] = (yr, gr)
    names = ["x", "weight", "bias"][: len(leaves)] if w is not None else ["x"]
    assert_close_tolerance(y, outs[True][0], outs[False][0], name=f"y [{case}]")
    for name, g, ghi, glo in zip(names, grads, outs[True][1], outs[False][1]):
        assert g.dtype == dict(zip(names, leaves))[name].dtype
        assert_close_tolerance(g, ghi, glo, name=f"d{name} [{case}]")


# Every case on the reference and on the "many" config; the other configs on the cases that vary layout,
# dtype, activation and affine-ness.
PATH_CASES = ([("reference", c) for c in CASES] + [("many", CASES[i]) for i in (0, 1, 2, 4, 6, 7, 8)]
              + [(p, CASES[i]) for p in ("few", "rows") for i in (1, 3, 5, 6)])


@pytest.mark.parametrize("path_name, case", PATH_CASES, ids=lambda v: str(v))
def test_tolerance_rule(path_name, case, monkeypatch):
    use_path(path_name, monkeypatch)
    check_case(case)


def test_layouts_split_rows_into_chunks():
    """The test configs really cut rows into several chunks, channel blocks included."""
    cpu = torch.device("cpu")
    bd, bl, dc, lc, S, sl = gn_launch.rows_layout(2, 3, 4, 35, 16, 48, cpu)
    assert (bd, bl) == (1, 16) and S == (4 // dc) * sl and dc < 4 and sl == 3
    bp, bc, lc, S = gn_launch.cl_layout(2, 12, 35, 32, 32, cpu)
    assert (bp, bc) == (2, 16) and lc == 2 and S == 18
    # GPU-like sizes: 132 multiprocessors' worth of programs, chunks never below one tile
    bd, bl, dc, lc, S, sl = gn_launch.rows_layout(8, 32, 16, 4096, 4096, 16384, cpu)
    assert (bd, bl, dc, lc, S) == (1, 4096, 4, 4096, 4)


def test_configs_agree_and_counters_reset(triton_backend, monkeypatch):
    """Every config gives the same results (to rounding), and the kernels leave their counters zeroed."""
    x = randn((2, 6, 3, 5), F32, requires_grad=True)
    w, b = randn(6, requires_grad=True), randn(6, requires_grad=True)
    dy = randn((2, 6, 3, 5))
    runs = []
    for name, cfg in CONFIGS.items():
        for layout in ("nchw", "cl"):
            with monkeypatch.context() as m:
                for k, v in cfg.items():
                    m.setitem(gn_launch.TUNING, k, v)
                xx = x if layout == "nchw" else x.contiguous(memory_format=torch.channels_last)
                y = group_norm(xx, 3, w, b, EPS, "silu")
                runs.append((name, layout, y, *torch.autograd.grad(y, (x, w, b), dy)))
    for name, layout, *got in runs[1:]:
        for a, c in zip(got, runs[0][2:]):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=f"{name} {layout}")
    assert gn_launch._COUNTERS and all(int(buf.abs().sum()) == 0 for buf in gn_launch._COUNTERS.values())


def test_tuning_change_rebuilds_plans(triton_backend, monkeypatch):
    """Changing TUNING drops the cached plans: the next call runs with the new tiles."""
    x = randn((2, 8, 6, 6), F32)
    group_norm(x, 4)
    assert len(gn_launch.PLANS) == 1
    (plan,) = gn_launch.PLANS.values()
    assert plan.fwd.meta["BLOCK_D"] * plan.fwd.meta["BLOCK_L"] > 8
    monkeypatch.setitem(gn_launch.TUNING, "tile", 8)
    assert not gn_launch.PLANS
    y = group_norm(x, 4)
    (plan,) = gn_launch.PLANS.values()
    assert plan.fwd.meta["BLOCK_D"] * plan.fwd.meta["BLOCK_L"] == 8
    torch.testing.assert_close(y, group_norm_ref(x, 4), rtol=1e-5, atol=1e-5)


def test_general_path_parameters(triton_backend):
    """Parameters the fast path does not take (a (C, 1) view, a non-contiguous slice) go the general way."""
    x = randn((2, 6, 4, 4), F32, requires_grad=True)
    w2 = randn((6, 2))
    w = w2[:, 0].requires_grad_()  # non-contiguous (C,)
    b = randn((6, 1), requires_grad=True)
    y = group_norm(x, 3, w, b, EPS, "SiLU")
    ref = group_norm_ref(x, 3, w, b.reshape(6), EPS, True)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    rx, rw, rb = torch.autograd.grad(ref, (x, w, b), torch.ones_like(y))
    for a, c in ((gx, rx), (gw, rw), (gb, rb)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_stats_are_fp32_and_match(path):
    x = randn((3, 8, 4, 4), BF16)
    y, mean, rstd = group_norm(x, 4, return_stats=True)
    assert mean.dtype == rstd.dtype == F32 and mean.shape == (3, 4)
    xg = x.float().reshape(3, 4, -1)
    torch.testing.assert_close(mean, xg.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, torch.rsqrt(xg.var(-1, unbiased=False) + EPS), rtol=1e-4, atol=1e-4)


def test_empty_batch(path):
    x = randn((0, 6, 3, 3), F32, requires_grad=True)
    w = randn(6, requires_grad=True)
    y = group_norm(x, 3, w, None)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros(6))


def test_torch_compile_fullgraph(triton_backend):
    """``fullgraph=True`` fails on any graph break: the custom ops and their fake impls trace."""
    torch._dynamo.reset()

    def fn(x, w, b):
        return group_norm(x, 2, w, b, EPS, "silu") * 2.0

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    x = randn((2, 4, 3, 5), requires_grad=True).contiguous(memory_format=torch.channels_last)
    x.retain_grad()
    w, b = randn(4, requires_grad=True), randn(4, requires_grad=True)
    dy = randn((2, 4, 3, 5))
    res = []
    for f in (fn, compiled):
        y = f(x, w, b)
        res.append((y, *torch.autograd.grad(y, (x, w, b), dy)))
    for e, c, name in zip(*res, ("y", "dx", "dw", "db")):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=name)


def test_bad_arguments():
    x = randn((2, 6, 3, 3))
    with pytest.raises(ValueError, match="divide the 6 channels.*got 4"):
        group_norm(x, 4)
    with pytest.raises(ValueError, match="num_groups must be positive"):
        group_norm(x, 0)
    with pytest.raises(ValueError, match="weight must have num_channels = 6 elements, got shape \\(5,\\)"):
        group_norm(x, 3, randn(5))
    with pytest.raises(ValueError, match="act must be None, '', 'silu' or 'swish', got 'gelu'"):
        group_norm(x, 3, act="gelu")
    with pytest.raises(TypeError, match="x must be a float16/bfloat16/float32/float64 tensor, got torch.int64"):
        group_norm(torch.ones(2, 6, 3, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="x must be \\(N, C, \\*spatial\\), got shape \\(6,\\)"):
        group_norm(randn(6), 3)
    with pytest.raises(TypeError, match="bias must be a floating-point tensor, got torch.int32"):
        group_norm(x, 3, None, torch.ones(6, dtype=torch.int32))
    with pytest.raises(ValueError, match="eps must be non-negative, got -1"):
        group_norm(x, 3, eps=-1.0)


def test_return_stats_with_autograd(path):
    """``return_stats`` with autograd recording: the statistics are not differentiable, the gradients are those
    of ``y``, and an in-place change of the returned statistics is caught before the backward uses them."""
    x = randn((2, 8, 3, 5), F32, requires_grad=True)
    w = randn(8, requires_grad=True)
    y, mean, rstd = group_norm(x, 4, w, None, EPS, "silu", return_stats=True)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
    got = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    ref = group_norm_ref(x, 4, w, None, EPS, True)
    for a, e in zip(got, torch.autograd.grad(ref, (x, w), torch.ones_like(ref))):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    y, mean, _ = group_norm(x, 4, w, None, EPS, "silu", return_stats=True)
    mean.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_explicit_backward_matches_autograd(path, layout):
    """``group_norm_backward`` (Apex's ``group_norm_nhwc_bprop``) from the returned statistics, with a gradient
    in another layout than ``x``, equals autograd's gradients."""
    from culmen.ops.group_norm.op import group_norm_backward

    x = randn((2, 8, 3, 5), F32)
    if layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = randn(8), randn(8)
    dy = randn((2, 8, 5, 3)).transpose(2, 3)  # neither NCHW- nor channels-last-contiguous
    y, mean, rstd = group_norm(x, 4, w, b, EPS, "silu", return_stats=True)
    got = group_norm_backward(dy, x, 4, w, b, mean, rstd, "silu")
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    expected = torch.autograd.grad(group_norm(*leaves[:1], 4, *leaves[1:], EPS, "silu"), leaves, dy)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_opcheck(path):
    """The traced op's schema and fake impl hold (torch.library.opcheck)."""
    x = randn((2, 6, 3, 4), F32)
    for args in ((x, randn(6), randn(6), 3, EPS, True),
                 (x.contiguous(memory_format=torch.channels_last), None, None, 2, EPS, False)):
        torch.library.opcheck(torch.ops.culmen.group_norm_fwd.default, args, test_utils=("test_schema",
                                                                                         "test_faketensor"))
