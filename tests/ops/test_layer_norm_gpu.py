"""``culmen.ops.layer_norm`` on a real GPU at real sizes (run by ``scripts/gpu-check``).

Same tolerance rule as ``test_layer_norm.py``: the op's error against ``layer_norm_ref`` on float64
copies (computed on the GPU) must be at most 2x the error of ``layer_norm_ref`` run by PyTorch in the
inputs' own dtype, plus a small atol. Dropout cases replay the op's own keep-masks.
"""

from __future__ import annotations

import pytest
import torch

from culmen.ops.layer_norm import launch as ln_launch
from culmen.ops.layer_norm import layer_norm, layer_norm_ref
from culmen.testing import assert_close_tolerance, randn

pytestmark = pytest.mark.gpu

EPS = 1e-5
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
GRAD_NAMES = ("x", "weight", "bias", "residual", "x1", "weight1", "bias1")


def _make_inputs(shape, dtype, *, residual=None, x1=False, weight1=False, rowscale=False, requires_grad=False):
    dev = torch.device("cuda")
    N = shape[-1]

    def act(dt):
        return randn(shape, dt, dev, requires_grad=requires_grad)

    def vec(scale, offset=0.0):
        return ((torch.randn(N, device=dev) * scale + offset).to(dtype)).requires_grad_(requires_grad)

    return {
        "x": act(dtype),
        "weight": vec(0.5, 1.0),
        "bias": vec(0.5),
        "residual": act(residual) if residual is not None else None,
        "x1": act(dtype) if x1 else None,
        "weight1": vec(0.5, 1.0) if weight1 else None,
        "bias1": vec(0.5) if weight1 else None,
        "rowscale": (torch.rand(shape[:-1], device=dev) + 0.5).to(dtype) if rowscale else None,
    }


def _ref(inp, masks, *, hi, rms, dropout_p, residual_in_fp32=False):
    cp = {k: (None if v is None else (v.detach().to(F64) if hi else v.detach())) for k, v in inp.items()}
    for k in GRAD_NAMES:
        if cp[k] is not None and inp[k].requires_grad:
            cp[k].requires_grad_()
    out = layer_norm_ref(cp["x"], cp["weight"], cp["bias"], cp["residual"], cp["x1"], cp["weight1"], cp["bias1"],
                         eps=EPS, dropout_p=dropout_p, rowscale=cp["rowscale"], prenorm=True,
                         dropout_mask=masks[0], dropout_mask1=masks[1], is_rms_norm=rms,
                         residual_in_fp32=residual_in_fp32 and not hi)
    if cp["weight1"] is not None:
        y, y1, pre = out
    else:
        (y, pre), y1 = out, None
    return cp, {"y": y, "y1": y1, "residual_out": pre}


def _run(inp, *, rms, dropout_p, residual_in_fp32=False):
    return layer_norm(inp["x"], inp["weight"], inp["bias"], residual=inp["residual"], x1=inp["x1"],
                      weight1=inp["weight1"], bias1=inp["bias1"], eps=EPS, dropout_p=dropout_p,
                      rowscale=inp["rowscale"], is_rms_norm=rms, residual_in_fp32=residual_in_fp32,
                      return_residual=True, return_dropout_mask=True)


def _loss(vals, cot, hi):
    loss = 0.0
    for k, v in vals.items():
        if v is not None:
            loss = loss + (v * (cot[k].to(F64) if hi else cot[k])).sum()
    return loss


def _grads(loss, inp):
    names = [k for k in GRAD_NAMES if inp[k] is not None]
    return {f"d{k}": g for k, g in zip(names, torch.autograd.grad(loss, [inp[k] for k in names]))}


def _check(got, refs, label):
    for name, actual in got.items():
        if actual is None:
            continue
        assert torch.isfinite(actual).all(), f"{name} [{label}] has non-finite values"
        assert_close_tolerance(actual, refs[True][name], refs[False][name], name=f"{name} [{label}]")


def _id(v) -> str:
    if isinstance(v, tuple):
        return "x".join(map(str, v))
    if isinstance(v, dict):
        return "-".join(f"{k}={_id(x)}" for k, x in v.items()) or "plain"
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    return str(v)


