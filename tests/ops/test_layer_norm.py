"""``culmen.ops.layer_norm`` against a float64 oracle, on both CPU paths.

Every numerical case runs on the pure-PyTorch reference path and on the Triton kernels under the CPU
interpreter. The tolerance rule (DESIGN.md, Numerics): the op's error against ``layer_norm_ref`` run on
float64 copies of the inputs must be at most 2x the error of ``layer_norm_ref`` run by PyTorch in the
inputs' own dtype (plus a small atol), for every output and for the gradient of every input. Dropout
cases use the op's own keep-masks (``return_dropout_mask=True``) in both references.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
import torch

from culmen.ops.backend import set_backend
from culmen.ops.layer_norm import LayerNormOutput, layer_norm, layer_norm_ref
from culmen.ops.layer_norm import launch as ln_launch
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

BACKENDS = ["reference", "triton"]
EPS = 1e-5
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test once on each CPU path, through conftest's ``reference_backend`` / ``triton_backend``."""
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


@pytest.fixture
def chunked(monkeypatch):
    """Force the chunked (long-row) kernels at tiny N: rows longer than 16 are walked in chunks of 16."""
    monkeypatch.setitem(ln_launch.TUNING, "fwd_max_resident", 16)
    monkeypatch.setitem(ln_launch.TUNING, "bwd_max_resident", 16)
    monkeypatch.setitem(ln_launch.TUNING, "chunk", 16)


# ---------------------------------------------------------------------------------------------
# The tolerance-rule harness
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    dtype: torch.dtype = F32
    rms: bool = False
    weight: bool = True
    bias: bool = True
    residual: torch.dtype | None = None  # dtype of the residual input; None: no residual
    x1: bool = False
    weight1: bool = False
    bias1: bool = False
    dropout_p: float = 0.0
    rowscale: bool = False
    zero_centered: bool = False
    residual_in_fp32: bool = False
    out_dtype: torch.dtype | None = None
    memory_efficient: bool = False
    noncontig: str = ""  # which of x / residual / x1 get padded rows: "x", "residual", "x1", "all"
    return_residual: bool = True

    def __str__(self) -> str:
        short = {F32: "f32", F16: "f16", BF16: "bf16"}
        parts = ["RMS" if self.rms else "LN", "x".join(map(str, self.shape)), short[self.dtype]]
        for f in fields(self):
            if f.name in ("shape", "dtype", "rms"):
                continue
            v, d = getattr(self, f.name), f.default
            if v != d:
                if isinstance(v, bool):
                    parts.append(f.name if v else f"no_{f.name}")
                else:
                    parts.append(f"{f.name}={short.get(v, v)}")
        return "-".join(parts)


def _make_inputs(c: Case) -> dict[str, torch.Tensor | None]:
    """Fresh random inputs (leaf tensors that require grad, except ``rowscale``)."""
    N = c.shape[-1]
    rows = c.shape[:-1]

    def param(kind: str) -> torch.Tensor:
        if kind == "w":
            if c.zero_centered:
                t = 0.2 * torch.randn(N)  # the op uses 1 + w
            else:
                # Bounded away from 0 so memory_efficient (x-hat recomputed as (y - b) / w) is well posed.
                sign = torch.where(torch.rand(N) < 0.5, -1.0, 1.0)
                t = sign * (0.5 + torch.rand(N))
        else:
            t = 0.5 * torch.randn(N)
        return t.to(c.dtype).requires_grad_()

    def act(name: str, dtype: torch.dtype, pad: int) -> torch.Tensor:
        t = randn(c.shape, dtype)
        if c.noncontig in (name, "all"):
            # Each tensor its own row stride, so a kernel that mixes up strides is caught.
            t = make_noncontiguous(t, pad=pad)
            assert not t.is_contiguous()
        return t.requires_grad_()

    inp = {
        "x": act("x", c.dtype, 3),
        "weight": param("w") if c.weight else None,
        "bias": param("b") if c.bias else None,
        "residual": act("residual", c.residual, 5) if c.residual is not None else None,
        "x1": act("x1", c.dtype, 7) if c.x1 else None,
        "weight1": param("w") if c.weight1 else None,
        "bias1": param("b") if c.bias1 else None,
        "rowscale": (torch.rand(rows) + 0.5).to(c.dtype) if c.rowscale else None,
    }
    return inp


