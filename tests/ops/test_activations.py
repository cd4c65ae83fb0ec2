"""``culmen.ops.activations``: fused bias + activation and gated activations against a float64 oracle.

Every numerical case runs on the pure-PyTorch reference path and on the Triton kernels under the CPU
interpreter. The tolerance rule (DESIGN.md): the op's error against ``act_ref`` / ``glu_ref`` on
float64 copies (gradients by autograd of the oracle, so the closed-form derivatives of the kernels are
checked independently) must be at most 2x PyTorch's own error in the input dtype, plus a small atol.
Output buffers are poisoned with NaN (``poisoned_allocations``) so an element a kernel forgets shows up.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from culmen.ops.activations import (
    ACTIVATIONS,
    act_bwd,
    act_fwd,
    act_grad_ref,
    act_ref,
    bias_act,
    gated_act,
    glu_bwd,
    glu_fwd,
)
from culmen.ops.activations import launch as act_launch
from culmen.ops.activations.op import act_plan
from culmen.testing import assert_close_tolerance, make_noncontiguous, poisoned_allocations, randn

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
_SHORT = {F32: "f32", F16: "f16", BF16: "bf16", None: "none"}


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


@pytest.fixture(autouse=True)
def poisoned():
    """Every buffer the plans allocate starts as NaN."""
    with poisoned_allocations():
        yield


def _layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t``'s values in a given memory layout: padded rows, or leading dims that cannot be merged."""
    if how == "pad":
        out = make_noncontiguous(t, pad=5)
        assert not out.is_contiguous()
        return out
    if how == "transpose":  # (a, b, n) stored as (b, a, n): reshape(-1, n) must copy
        out = t.transpose(0, 1).contiguous().transpose(0, 1)
        assert not out.is_contiguous()
        return out
    return t


@dataclass(frozen=True)
class ActCase:
    act: str
    shape: tuple[int, ...]
    dtype: torch.dtype = F32
    bias: torch.dtype | None = None
    layout: str = ""

    def __str__(self) -> str:
        s = f"{self.act}-{'x'.join(map(str, self.shape))}-{_SHORT[self.dtype]}-bias={_SHORT[self.bias]}"
        return s + (f"-{self.layout}" if self.layout else "")


ACT_CASES = [
    ActCase("gelu", (3, 63), F32, F32),
    ActCase("gelu", (5, 123), BF16, BF16, "pad"),
    ActCase("gelu_tanh", (2, 3, 40), F16, F32),
    ActCase("gelu_tanh", (7, 1000), BF16),
    ActCase("relu", (1, 1), F32, F32),
    ActCase("relu", (4, 3, 41), BF16, None, "transpose"),
    ActCase("sigmoid", (3, 63), F16, F16),
    ActCase("sqrelu", (4, 257), BF16, BF16),
    ActCase("silu", (2, 4097), F32),
    ActCase("silu", (5, 123), BF16, F32, "pad"),
    ActCase("none", (3, 63), BF16, BF16),
    ActCase("relu_ge0", (3, 63), F32, None, "pad"),
    # ReLU's bit mask: rows whose length is not a multiple of 8, a flat launch of 105 elements.
    ActCase("relu", (37, 45), BF16, BF16),
    ActCase("relu", (3, 5, 7), F16),
    ActCase("relu_ge0", (5, 123), F16, F32, "pad"),
]


def _oracle_act(x, b, g, act, hi):
    """Output and gradients of ``act(x + b)`` by autograd, in float64 (``hi``) or the inputs' dtypes."""
    xc = (x.detach().to(F64) if hi else x.detach().clone()).requires_grad_()
    bc = None if b is None else (b.detach().to(F64) if hi else b.detach().clone()).requires_grad_()
    y = act_ref(xc + bc if bc is not None else xc, act)
    leaves = [xc] + ([bc] if bc is not None else [])
    grads = torch.autograd.grad(y, leaves, g.to(y.dtype))
    return y, grads


@pytest.mark.parametrize("case", ACT_CASES, ids=str)
def test_bias_act_tolerance(backend, case):
    N = case.shape[-1]
    x = _layout(randn(case.shape, case.dtype, scale=2.0), case.layout).requires_grad_()
    b = randn(N, case.bias, scale=0.5).requires_grad_() if case.bias is not None else None
    y = bias_act(x, b, case.act)
    # Contiguous whatever the input layout: what the custom op's fake impl promises torch.compile.
    assert y.shape == x.shape and y.dtype == case.dtype and y.is_contiguous()
    g = randn(case.shape, case.dtype)
    leaves = [x] + ([b] if b is not None else [])
    got = (y, *torch.autograd.grad(y, leaves, g))
    assert got[1].is_contiguous()
    hi = _oracle_act(x, b, g, case.act, True)
    lo = _oracle_act(x, b, g, case.act, False)
    names = ["y", "dx", "dbias"]
    for name, a, rh, rl in zip(names, got, (hi[0], *hi[1]), (lo[0], *lo[1])):
        assert torch.isfinite(a).all(), f"{name} has non-finite values [{case}]"
        if name == "dbias":
            assert a.dtype == case.bias and a.shape == (N,)
        assert_close_tolerance(a, rh, rl, name=f"{name} [{case}]")


