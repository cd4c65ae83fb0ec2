"""Activations and the fused dense / MLP compositions on a real GPU at real sizes (``scripts/gpu-check``).

Same tolerance rule as the CPU tests: error against a float64 oracle (computed on the GPU) at most 2x
PyTorch's own error in the input dtype, plus a small atol, for the output and every gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from culmen.ops.activations import act_ref, bias_act, gated_act
from culmen.ops.activations import launch as act_launch
from culmen.testing import assert_close_tolerance, make_noncontiguous, poison_, randn

pytestmark = pytest.mark.gpu

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    real = act_launch._empty
    monkeypatch.setattr(act_launch, "_empty", lambda shape, device, dtype: poison_(real(shape, device, dtype)))


def _free():
    torch.cuda.empty_cache()


def _check(got, refs, label):
    for i, (a, rh, rl) in enumerate(zip(got, refs[True], refs[False])):
        assert torch.isfinite(a).all(), f"{label} output {i} has non-finite values"
        assert_close_tolerance(a, rh, rl, name=f"{label} output {i}")


@pytest.mark.parametrize("act,shape,dtype,bias,layout", [
    ("gelu_tanh", (8192, 16384), BF16, BF16, ""),
    ("gelu", (4099, 5003), F16, F32, ""),
    ("silu", (16384, 4096), BF16, None, ""),
    ("sqrelu", (3, 4097, 1000), F32, F32, ""),
    ("relu", (8192, 4096), BF16, None, "pad"),
    ("relu", (4099, 5003), F16, F32, ""),  # bit mask + bias grad, rows not a multiple of 8
    ("relu", (2049, 4097), BF16, None, ""),  # bit mask, one flat row of an odd element count
    ("sigmoid", (4099, 5003), F16, F16, "pad"),
    ("none", (1000, 4096), BF16, BF16, ""),
])
def test_bias_act_real_sizes(act, shape, dtype, bias, layout):
    N = shape[-1]
    x = randn(shape, dtype, DEV, scale=2.0)
    if layout == "pad":
        x = make_noncontiguous(x, pad=8)
    x.requires_grad_()
    b = randn(N, bias, DEV, scale=0.5).requires_grad_() if bias is not None else None
    leaves = [x] + ([b] if b is not None else [])
    y = bias_act(x, b, act)
    g = randn(shape, dtype, DEV)
    got = (y, *torch.autograd.grad(y, leaves, g))
    refs = {}
    for hi in (True, False):
        cp = [t.detach().to(F64 if hi else t.dtype).requires_grad_() for t in leaves]
        yr = act_ref(cp[0] + cp[1] if b is not None else cp[0], act)
        refs[hi] = (yr, *torch.autograd.grad(yr, cp, g.to(yr.dtype)))
    _check(got, refs, f"{act} {shape} {dtype}")
    del refs, got
    _free()


@pytest.mark.parametrize("act,shape,dtype,packed", [
    ("silu", (8192, 11008), BF16, True),
    ("gelu_tanh", (4096, 14336), BF16, False),
    ("gelu", (4099, 5003), F16, False),
    ("silu", (2, 4097, 1000), F32, False),
])
def test_gated_act_real_sizes(act, shape, dtype, packed):
    if packed:
        base = randn((*shape[:-1], 2 * shape[-1]), dtype, DEV, scale=2.0)
        x, u = base[..., :shape[-1]].requires_grad_(), base[..., shape[-1]:].requires_grad_()
    else:
        x = randn(shape, dtype, DEV, scale=2.0, requires_grad=True)
        u = randn(shape, dtype, DEV, requires_grad=True)
    y = gated_act(x, u, act)
    g = randn(shape, dtype, DEV)
    got = (y, *torch.autograd.grad(y, [x, u], g))
    refs = {}
    for hi in (True, False):
        xc, uc = (t.detach().to(F64 if hi else dtype).requires_grad_() for t in (x, u))
        yr = act_ref(xc, act) * uc
        refs[hi] = (yr, *torch.autograd.grad(yr, [xc, uc], g.to(yr.dtype)))
    _check(got, refs, f"glu {act} {shape} {dtype}")
    del refs, got
    _free()


@pytest.mark.parametrize("act,bias", [("gelu_tanh", True), ("relu", True), ("relu", False), ("silu", None)])
def test_repeated_and_misaligned_calls(act, bias):
    """Cached launch plans: a repeated call reuses the compiled kernel; a misaligned view of the same
    shape and strides (same plan) must take the checked launch path and still be right."""
    M, N = 1000, 4096
    base = randn(M * N + 1, BF16, DEV, scale=2.0)
    gbase = randn(M * N + 1, BF16, DEV)
    b = randn(N, BF16, DEV, scale=0.5).requires_grad_() if bias else None
    for off in (0, 0, 1):  # aligned twice, then 2 bytes off
        x = base[off:off + M * N].view(M, N).detach().requires_grad_()
        g = gbase[off:off + M * N].view(M, N)
        if bias is None:
            u = randn((M, N), BF16, DEV, requires_grad=True)
            y = gated_act(x, u, act)
            leaves, cp_fn = [x, u], (lambda t: act_ref(t[0], act) * t[1])
        else:
            y = bias_act(x, b, act)
            leaves = [x] + ([b] if b is not None else [])
            cp_fn = (lambda t: act_ref(t[0] + t[1], act)) if b is not None else (lambda t: act_ref(t[0], act))
        got = (y, *torch.autograd.grad(y, leaves, g))
        refs = {}
        for hi in (True, False):
            cp = [t.detach().to(F64 if hi else t.dtype).requires_grad_() for t in leaves]
            yr = cp_fn(cp)
            refs[hi] = (yr, *torch.autograd.grad(yr, cp, g.to(yr.dtype)))
        _check(got, refs, f"{act} bias={bias} offset={off}")


def test_launch_hooks_are_honoured():
    """Without launch hooks the cached launch skips Triton's hook protocol; once a hook (a profiler) is
    installed every launch must call it again."""
    from triton import knobs

    x = randn((512, 1024), BF16, DEV)
    b = randn(1024, BF16, DEV)
    bias_act(x, b, "gelu_tanh")  # compile and cache the plan
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        y = bias_act(x, b, "gelu_tanh")
        torch.cuda.synchronize()
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 1
    torch.testing.assert_close(y, F.gelu(x.float() + b.float(), approximate="tanh").to(BF16), rtol=1.6e-2, atol=1e-2)


def test_bias_grad_over_many_rows():
    x = randn((65536, 1024), BF16, DEV, scale=2.0, requires_grad=True)
    b = randn(1024, BF16, DEV, requires_grad=True)
    g = randn(x.shape, BF16, DEV)
    (db,) = torch.autograd.grad(bias_act(x, b, "gelu"), [b], g)
    refs = {}
    for hi in (True, False):
        xc, bc = (t.detach().to(F64 if hi else BF16).requires_grad_() for t in (x, b))
        refs[hi] = torch.autograd.grad(F.gelu(xc + bc), [bc], g.to(xc.dtype))[0]
    assert_close_tolerance(db, refs[True], refs[False], name="dbias 65536 rows")


def test_more_than_2_31_elements():
    """int64 offsets: a flat launch and a 2-D (bias) launch over 2^31 + 163842 elements."""
    M, N = 65537, 32770
    assert M * N > 2**31
    x = randn((M, N), BF16, DEV)
    b = randn(N, BF16, DEV)
    tail = x[-2:].float()
    y = bias_act(x, None, "relu")
    torch.testing.assert_close(y[-2:].float(), F.relu(tail), rtol=0, atol=0)
    del y
    _free()
    y = bias_act(x, b, "silu")
    torch.testing.assert_close(y[-2:].float(), F.silu(tail + b.float()).to(BF16).float(), rtol=1.6e-2, atol=1e-2)
    del y
    _free()
    xg = x.requires_grad_()
    bg = b.clone().requires_grad_()
    g = torch.ones_like(x)
    dx, db = torch.autograd.grad(bias_act(xg, bg, "relu"), [xg, bg], g)
    torch.testing.assert_close(dx[-2:].float(), (tail + b.float() > 0).float(), rtol=0, atol=0)
    ref_db = (x.float() + b.float() > 0).sum(0, dtype=torch.float32)
    torch.testing.assert_close(db.float(), ref_db.to(BF16).float(), rtol=1e-2, atol=1.0)
    del x, xg, dx, g
    _free()


# ------------------------------------------------------------------------------- dense / MLPs


TOKENS, D, H = 8192, 1024, 4096
_ACTS = {"gelu_approx": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu, "relu": F.relu,
         "sqrelu": lambda t: torch.square(F.relu(t)), "sigmoid": torch.sigmoid, "none": lambda t: t}


def _two_layer_params(dtype, d=D, h=H, out=D):
    w1 = (randn((h, d), dtype, DEV) / d**0.5).requires_grad_()
    b1 = randn(h, dtype, DEV, scale=0.1).requires_grad_()
    w2 = (randn((out, h), dtype, DEV) / h**0.5).requires_grad_()
    b2 = randn(out, dtype, DEV, scale=0.1).requires_grad_()
    return [w1, b1, w2, b2]


def _chain_refs(x, params, g, act_fn, act_on_last=False):
    refs = {}
    for hi in (True, False):
        cp = [t.detach().to(F64 if hi else t.dtype).requires_grad_() for t in (x, *params)]
        h = cp[0]
        n = len(params) // 2
        for i in range(n):
            h = F.linear(h, cp[1 + 2 * i], cp[2 + 2 * i])
            if act_on_last or i < n - 1:
                h = act_fn(h)
        refs[hi] = (h, *torch.autograd.grad(h, cp, g.to(h.dtype)))
    return refs


@pytest.mark.parametrize("act,lvl", [("gelu_approx", 0), ("gelu_approx", 1), ("gelu_approx", 2), ("relu", 0),
                                     ("sqrelu", 1)])
def test_fused_mlp_real_sizes(act, lvl):
    from culmen.flash_attn.ops.fused_dense import fused_mlp_func

    x = randn((TOKENS, D), BF16, DEV, requires_grad=True)
    w1, b1, w2, b2 = params = _two_layer_params(BF16)
    y = fused_mlp_func(x, w1, w2, b1, b2, activation=act, checkpoint_lvl=lvl)
    g = randn(y.shape, BF16, DEV)
    got = (y, *torch.autograd.grad(y, [x, *params], g))
    _check(got, _chain_refs(x, params, g, _ACTS[act]), f"FusedMLP {act} lvl={lvl}")
    _free()


def test_fused_dense_gelu_dense_real_sizes():
    from culmen.fused_dense import fused_dense_gelu_dense_function

    x = randn((TOKENS, D), BF16, DEV, requires_grad=True)
    params = _two_layer_params(BF16)
    y = fused_dense_gelu_dense_function(x, *params)
    g = randn(y.shape, BF16, DEV)
    got = (y, *torch.autograd.grad(y, [x, *params], g))
    _check(got, _chain_refs(x, params, g, F.gelu), "FusedDenseGeluDense")
    _free()


@pytest.mark.parametrize("act,dtype", [("relu", BF16), ("sigmoid", BF16), ("none", F16), ("relu", F32)])
def test_apex_mlp_real_sizes(act, dtype, monkeypatch):
    from culmen.mlp import MLP

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 GEMMs as in Apex's test
    m = MLP([D, H, H, D], activation=act).to(DEV, dtype)
    x = randn((TOKENS, D), dtype, DEV, requires_grad=True)
    y = m(x)
    g = randn(y.shape, dtype, DEV)
    params = [p for pair in zip(m.weights, m.biases) for p in pair]
    got = (y, *torch.autograd.grad(y, [x, *params], g))
    _check(got, _chain_refs(x, params, g, _ACTS[act], act_on_last=True), f"MLP {act} {dtype}")
    _free()


def test_torch_compile_inductor_fullgraph():
    from culmen.flash_attn.ops.fused_dense import FusedMLP

    m = FusedMLP(256, 1024, activation="gelu_approx", dtype=BF16, device=DEV)
    x = randn((512, 256), BF16, DEV, requires_grad=True)
    u = randn((512, 256), BF16, DEV, requires_grad=True)

    def fn(x, u):
        return gated_act(m(x), u, "silu")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    y = compiled(x, u)
    got = torch.autograd.grad(y.float().square().sum(), [x, u, *m.parameters()])
    y_ref = fn(x, u)
    ref = torch.autograd.grad(y_ref.float().square().sum(), [x, u, *m.parameters()])
    torch.testing.assert_close(y, y_ref, rtol=1.6e-2, atol=1e-2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