_GRAD_NAMES = ("x", "weight", "bias", "residual", "x1", "weight1", "bias1")


def _run_op(c: Case, inp: dict) -> LayerNormOutput:
    return layer_norm(
        inp["x"], inp["weight"], inp["bias"], residual=inp["residual"], x1=inp["x1"], weight1=inp["weight1"],
        bias1=inp["bias1"], eps=EPS, dropout_p=c.dropout_p, rowscale=inp["rowscale"], is_rms_norm=c.rms,
        zero_centered_weight=c.zero_centered, residual_in_fp32=c.residual_in_fp32, out_dtype=c.out_dtype,
        return_residual=c.return_residual, return_dropout_mask=True, memory_efficient=c.memory_efficient)


def _run_ref(c: Case, inp: dict, masks, hi: bool):
    """``layer_norm_ref`` on float64 copies (``hi``) or on copies in the original dtypes (the baseline)."""
    cp = {k: (None if v is None else (v.detach().to(F64) if hi else v.detach().clone())) for k, v in inp.items()}
    for k in _GRAD_NAMES:
        if cp[k] is not None:
            cp[k].requires_grad_()
    out = layer_norm_ref(
        cp["x"], cp["weight"], cp["bias"], cp["residual"], cp["x1"], cp["weight1"], cp["bias1"], eps=EPS,
        dropout_p=c.dropout_p, rowscale=cp["rowscale"], prenorm=True, zero_centered_weight=c.zero_centered,
        dropout_mask=masks[0], dropout_mask1=masks[1], is_rms_norm=c.rms,
        # In float64 the pre-norm sum is already wider than fp32, and the output stays float64.
        residual_in_fp32=c.residual_in_fp32 and not hi, out_dtype=None if hi else c.out_dtype)
    if c.weight1:
        y, y1, pre = out
    else:
        (y, pre), y1 = out, None
    return cp, y, y1, pre


def _loss(y, y1, pre, cot, hi: bool):
    def cast(t):
        return t.to(F64) if hi else t

    loss = (y * cast(cot["y"])).sum()
    if y1 is not None:
        loss = loss + (y1 * cast(cot["y1"])).sum()
    if pre is not None:
        loss = loss + (pre * cast(cot["residual_out"])).sum()
    return loss


def _grads(loss, inp: dict) -> dict:
    names = [k for k in _GRAD_NAMES if inp[k] is not None]
    gs = torch.autograd.grad(loss, [inp[k] for k in names])
    return dict(zip(names, gs))


def check_case(c: Case) -> None:
    inp = _make_inputs(c)
    out = _run_op(c, inp)
    x = inp["x"]

    # Output metadata.
    out_dtype = c.out_dtype or c.dtype
    res_dtype = c.residual or (F32 if c.residual_in_fp32 else c.dtype)
    assert out.y.shape == x.shape and out.y.dtype == out_dtype
    if c.weight1:
        assert out.y1.shape == x.shape and out.y1.dtype == out_dtype
    else:
        assert out.y1 is None
    if c.return_residual:
        assert out.residual_out.shape == x.shape and out.residual_out.dtype == res_dtype
    else:
        assert out.residual_out is None
    if c.dropout_p > 0:
        assert out.dropout_mask.dtype == torch.bool and out.dropout_mask.shape == x.shape
        assert (out.dropout_mask1 is not None) == c.x1
        if c.x1:
            assert out.dropout_mask1.dtype == torch.bool and out.dropout_mask1.shape == x.shape
    else:
        assert out.dropout_mask is None and out.dropout_mask1 is None
    masks = (out.dropout_mask, out.dropout_mask1)

    # Random cotangents, shared by the op, the oracle and the baseline.
    cot = {"y": randn(x.shape, out_dtype)}
    if c.weight1:
        cot["y1"] = randn(x.shape, out_dtype)
    if c.return_residual:
        cot["residual_out"] = randn(x.shape, res_dtype)

    got = {"y": out.y, "y1": out.y1, "residual_out": out.residual_out}
    got_g = _grads(_loss(out.y, out.y1, out.residual_out, cot, False), inp)

    refs = {}
    for hi in (True, False):
        cp, y, y1, pre = _run_ref(c, inp, masks, hi)
        vals = {"y": y, "y1": y1, "residual_out": pre if c.return_residual else None}
        vals.update({f"d{k}": g for k, g in _grads(_loss(*vals.values(), cot, hi), cp).items()})
        refs[hi] = vals

    got.update({f"d{k}": g for k, g in got_g.items()})
    for name, actual in got.items():
        if actual is None:
            assert refs[True][name] is None, name
            continue
        if name.startswith("d"):
            src = inp[name[1:]]
            assert actual.dtype == src.dtype and actual.shape == src.shape, name
        # Every element written (a missed store would be garbage / NaN) and finite.
        assert torch.isfinite(actual).all(), f"{name} has non-finite values"
        assert_close_tolerance(actual, refs[True][name], refs[False][name], name=f"{name} [{c}]")


