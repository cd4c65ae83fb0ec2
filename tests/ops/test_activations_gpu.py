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
from culmen.testing import assert_close_tolerance, make_noncontiguous, poisoned_allocations, randn

pytestmark = pytest.mark.gpu

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def poisoned(request):
    # Compiled graphs would trace the poisoning (empty + fill_), which Inductor rejects as an in-place op
    # on a graph intermediate: the torch.compile tests compare against eager instead.
    if request.node.name.startswith("test_torch_compile"):
        yield
        return
    with poisoned_allocations():
        yield


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
    """Without launch hooks a plan's launch binds to the compiled kernel and skips Triton's hook
    protocol; a hook (a profiler) installed later is honoured once the plans are dropped (``clear_plans``,
    which every switch setter also runs): a launch never binds while hooks are installed."""
    from triton import knobs

    from culmen.ops.common.plans import clear_plans

    x = randn((512, 1024), BF16, DEV)
    b = randn(1024, BF16, DEV)
    bias_act(x, b, "gelu_tanh")
    bias_act(x, b, "gelu_tanh")  # compiled, cached and bound
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        clear_plans()
        bias_act(x, b, "gelu_tanh")
        y = bias_act(x, b, "gelu_tanh")
        torch.cuda.synchronize()
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 2
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


# --------------------------------------------------------------------- the call path (issue 13)


@pytest.fixture
def fresh_plans():
    """No cached plans before and after (what an earlier test cached cannot leak into this one)."""
    from culmen.ops.common.plans import clear_plans

    clear_plans()
    yield
    clear_plans()


@pytest.fixture
def launched(monkeypatch):
    """The ids of the ``Launch`` objects called (plans may hold launches a call path never uses)."""
    from culmen.ops.common.launch import Launch

    ids = set()
    real = Launch.__call__

    def call(self, *args):
        ids.add(id(self))
        return real(self, *args)

    monkeypatch.setattr(Launch, "__call__", call)
    return ids


def _all_launches(called):
    """Every ``Launch`` of every cached activation plan (the dense compositions' included) that ran."""
    from culmen.ops.activations.dense import DENSE_PLANS

    out = []

    def bwd(b):
        out.append(b.main)
        if b.dbias is not None and b.dbias.final is not None:
            out.append(b.dbias.final)

    def act(p):
        if not p.use_kernel:
            return
        out.append(p.fwd)
        if p._mask is not None:
            out.append(p._mask[0])
        for la, _, d in p._mask_bwd.values():
            out.append(la)
            if d is not None and d.final is not None:
                out.append(d.final)
        for b in p._bwd.values():
            bwd(b)

    for p in act_launch.ACT_PLANS.values():
        act(p)
    for b in act_launch.ACT_BWD_PLANS.values():
        if b.use_kernel:
            bwd(b)
    for p in act_launch.GLU_PLANS.values():
        if p.use_kernel:
            out += [p.fwd, p.bwd]
            for f, _, b, _ in p._packed.values():
                out += [f, b]
    for d in DENSE_PLANS.values():
        for p in d.fwd.values():
            act(p)
        for b in d.bwd.values():
            bwd(b)
    return [la for la in out if id(la) in called]


def _call_path_cases():
    """Inputs of every eager path of the family: separate and packed SwiGLU, GELU with a multi-split bias
    gradient, ReLU's bit mask with its bias gradient, the raw backward with recompute, flash_attn's
    FusedMLP and Apex's MLP."""
    torch.manual_seed(3)
    M, N = 4099, 1000
    from culmen.flash_attn.ops.fused_dense import FusedMLP
    from culmen.mlp import MLP

    return {
        "x": randn((M, N), BF16, DEV, scale=2.0, requires_grad=True),
        "u": randn((M, N), BF16, DEV, requires_grad=True),
        "w": randn((M, 2 * N), BF16, DEV, scale=2.0, requires_grad=True),
        "b": randn(N, BF16, DEV, requires_grad=True),
        "g": randn((M, N), BF16, DEV),
        "fused_mlp": FusedMLP(512, 1024, dtype=BF16, device=DEV),
        "mlp": MLP([512, 1024, 256], activation="sigmoid").to(DEV, BF16),
        "h": randn((1000, 512), BF16, DEV, requires_grad=True),
    }