@dataclass(frozen=True)
class GluCase:
    act: str
    shape: tuple[int, ...]
    dtype: torch.dtype = F32
    layout: str = ""  # "pad", or "packed": x and u are the two halves of one (..., 2N) tensor

    def __str__(self) -> str:
        s = f"{self.act}-{'x'.join(map(str, self.shape))}-{_SHORT[self.dtype]}"
        return s + (f"-{self.layout}" if self.layout else "")


GLU_CASES = [
    GluCase("silu", (3, 63)),
    GluCase("silu", (5, 123), BF16, "pad"),
    GluCase("silu", (4, 257), BF16, "packed"),
    GluCase("gelu", (2, 3, 40), F16),
    GluCase("gelu_tanh", (7, 1000), BF16),
    GluCase("relu", (3, 63), BF16, "packed"),
    GluCase("sigmoid", (5, 123)),
    GluCase("sqrelu", (4, 257), F16),
    GluCase("none", (1, 1)),
]


def _glu_inputs(c: GluCase):
    if c.layout == "packed":
        # Two halves of one packed buffer (views of a tensor that needs no grad are leaves).
        base = randn((*c.shape[:-1], 2 * c.shape[-1]), c.dtype, scale=2.0)
        x = base[..., : c.shape[-1]].requires_grad_()
        u = base[..., c.shape[-1]:].requires_grad_()
        assert not x.is_contiguous() and x.stride(-2) == 2 * c.shape[-1]
        return x, u
    x = _layout(randn(c.shape, c.dtype, scale=2.0), c.layout).requires_grad_()
    u = _layout(randn(c.shape, c.dtype), c.layout).requires_grad_()
    return x, u


@pytest.mark.parametrize("case", GLU_CASES, ids=str)
def test_gated_act_tolerance(backend, case):
    x, u = _glu_inputs(case)
    y = gated_act(x, u, case.act)
    assert y.shape == x.shape and y.dtype == case.dtype
    g = randn(case.shape, case.dtype)
    got = (y, *torch.autograd.grad(y, [x, u], g))
    refs = {}
    for hi in (True, False):
        xc = (x.detach().to(F64) if hi else x.detach().clone()).requires_grad_()
        uc = (u.detach().to(F64) if hi else u.detach().clone()).requires_grad_()
        yr = act_ref(xc, case.act) * uc
        refs[hi] = (yr, *torch.autograd.grad(yr, [xc, uc], g.to(yr.dtype)))
    for name, a, rh, rl in zip(("y", "dx", "du"), got, refs[True], refs[False]):
        assert torch.isfinite(a).all(), f"{name} has non-finite values [{case}]"
        assert_close_tolerance(a, rh, rl, name=f"{name} [{case}]")


@pytest.mark.parametrize("prefetch", [False, True])
def test_bias_grad_multi_split(triton_backend, monkeypatch, prefetch):
    """Force the bias-grad kernel into several row splits, several loop steps and several column blocks."""
    monkeypatch.setitem(act_launch.TUNING, "dbias_block_m", 2)
    monkeypatch.setitem(act_launch.TUNING, "dbias_block_n", 16)
    monkeypatch.setitem(act_launch.TUNING, "dbias_prefetch", prefetch)
    x = randn((37, 40), F32, requires_grad=True)
    b = randn(40, F32, requires_grad=True)
    g = randn((37, 40))
    dx, db = torch.autograd.grad(bias_act(x, b, "gelu"), [x, b], g)
    xd, bd = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    rdx, rdb = torch.autograd.grad(act_ref(xd + bd, "gelu"), [xd, bd], g.double())
    assert_close_tolerance(dx, rdx, None, name="dx")
    assert_close_tolerance(db, rdb, None, atol=1e-5 * 37, name="dbias")


@pytest.mark.parametrize("shape,bias,prefetch", [((37, 45), "grad", False), ((37, 45), "grad", True),
                                                 ((5, 7, 9), None, False), ((11, 16), "const", False)])