def _check_case(shape, dtype, *, rms, grads, dropout_p=0.0, residual=None, x1=False, weight1=False,
                rowscale=False, residual_in_fp32=False):
    label = f"{'RMS' if rms else 'LN'} {shape} {dtype}"
    inp = _make_inputs(shape, dtype, residual=residual, x1=x1, weight1=weight1, rowscale=rowscale,
                       requires_grad=grads)
    out = _run(inp, rms=rms, dropout_p=dropout_p, residual_in_fp32=residual_in_fp32)
    masks = (out.dropout_mask, out.dropout_mask1)
    if dropout_p > 0:
        dropped = 1.0 - out.dropout_mask.float().mean().item()
        assert abs(dropped - dropout_p) < 0.02, dropped
    got = {"y": out.y, "y1": out.y1, "residual_out": out.residual_out}
    if not grads:
        refs = {hi: _ref(inp, masks, hi=hi, rms=rms, dropout_p=dropout_p, residual_in_fp32=residual_in_fp32)[1]
                for hi in (True, False)}
        _check(got, refs, label)
        return
    cot = {k: randn(v.shape, v.dtype, v.device) for k, v in got.items() if v is not None}
    got.update(_grads(_loss(got, cot, False), inp))
    refs = {}
    for hi in (True, False):
        cp, vals = _ref(inp, masks, hi=hi, rms=rms, dropout_p=dropout_p, residual_in_fp32=residual_in_fp32)
        vals.update(_grads(_loss(vals, cot, hi), cp))
        refs[hi] = vals
    _check(got, refs, label)


@pytest.mark.parametrize(
    "shape, dtype, rms, kw",  # rms: False = LayerNorm, True = RMSNorm
    [
        ((16384, 4096), BF16, False, dict(residual=BF16, x1=True, weight1=True, dropout_p=0.1)),
        ((16384, 4096), F32, True, dict(residual=F32)),
        ((4096, 65536), BF16, True, dict(residual=F32)),
        ((4096, 65536), F32, False, dict(rowscale=True)),
        ((7, 100000), BF16, False, dict(residual=BF16, x1=True, weight1=True, dropout_p=0.2)),  # chunked
        ((7, 100000), F32, True, dict(dropout_p=0.1, residual_in_fp32=True)),
        ((2, 131072), BF16, True, dict(residual=BF16, x1=True, weight1=True)),
        ((2, 131072), F32, False, dict(residual=F32, dropout_p=0.3)),
    ],
    ids=_id,
)
def test_forward_large(shape, dtype, rms, kw):
    _check_case(shape, dtype, rms=rms, grads=False, **kw)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("shape", [(1000, 8192), (37, 70000)], ids=_id)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=_id)
@pytest.mark.parametrize("rms", [False, True], ids=["LN", "RMS"])
def test_gradients(shape, dtype, rms):
    _check_case(shape, dtype, rms=rms, grads=True, residual=F32 if dtype == BF16 else dtype, x1=True,
                weight1=True, rowscale=True, dropout_p=0.15)


def test_gradients_plain_row_resident_and_chunked():
    """No fusion at all: the pre-norm sum is x itself (no residual_out stored)."""
    for shape in ((1000, 8192), (37, 70000)):
        _check_case(shape, BF16, rms=False, grads=True)