def _run_call_path(c):
    from culmen.ops.activations import act_bwd

    x, u, w, b, g, h = c["x"], c["u"], c["w"], c["b"], c["g"], c["h"]
    out = []
    y = gated_act(x, u, "silu")
    out += [y, *torch.autograd.grad(y, [x, u], g)]
    hw = w * 1.0  # a non-leaf: its halves take the packed path
    y = gated_act(*hw.chunk(2, -1), "silu")
    out += [y, *torch.autograd.grad(y, [w], g)]
    y = bias_act(x, b, "gelu_tanh")
    out += [y, *torch.autograd.grad(y, [x, b], g)]
    y = bias_act(x, b, "relu")
    out += [y, *torch.autograd.grad(y, [x, b], g)]
    for act in ("relu", "sqrelu"):  # no bias: the plain backward kernels
        y = bias_act(x, None, act)
        out += [y, *torch.autograd.grad(y, [x], g)]
    out += [t for t in act_bwd(g, x.detach(), None, "gelu", dbias_dtype=F32, store_out=True) if t is not None]
    for m in (c["fused_mlp"], c["mlp"]):
        y = m(h)
        out += [y, *torch.autograd.grad(y.float().square().sum(), [h, *m.parameters()])]
    return out


def test_fast_launch_bitwise(fresh_plans, launched):
    """The direct launch path (second call of a plan) gives what Triton's own launch gives, and every
    plan's launches took it."""
    from culmen.ops.common.launch import set_fast_launch

    c = _call_path_cases()
    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)
            launched.clear()
            results[mode] = [_run_call_path(c) for _ in range(2)][-1]
            launches = _all_launches(launched)
            assert len(launches) >= 10
            for la in launches:
                if mode:
                    assert la._run is not None, f"{la.fn.fn.__name__} never took the direct path: {la.error}"
                else:
                    assert la._run is None
    finally:
        set_fast_launch(True)
    assert len(results[False]) == len(results[True])
    for i, (a, b) in enumerate(zip(results[False], results[True])):
        assert torch.equal(a, b), f"result {i} differs between Triton's launch and the direct one"


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor(dynamic):
    """Under torch.compile (Inductor, fullgraph) the activation kernels are traced (triton_op +
    wrap_triton): results and gradients equal eager's, and with dynamic shapes new row counts do not
    recompile. Covers bias_act (its compiled backward with the bias gradient), gated_act on packed
    halves, the raw ops inside flash_attn's FusedMLP and Apex's MLP."""
    from culmen.flash_attn.ops.fused_dense import FusedMLP
    from culmen.mlp import MLP

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fm = FusedMLP(256, 1024, activation="gelu_approx", dtype=BF16, device=DEV)
    am = MLP([256, 512, 256], activation="relu").to(DEV, BF16)
    b = randn(512, BF16, DEV, requires_grad=True)

    def fn(x, w2):
        # Separate outputs: each op's result is compared, not a chain that amplifies bf16 rounding.
        return bias_act(w2, b, "gelu"), gated_act(*w2.chunk(2, -1), "silu"), fm(x), am(x)

    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    params = [b, *fm.parameters(), *am.parameters()]
    for M in (64, 77, 130):
        x = randn((M, 256), BF16, DEV, requires_grad=True)
        w2 = randn((M, 512), BF16, DEV, scale=2.0, requires_grad=True)
        outs = []
        for f in (fn, compiled):
            ys = f(x, w2)
            loss = sum(y.float().square().sum() for y in ys)
            outs.append((*ys, *torch.autograd.grad(loss, [x, w2, *params])))
        for i, (e, c) in enumerate(zip(*outs)):
            assert c.dtype == e.dtype and c.shape == e.shape
            # bf16 results, some summed from two paths (w2's gradient): a tolerance on the tensor's scale.
            atol = 2e-2 * max(1.0, e.float().abs().max().item())
            torch.testing.assert_close(c, e, rtol=3e-2, atol=atol, msg=lambda m, i=i, M=M: f"result {i}, M={M}: {m}")
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1


@pytest.mark.parametrize("hold", [False, True])
def test_glu_backward_reuses_free_projections_on_cuda(hold):
    """On CUDA tensors (counts calibrated on a CPU probe) the backward writes dx into the gate projection
    exactly when nothing else holds it, with the fresh-buffer backward's gradients, and it lowers the peak."""
    from culmen.ops.common import function

    def run():
        torch.manual_seed(5)
        w = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16)
        x, u = w * 1.5, w * 0.5
        ptr, seen = x.data_ptr(), []
        x.register_hook(lambda gx: seen.append(gx.data_ptr() == ptr))
        y = gated_act(x, u, "silu")
        held = x if hold else None
        del x, u
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        y.backward(g)
        torch.cuda.synchronize()
        assert held is None or held.data_ptr() == ptr
        return w.grad, seen, torch.cuda.max_memory_allocated() - start

    grad, seen, peak = run()
    assert seen == [not hold]
    saved = function._FREE
    function._FREE = (-1, -1, -1)
    try:
        ref, fresh, peak_fresh = run()
    finally:
        function._FREE = saved
    assert fresh == [False]
    torch.testing.assert_close(grad, ref, rtol=0, atol=0)
    if not hold:
        assert peak <= peak_fresh - 4096 * 1024 * 2  # at least one (4096, 1024) bf16 buffer less at the peak