R = F32  # short alias for "residual in fp32"

CASES = [
    # Shapes: tiny, odd, 3-D, across block boundaries.
    Case((1, 1)),
    Case((1, 1), rms=True, dtype=BF16),
    Case((3, 63)),
    Case((3, 63), rms=True),
    Case((5, 123), dtype=BF16, residual=BF16),
    Case((5, 123), dtype=F16, rms=True, residual=F16, bias=False),
    Case((2, 3, 40), dtype=BF16, residual=R, rowscale=True),  # fp32 residual with bf16 x
    Case((5, 123), dtype=BF16, rms=True, residual=R),  # ... and nothing else fused: dresidual is fp32
    Case((4, 257), dtype=BF16, rms=True, residual_in_fp32=True),  # no residual, pre-norm sum kept in fp32
    Case((4, 257), dtype=F16, residual=F16, x1=True, weight1=True, bias1=True),
    Case((2, 1000), dtype=BF16, residual=BF16),
    Case((2, 1000), rms=True, dtype=F16),
    # Dropout (the references replay the op's masks).
    Case((2, 1000), dropout_p=0.3),
    Case((5, 123), dtype=BF16, rms=True, residual=BF16, x1=True, weight1=True, dropout_p=0.3),
    Case((4, 257), dtype=BF16, residual=R, x1=True, rowscale=True, dropout_p=0.3),
    Case((2, 3, 40), dtype=F16, rowscale=True, dropout_p=0.3, return_residual=False),
    # Weight variants.
    Case((3, 63), zero_centered=True, residual=F32),
    Case((5, 123), dtype=BF16, rms=True, zero_centered=True, x1=True, weight1=True, bias1=True),
    Case((5, 123), weight=False, bias=False),
    Case((4, 257), dtype=BF16, rms=True, weight=False, bias=False, residual=BF16),
    Case((3, 63), dtype=F16, bias=False, residual=F16),
    # Output / residual dtypes and the residual output.
    Case((5, 123), dtype=BF16, out_dtype=F32, residual=BF16),
    Case((4, 257), dtype=BF16, rms=True, out_dtype=F32, residual_in_fp32=True, x1=True),
    Case((3, 63), dtype=BF16, residual=BF16, return_residual=False),
    # memory_efficient: x-hat recomputed from y in the backward.
    Case((5, 123), memory_efficient=True, residual=F32),
    Case((4, 257), dtype=BF16, rms=True, memory_efficient=True, dropout_p=0.3),
    Case((3, 63), dtype=F16, memory_efficient=True, weight=False, bias=False),
    Case((2, 3, 40), dtype=BF16, memory_efficient=True, zero_centered=True, residual=BF16),
    # Non-contiguous rows (stride N + 3, padding poisoned with NaN) for x and residual.
    Case((2, 3, 40), dtype=BF16, residual=BF16, noncontig="all"),
    Case((5, 123), rms=True, residual=F32, x1=True, weight1=True, noncontig="all"),
    Case((4, 257), dtype=F16, residual=F16, noncontig="residual"),
    Case((3, 63), dtype=BF16, residual=BF16, x1=True, dropout_p=0.3, noncontig="x"),
    Case((3, 63), residual=F32, x1=True, noncontig="x1"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(backend, case):
    check_case(case)


CHUNKED_CASES = [
    Case((3, 123), residual=F32, weight1=True, bias1=True, dropout_p=0.3, x1=True),
    Case((5, 40), dtype=BF16, rms=True, residual=BF16, dropout_p=0.3),
    Case((3, 63), dtype=BF16, residual=BF16, memory_efficient=True),
    Case((4, 57), rms=True, dtype=F16, memory_efficient=True, rowscale=True, noncontig="all", residual=F16),
    Case((2, 3, 33), rms=True, weight1=True, zero_centered=True, residual_in_fp32=True, dtype=BF16),
    Case((2, 100), weight=False, bias=False, residual=F32, x1=True),
]


@pytest.mark.parametrize("case", CHUNKED_CASES, ids=str)
def test_tolerance_rule_chunked_kernels(triton_backend, chunked, case):
    check_case(case)


def test_chunked_kernels_are_used(triton_backend, chunked, monkeypatch):
    """The ``chunked`` fixture really routes through the chunked kernels (and the default does not)."""
    from culmen.ops.layer_norm import kernels as k

    def kernels_of_last_plan():
        plan = next(reversed(ln_launch.PLANS.values()))
        b = plan._bwd[False]
        return [plan.fwd_kernel, b.main.fn] + ([b.dw.fn] if b.dw is not None else [])

    x = randn((3, 40), requires_grad=True)
    w = randn(40, requires_grad=True)
    layer_norm(x, w, None).y.sum().backward()
    assert kernels_of_last_plan() == [k._layer_norm_fwd_chunked_kernel, k._layer_norm_bwd_chunked_kernel,
                                      k._layer_norm_bwd_dw_kernel]
    monkeypatch.setitem(ln_launch.TUNING, "fwd_max_resident", 64)
    monkeypatch.setitem(ln_launch.TUNING, "bwd_max_resident", 64)
    layer_norm(x, w, None).y.sum().backward()
    assert kernels_of_last_plan() == [k._layer_norm_fwd_kernel, k._layer_norm_bwd_kernel]


# ---------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------


def test_dropout_statistics_and_scaling(backend):
    p = 0.3
    x = randn((64, 512), requires_grad=True)
    res = randn((64, 512), requires_grad=True)
    x1 = randn((64, 512), requires_grad=True)
    w = randn(512, requires_grad=True)
    out = layer_norm(x, w, None, residual=res, x1=x1, dropout_p=p, return_residual=True, return_dropout_mask=True)
    mask, mask1 = out.dropout_mask, out.dropout_mask1
    for m in (mask, mask1):
        dropped = 1.0 - m.float().mean().item()
        assert abs(dropped - p) < 0.02, dropped
        # Not a degenerate pattern: every row and most columns see both kept and dropped entries.
        assert bool(m.any(1).all()) and bool((~m).any(1).all())
    # x and x1 get independent masks.
    agree = (mask == mask1).float().mean().item()
    assert abs(agree - (p * p + (1 - p) * (1 - p))) < 0.02, agree

    # Kept entries are scaled by 1 / (1 - p); dropped ones contribute nothing to the pre-norm sum.
    expected = torch.where(mask, x / (1 - p), 0.0) + torch.where(mask1, x1 / (1 - p), 0.0) + res
    torch.testing.assert_close(out.residual_out, expected, rtol=1e-6, atol=1e-6)

    gy = randn(x.shape)
    dx, dres, dx1 = torch.autograd.grad((out.y * gy).sum(), [x, res, x1])
    assert bool((dx[~mask] == 0).all()) and bool((dx1[~mask1] == 0).all())
    # The gradient of the pre-norm sum is dres; dx (dx1) is that, masked and scaled by 1 / (1 - p).
    torch.testing.assert_close(dx[mask], dres[mask] / (1 - p), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx1[mask1], dres[mask1] / (1 - p), rtol=1e-6, atol=1e-6)
    assert bool((dx[mask] != 0).all())


def test_dropout_masks_seeded_and_fresh(backend):
    x = randn((16, 96))
    x1 = randn((16, 96))

    def masks():
        o = layer_norm(x, None, None, x1=x1, dropout_p=0.3, return_dropout_mask=True)
        return o.dropout_mask, o.dropout_mask1, o.y

    torch.manual_seed(123)
    m_a, m1_a, y_a = masks()
    torch.manual_seed(123)
    m_b, m1_b, y_b = masks()
    assert torch.equal(m_a, m_b) and torch.equal(m1_a, m1_b) and torch.equal(y_a, y_b)
    m_c, m1_c, _ = masks()  # the next call, same generator stream: fresh masks
    assert not torch.equal(m_a, m_c) and not torch.equal(m1_a, m1_c)
    assert not torch.equal(m_a, m1_a)


def test_dropout_paths_agree_given_mask(monkeypatch):
    """Each path's y equals the unfused reference fed that path's mask (the masks themselves differ)."""
    x = randn((6, 200), BF16)
    res = randn((6, 200), F32)
    w, b = randn(200, BF16), randn(200, BF16)
    for be in BACKENDS:
        set_backend(be)
        o = layer_norm(x, w, b, residual=res, dropout_p=0.25, return_dropout_mask=True, return_residual=True)
        ref, pre = layer_norm_ref(x.float(), w.float(), b.float(), res, eps=EPS, dropout_p=0.25,
                                  dropout_mask=o.dropout_mask, prenorm=True)
        torch.testing.assert_close(o.residual_out, pre, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(o.y, ref.to(BF16), rtol=1.6e-2, atol=1.6e-2)
    # Without dropout the two paths compute the same function in fp32: equal up to rounding of y.
    outs = []
    for be in BACKENDS:
        set_backend(be)
        outs.append(layer_norm(x, w, b, residual=res).y.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=8e-3, atol=8e-3)


# ---------------------------------------------------------------------------------------------
# API behaviour
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 33), (2, 3, 17)])
def test_return_residual_without_fusion_is_x(backend, shape):
    x = randn(shape, BF16, requires_grad=True)
    out = layer_norm(x, randn(shape[-1], BF16), None, return_residual=True)
    assert out.residual_out is x
    assert out.y1 is None and out.dropout_mask is None and out.dropout_mask1 is None
    # dropout_p == 0 with return_dropout_mask: no masks.
    out = layer_norm(x, None, None, return_residual=True, return_dropout_mask=True)
    assert out.residual_out is x and out.dropout_mask is None
    # With a fusion the residual output is a new tensor. (An fp32 residual keeps the sum exact: the
    # Triton interpreter truncates fp32 -> bf16 where GPUs round to nearest even.)
    r = randn(shape, F32)
    out = layer_norm(x, None, None, residual=r, return_residual=True)
    assert out.residual_out is not x and out.residual_out is not r and out.residual_out.dtype == F32
    torch.testing.assert_close(out.residual_out, x.float() + r, rtol=0, atol=0)