def test_relu_bit_mask(triton_backend, monkeypatch, shape, bias, prefetch):
    """ReLU saves one bit per element (not x): exact gradients for any g layout, several dbias splits,
    and the derivative at exactly 0 (0 for relu, 1 for relu_ge0)."""
    monkeypatch.setitem(act_launch.TUNING, "dbias_block_m", 2)
    monkeypatch.setitem(act_launch.TUNING, "dbias_block_n", 16)
    monkeypatch.setitem(act_launch.TUNING, "dbias_prefetch", prefetch)
    N = shape[-1]
    b = randn(N, F32, scale=0.5).requires_grad_(bias == "grad") if bias else None
    x0 = randn(shape, F32, scale=2.0)
    x0.view(-1, N)[::3, 1] = 0.0 if b is None else -b.detach()[1]  # x + b == 0 exactly
    for act in ("relu", "relu_ge0"):
        x = x0.clone().requires_grad_()
        y = bias_act(x, b, act)
        (mask,) = y.grad_fn.saved_tensors
        rows = 1 if (b is None) else x.numel() // N  # no bias, contiguous: one flat row
        assert mask.dtype == torch.uint8 and mask.shape == (rows, -(-x.numel() // rows // 8))
        h = x0 + b.detach() if b is not None else x0
        on = (h >= 0) if act == "relu_ge0" else (h > 0)
        torch.testing.assert_close(y, torch.where(on, h, 0.0), rtol=0, atol=0)
        for g in (randn(shape), make_noncontiguous(randn(shape), pad=3), torch.ones(()).expand(shape)):
            leaves = [x] + ([b] if bias == "grad" else [])
            grads = torch.autograd.grad(y, leaves, g, retain_graph=True)
            ref_dx = torch.where(on, g, 0.0)
            torch.testing.assert_close(grads[0], ref_dx, rtol=0, atol=0)
            assert grads[0].is_contiguous()
            if bias == "grad":
                torch.testing.assert_close(grads[1], ref_dx.reshape(-1, N).sum(0), rtol=1e-6, atol=1e-5)


def test_flat_and_row_launches(triton_backend):
    """Contiguous input without bias runs as one flat row; a bias or padded rows give a 2-D launch."""
    x = randn((6, 50))
    seen = []
    for xi, b in ((x, None), (x, randn(50)), (make_noncontiguous(x), None)):
        plan = act_plan(xi, b, "silu")
        M, N, sx = plan.tail[:3]
        seen.append((M, N, plan.has_bias, sx))
        torch.testing.assert_close(bias_act(xi, b, "silu"), act_ref(xi + (b if b is not None else 0), "silu"))
    assert seen == [(1, 300, False, 0), (6, 50, True, 50), (6, 50, False, 53)]


def test_raw_ops_inplace_store_out_and_from_output(backend):
    x = randn((9, 70), BF16, scale=2.0)
    b = randn(70, F32)
    ref_y = act_fwd(x, b, "gelu")
    # In place: the result lives in x's storage.
    xi = x.clone()
    out = act_fwd(xi, b, "gelu", inplace=True)
    assert out.data_ptr() == xi.data_ptr() and torch.equal(out, ref_y)
    # Backward: dx into g, the bias grad and the recomputed act in one call.
    g = randn((9, 70), BF16)
    dx_ref, db_ref, none = act_bwd(g, x, b, "gelu", dbias_dtype=F32)
    assert none is None and db_ref.dtype == F32
    gi = g.clone()
    dx, db, y = act_bwd(gi, x, b, "gelu", dbias_dtype=F32, store_out=True, inplace=True)
    assert dx.data_ptr() == gi.data_ptr()
    assert torch.equal(dx, dx_ref) and torch.equal(db, db_ref) and torch.equal(y, ref_y)
    # Derivative through the output (what the MLPs save) equals the one through the input.
    for act in ("relu", "sigmoid", "none"):
        yo = act_fwd(x, None, act)
        d_out, _, _ = act_bwd(g, yo, None, act, from_output=True)
        d_in, _, _ = act_bwd(g, x, None, act)
        tol = 0.0 if act != "sigmoid" else 2e-2
        torch.testing.assert_close(d_out.float(), d_in.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="store_out"):
        act_bwd(g, x, None, "relu", from_output=True, store_out=True)
    # GLU raw pair agrees with the differentiable op.
    u = randn((9, 70), BF16)
    torch.testing.assert_close(glu_fwd(x, u, "silu"), gated_act(x, u, "silu"), rtol=0, atol=0)
    dx2, du2 = glu_bwd(g, x, u, "silu")
    assert dx2.shape == x.shape and du2.dtype == BF16


@pytest.mark.parametrize("act", [a for a in ACTIVATIONS if a != "relu_ge0"])
def test_closed_form_derivatives_match_autograd(act):
    x = randn(4001, F64, scale=3.0).requires_grad_()
    (auto,) = torch.autograd.grad(act_ref(x, act).sum(), x)
    torch.testing.assert_close(act_grad_ref(x.detach(), act), auto, rtol=1e-12, atol=1e-12)


def test_fp64_and_empty(backend):
    x = randn((4, 33), F64, requires_grad=True)
    b = randn(33, F64, requires_grad=True)
    y = bias_act(x, b, "gelu_tanh")
    torch.testing.assert_close(y, torch.nn.functional.gelu(x + b, approximate="tanh"), rtol=1e-12, atol=1e-12)
    e = torch.empty((0, 33), requires_grad=True)
    ye = bias_act(e, randn(33, requires_grad=True), "silu")
    assert ye.shape == (0, 33)
    ye.sum().backward()
    ue = torch.empty((0, 5), requires_grad=True)
    assert gated_act(ue, ue.detach().clone(), "silu").shape == (0, 5)


def test_bad_inputs_raise():
    x = randn((3, 8))
    with pytest.raises(ValueError, match="activation must be one of .*'gleu'"):
        bias_act(x, None, "gleu")
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\).*\(7,\)"):
        bias_act(x, randn(7), "gelu")
    with pytest.raises(TypeError, match="x must be float16/bfloat16/float32/float64, got torch.int64"):
        bias_act(torch.ones(3, 8, dtype=torch.int64), None, "relu")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        bias_act([1.0, 2.0], None, "relu")
    with pytest.raises(ValueError, match=r"u must have the shape of x \(3, 8\), got \(3, 9\)"):
        gated_act(x, randn((3, 9)), "silu")
    with pytest.raises(ValueError, match="activation must be one of .*'relu_ge0'"):
        gated_act(x, x, "relu_ge0")


def test_torch_compile_fullgraph(backend, compile_fusion):
    """Under torch.compile the ops are custom-op nodes (no graph break) with the eager results."""
    x = randn((5, 40), requires_grad=True)
    b = randn(40, requires_grad=True)
    u = randn((5, 40), requires_grad=True)

    def fn(x, b, u):
        return gated_act(bias_act(x, b, "gelu_tanh"), u, "silu")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    y = compiled(x, b, u)
    grads = torch.autograd.grad(y.square().sum(), [x, b, u])
    y_ref = fn(x, b, u)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x, b, u])
    torch.testing.assert_close(y, y_ref)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("order,shape", [("gate_up", (6, 2 * 40)), ("up_gate", (2, 3, 2 * 24))])