def test_more_than_2_31_elements():
    N = 4096
    M = 2**31 // N + 3
    dev = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info()
    need = 4 * M * N * 2 + (1 << 30)  # x, residual, y, residual_out in bf16
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free GPU memory, {free / 2**30:.1f} GiB free")
    x = torch.randn((M, N), device=dev, dtype=BF16)
    res = torch.randn((M, N), device=dev, dtype=BF16)
    w = (torch.randn(N, device=dev) * 0.5 + 1.0).to(BF16)
    b = (torch.randn(N, device=dev) * 0.5).to(BF16)
    assert x.numel() > 2**31
    with torch.no_grad():
        out = layer_norm(x, w, b, residual=res, return_residual=True, eps=EPS)
    torch.cuda.synchronize()
    first_past = 2**31 // N  # the first row whose elements lie past 2^31
    rows = torch.tensor([0, 1, M // 2, first_past - 1, first_past, first_past + 1, M - 1], device=dev)
    xs, rs = x[rows], res[rows]
    hi, hi_pre = layer_norm_ref(xs.double(), w.double(), b.double(), rs.double(), eps=EPS, prenorm=True)
    lo, lo_pre = layer_norm_ref(xs, w, b, rs, eps=EPS, prenorm=True)
    assert_close_tolerance(out.y[rows], hi, lo, name="y rows")
    assert_close_tolerance(out.residual_out[rows], hi_pre, lo_pre, name="residual_out rows")
    del x, res, out
    torch.cuda.empty_cache()


def _all_launches():
    """Every ``Launch`` of every cached norm plan."""
    out = []
    for plan in ln_launch.PLANS.values():
        out += list(plan._fwd.values())
        for b in plan._bwd.values():
            out += [la for la in (b.main, b.dw, b.finish) if la is not None]
    return out


@pytest.fixture
def fresh_plans():
    """No cached plans before and after (what an earlier test cached cannot leak into this one)."""
    from culmen.ops.common.plans import clear_plans

    clear_plans()
    yield
    clear_plans()


def _fwd_bwd(inp, dropout_p, seed):
    torch.manual_seed(seed)  # seeds every GPU's generator: the same dropout seed on each device
    out = _run(inp, rms=False, dropout_p=dropout_p)
    names = [k for k in GRAD_NAMES if inp[k] is not None]
    loss = out.y.float().sum() + 2 * out.y1.float().sum() + out.residual_out.sum()
    grads = torch.autograd.grad(loss, [inp[k] for k in names])
    return (out.y, out.y1, out.residual_out, out.dropout_mask, *grads)


SHAPES = ((513, 3000), (9, 70000))  # row-resident and chunked kernels


def test_non_current_device(fresh_plans):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert torch.cuda.current_device() == 0
    for shape in SHAPES:
        inp0 = _make_inputs(shape, BF16, residual=F32, x1=True, weight1=True, rowscale=True, requires_grad=True)
        inp1 = {k: (v.detach().to("cuda:1").requires_grad_(v.requires_grad) if v is not None else None)
                for k, v in inp0.items()}
        # Twice per device: the second call of a specialization takes the fast launch path.
        r0 = [_fwd_bwd(inp0, 0.1, seed=5) for _ in range(2)][-1]
        r1 = [_fwd_bwd(inp1, 0.1, seed=5) for _ in range(2)][-1]
        assert torch.cuda.current_device() == 0
        for a, c in zip(r0, r1):
            assert c.device == torch.device("cuda", 1)
            assert torch.equal(a, c.to("cuda:0"))
    # Both devices' plans took the direct launch path (a handle loaded for one device is never launched on
    # the other: each plan belongs to one device, and another current device takes Triton's own launch).
    for la in _all_launches():
        assert la._run is not None, f"{la.fn.fn.__name__}: no direct launch: {la.error}"


def test_fast_launch_bitwise(fresh_plans):
    """The direct launch path (second call of a plan) gives what Triton's own launch gives."""
    from culmen.ops.common.launch import set_fast_launch

    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)
            for shape in SHAPES:
                if not mode:
                    results[shape, "inp"] = _make_inputs(shape, BF16, residual=F32, x1=True, weight1=True,
                                                         rowscale=True, requires_grad=True)
                results[shape, mode] = [_fwd_bwd(results[shape, "inp"], 0.1, seed=11) for _ in range(2)][-1]
            launches = _all_launches()
            assert launches
            if not mode:
                assert all(la._run is None for la in launches)
            else:
                for la in launches:
                    assert la._run is not None, f"{la.fn.fn.__name__} never took the direct path: {la.error}"
    finally:
        set_fast_launch(True)
    for shape in SHAPES:
        for a, c in zip(results[shape, False], results[shape, True]):
            assert torch.equal(a, c)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor(dynamic):
    """Under torch.compile (Inductor) the kernels are traced (triton_op + wrap_triton): results and
    gradients equal eager's, no graph break, and with dynamic shapes new row counts do not recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    dev = torch.device("cuda")
    N = 1000
    w = torch.randn(N, device=dev, dtype=BF16, requires_grad=True)
    b = torch.randn(N, device=dev, dtype=BF16, requires_grad=True)

    def fn(x, res):
        o = layer_norm(x, w, b, residual=res, return_residual=True, eps=EPS, is_rms_norm=False)
        return o.y, o.residual_out

    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    for M in (64, 77, 130):
        x = torch.randn(M, N, device=dev, dtype=BF16, requires_grad=True)
        res = torch.randn(M, N, device=dev, dtype=F32, requires_grad=True)
        gy, gr = torch.randn(M, N, device=dev, dtype=BF16), torch.randn(M, N, device=dev, dtype=F32)
        outs = []
        for f in (fn, compiled):
            y, r = f(x, res)
            grads = torch.autograd.grad((y.float() * gy).sum() + (r * gr).sum(), [x, res, w, b])
            outs.append((y, r, *grads))
        for e, c in zip(*outs):
            assert c.dtype == e.dtype and c.shape == e.shape
            torch.testing.assert_close(c, e, rtol=2e-2, atol=2e-2)
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1