def test_bad_inputs():
    x = randn((4, 8))
    w = randn(8)
    with pytest.raises(TypeError):
        layer_norm(torch.ones(4, 8, dtype=torch.int32), w, None)
    with pytest.raises(TypeError):
        layer_norm(x, torch.ones(8, dtype=torch.int64), None)
    with pytest.raises(TypeError):
        layer_norm(x.numpy(), w, None)
    for p in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            layer_norm(x, w, None, dropout_p=p)
    with pytest.raises(ValueError):
        layer_norm(x, randn(7), None)
    with pytest.raises(ValueError):
        layer_norm(x, w, randn(9))
    with pytest.raises(ValueError):
        layer_norm(x, w, None, residual=randn((4, 7)))
    with pytest.raises(ValueError):
        layer_norm(x, w, None, residual=randn((8, 4)))
    with pytest.raises(ValueError):
        layer_norm(x, w, None, x1=randn((3, 8)))
    with pytest.raises(ValueError):
        layer_norm(x, w, None, rowscale=randn(5))
    with pytest.raises(ValueError):
        layer_norm(x, w, None, weight1=randn(8), memory_efficient=True)
    with pytest.raises(ValueError):
        layer_norm(x, w, None, bias1=randn(8))
    with pytest.raises(ValueError):
        layer_norm(x, w, None, weight1=randn(6))
    with pytest.raises(ValueError):
        layer_norm(x, w, None, eps=-1.0)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_empty_input(backend, dropout_p):
    N = 16
    x = randn((0, N), BF16, requires_grad=True)
    res = randn((0, N), F32, requires_grad=True)
    w = randn(N, BF16, requires_grad=True)
    b = randn(N, BF16, requires_grad=True)
    w1 = randn(N, BF16, requires_grad=True)
    out = layer_norm(x, w, b, residual=res, weight1=w1, dropout_p=dropout_p, return_residual=True,
                     return_dropout_mask=True)
    assert out.y.shape == (0, N) and out.y1.shape == (0, N) and out.residual_out.shape == (0, N)
    assert out.residual_out.dtype == F32
    if dropout_p:
        assert out.dropout_mask.shape == (0, N)
    loss = out.y.float().sum() + out.y1.float().sum() + out.residual_out.sum()
    dx, dres, dw, db, dw1 = torch.autograd.grad(loss, [x, res, w, b, w1])
    assert dx.shape == (0, N) and dres.shape == (0, N) and dx.dtype == BF16 and dres.dtype == F32
    for g in (dw, db, dw1):
        assert g.shape == (N,) and g.dtype == BF16 and bool((g == 0).all())
    # A 3-D input with an empty leading dimension keeps its shape.
    x3 = randn((2, 0, N), requires_grad=True)
    y3 = layer_norm(x3, None, None, is_rms_norm=True).y
    assert y3.shape == (2, 0, N)
    (dx3,) = torch.autograd.grad(y3.sum(), [x3])
    assert dx3.shape == (2, 0, N)