def test_gated_act_on_chunk_halves(backend, order, shape):
    """``gated_act(*h.chunk(2, -1))`` on a non-leaf ``h``: the kernels read the halves in place, and on the
    kernels the backward writes ``h``'s gradient as one buffer (no chunk backward, no concatenation)."""
    w = randn(shape, BF16, scale=2.0, requires_grad=True)
    h = w * 1.5  # a non-leaf, like a linear layer's output
    a, b = h.chunk(2, -1)
    x, u = (a, b) if order == "gate_up" else (b, a)
    y = gated_act(x, u, "silu")
    if backend == "triton":
        # The autograd node takes h itself: its only input edge is h's MulBackward.
        assert [f for f, _ in y.grad_fn.next_functions if f is not None] == [h.grad_fn]
    g = randn(y.shape, BF16)
    (dw,) = torch.autograd.grad(y, [w], g)
    wr = w.detach().double().requires_grad_()
    ar, br = (wr * 1.5).chunk(2, -1)
    xr, ur = (ar, br) if order == "gate_up" else (br, ar)
    yr = act_ref(xr, "silu") * ur
    (dwr,) = torch.autograd.grad(yr, [wr], g.double())
    wl = w.detach().clone().requires_grad_()
    al, bl = (wl * 1.5).chunk(2, -1)
    xl, ul = (al, bl) if order == "gate_up" else (bl, al)
    yl = act_ref(xl, "silu") * ul
    (dwl,) = torch.autograd.grad(yl, [wl], g)
    assert_close_tolerance(y, yr, yl, name="y")
    assert_close_tolerance(dw, dwr, dwl, name="dh")


def test_gated_act_chunk_halves_keep_their_autograd_state(triton_backend):
    """Halves with a hook or ``retain_grad`` take the ordinary path: the hook runs, ``.grad`` is kept."""
    w = randn((4, 32), F32, requires_grad=True)
    x, u = (w * 2.0).chunk(2, -1)
    seen = []
    x.register_hook(lambda gx: seen.append(gx.shape))
    u.retain_grad()
    y = gated_act(x, u, "silu")
    y.backward(torch.ones_like(y))
    assert seen == [(4, 16)] and u.grad is not None
    torch.testing.assert_close(u.grad, act_ref(x.detach(), "silu"))
    # Leaves that are views of a tensor needing no grad keep their own gradients too.
    base = randn((4, 32), F32)
    xl, ul = base[:, :16].requires_grad_(), base[:, 16:].requires_grad_()
    gx, gu = torch.autograd.grad(gated_act(xl, ul, "silu"), [xl, ul], torch.ones(4, 16))
    torch.testing.assert_close(gu, act_ref(xl.detach(), "silu"))


def test_opcheck(backend):
    """The traced ops' schemas and fake impls hold (torch.library.opcheck), including packed halves."""
    x = randn((5, 40), BF16, scale=2.0)
    b = randn(40, F32)
    g = randn((5, 40), BF16)
    base = randn((5, 80), BF16)
    checks = ("test_schema", "test_faketensor")
    ops = torch.ops.culmen
    torch.library.opcheck(ops.act_fwd.default, (x, b, "gelu_tanh"), test_utils=checks)
    torch.library.opcheck(ops.act_bwd.default, (g, x, b, "gelu", False, True, F32, True), test_utils=checks)
    torch.library.opcheck(ops.act_bwd.default, (g, x, None, "relu", True, False, BF16, False), test_utils=checks)
    torch.library.opcheck(ops.glu_fwd.default, (base[:, :40], base[:, 40:], "silu"), test_utils=checks)
    torch.library.opcheck(ops.glu_bwd.default, (g, base[:, :40], base[:, 40:], "gelu"), test_utils=checks)


def _glu_grad_case(case: str):
    """``gated_act(x, u)`` on two projections of ``w``; returns ``(w.grad, [x's storage == dx's storage per
    backward])``. ``hold``: the caller keeps ``x``; ``shared``: another node saves ``x`` too; ``retain``: two
    backwards through one graph; ``packed``: the halves of one projection."""
    torch.manual_seed(3)
    w = randn((6, 40), F32, requires_grad=True)
    g = randn((6, 40), F32)
    h = w * 1.5
    if case == "packed":
        x, u = torch.cat((h * 2.0, h * 3.0), -1).chunk(2, -1)
    else:
        x, u = h * 2.0, h * 3.0
    ptr, reused = x.data_ptr(), []
    watch = x if case != "packed" else x._base
    watch.register_hook(lambda gx: reused.append(gx.data_ptr() == ptr))
    loss = (gated_act(x, u, "silu") * g).sum()
    if case == "shared":
        loss = loss + (x * w).sum()  # MulBackward saves x as well
    held = x if case == "hold" else None
    del x, u, watch, h
    loss.backward(retain_graph=case == "retain")
    if case == "retain":
        loss.backward()
    assert held is None or held.data_ptr() == ptr
    return w.grad, reused


@pytest.mark.parametrize("case", ["free", "packed", "hold", "shared", "retain"])
def test_glu_backward_writes_into_free_saved_inputs(triton_backend, case):
    """The backward writes dx / du into x / u (and the packed gradient into the projection) exactly when nothing
    else can see them, and the gradients equal those of the fresh-buffer backward in every case."""
    grad, reused = _glu_grad_case(case)
    expected = {"free": [True], "packed": [True], "hold": [False], "shared": [False], "retain": [False, True]}
    assert reused == expected[case]
    from culmen.ops.common import function

    saved = function._FREE
    function._FREE = (-1, -1, -1)  # nothing is ever free: the fresh-buffer backward
    try:
        ref, fresh = _glu_grad_case(case)
    finally:
        function._FREE = saved
    assert not any(fresh)
    torch.testing.assert_close(grad, ref, rtol=0, atol=0)


def test_saved_memory_probe_runs_under_inference_mode(triton_backend, monkeypatch):
    """The counts are measured when the first plan that can reuse memory is built, whatever the caller's mode
    (here inference_mode, where a backward cannot be recorded): later training calls still reuse."""
    from culmen.ops.common import function

    monkeypatch.setattr(function, "_FREE", None)
    with torch.inference_mode():
        gated_act(randn((3, 56)), randn((3, 56)), "silu")  # a new signature: the plan (and the probe) is built here
    assert function._FREE is not None and function._FREE[0] > 0
    assert _glu_grad_case("free")[1] == [True]