@pytest.mark.parametrize("rms", [False, True])
def test_backward_is_deterministic(triton_backend, rms):
    M, N = 37, 200  # several backward programs each contribute dW/dB partial sums
    x = randn((M, N), BF16, requires_grad=True)
    res = randn((M, N), F32, requires_grad=True)
    w, b, w1 = (randn(N, BF16, requires_grad=True) for _ in range(3))
    gy, gy1 = randn((M, N), BF16), randn((M, N), BF16)
    leaves = [x, res, w, b, w1]

    def grads():
        torch.manual_seed(7)
        o = layer_norm(x, w, b, residual=res, weight1=w1, dropout_p=0.1, is_rms_norm=rms)
        return torch.autograd.grad((o.y * gy).sum() + (o.y1 * gy1).sum(), leaves)

    g1, g2 = grads(), grads()
    for a, c, name in zip(g1, g2, ("dx", "dresidual", "dweight", "dbias", "dweight1")):
        assert torch.equal(a, c), name


@pytest.mark.parametrize("compile_backend", BACKENDS)
def test_torch_compile_fullgraph(compile_backend, compile_fusion, monkeypatch):
    set_backend(compile_backend)
    torch._dynamo.reset()
    M, N = 6, 48

    def fn(x, w, b, res, p):
        o = layer_norm(x, w, b, residual=res, dropout_p=p, return_residual=True, eps=EPS)
        return o.y, o.residual_out

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    x, res = randn((M, N), requires_grad=True), randn((M, N), requires_grad=True)
    w, b = randn(N, requires_grad=True), randn(N, requires_grad=True)
    gy, gr = randn((M, N)), randn((M, N))
    leaves = [x, w, b, res]

    def run(f, p):
        y, r = f(x, w, b, res, p)
        return (y, r, *torch.autograd.grad((y * gy).sum() + (r * gr).sum(), leaves))

    eager = run(fn, 0.0)
    comp = run(compiled, 0.0)
    for e, c, name in zip(eager, comp, ("y", "residual_out", "dx", "dweight", "dbias", "dresidual")):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=name)

    comp = run(compiled, 0.3)
    for e, c in zip(eager, comp):
        assert c.shape == e.shape and c.dtype == e.dtype and bool(torch.isfinite(c).all())
    # Dropout is really applied in the compiled graph: some pre-norm entries differ from x + res.
    assert not torch.allclose(comp[1], (x + res).detach())

    explained = torch._dynamo.explain(fn)(x, w, b, res, 0.3)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
