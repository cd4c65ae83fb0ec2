"""Cross-entropy and fused linear + cross-entropy on a real GPU at real sizes (run by ``scripts/gpu-check``).

Same tolerance rule as the CPU tests (float64 oracle computed on the GPU; baseline: PyTorch's fp32-upcast
cross-entropy, and for the fused linear loss the unfused computation in the inputs' dtype), plus the
issue's memory goals: cross-entropy fwd+bwd at 8192 x 128256 bf16 within a quarter of PyTorch's
fp32-upcast peak, fused linear + cross-entropy at T=8192, H=4096, V=128256 within Liger's 1.38 GB; and the
call path's: the direct launches give Triton's own launch's bits, torch.compile (Inductor) traces the
kernels and does not recompile for new row counts with dynamic shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from culmen.flash_attn.losses.cross_entropy import CrossEntropyLoss
from culmen.ops.cross_entropy import (
    cross_entropy,
    cross_entropy_ref,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
)
from culmen.ops.cross_entropy import launch as ce_launch
from culmen.ops.cross_entropy.fused_linear import TUNING as FLCE_TUNING
from culmen.ops.cross_entropy.fused_linear_plan import PLANS as FLCE_PLANS
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

pytestmark = pytest.mark.gpu

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DEV = torch.device("cuda")
# Liger-Kernel 0.8.5's fused linear CE at T=8192, H=4096, V=128256 bf16, measured on the lent H100 in the
# same process as culmen (2026-11-22: 1.1835 GB; the issue quotes 1.38 GB from another setup).
LIGER_FLCE_PEAK_BYTES = 1.1835e9


def _peak_extra(fn) -> tuple[int, object]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, out


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    torch.cuda.empty_cache()


CE_CASES = [
    # (N, V, dtype, smoothing, zloss, logit_scale, softcap, logit std, noncontig)
    (4096, 128256, BF16, 0.0, 0.0, 1.0, 0.0, 3.0, False),
    (2048, 128256, BF16, 0.1, 1e-4, 1.0, 0.0, 3.0, False),
    (1024, 256000, BF16, 0.0, 1e-4, 1.0, 0.0, 10.0, False),  # large logits, 256k vocab
    (16, 256000, BF16, 0.1, 0.0, 1.0, 0.0, 3.0, False),  # few rows: split-vocab forward
    (300, 100003, BF16, 0.0, 0.0, 1.0, 0.0, 3.0, False),  # odd vocab > 65536
    (777, 4099, F32, 0.2, 1e-3, 0.5, 0.0, 3.0, False),
    (512, 1000, F16, 0.0, 0.0, 1.0, 30.0, 8.0, False),
    (1000, 32003, BF16, 0.1, 0.0, 1.0, 0.0, 3.0, True),
]


@pytest.mark.parametrize("n,v,dtype,smoothing,zloss,scale,softcap,std,noncontig", CE_CASES)
def test_cross_entropy_tolerance(n, v, dtype, smoothing, zloss, scale, softcap, std, noncontig):
    x = randn((n, v), dtype, DEV, std)
    if noncontig:
        x = make_noncontiguous(x, pad=8)
    x.requires_grad_()
    y = torch.randint(0, v, (n,), device=DEV)
    y[::7] = -100
    kw = dict(label_smoothing=smoothing, lse_square_scale=zloss, logit_scale=scale, softcap=softcap)
    out = cross_entropy(x, y, **kw)
    dy = torch.rand(n, device=DEV) + 0.5
    (out.loss * dy).sum().backward()
    x64 = x.detach().double().requires_grad_()
    hi = cross_entropy_ref(x64, y, **kw)
    (hi[0] * dy.double()).sum().backward()
    x32 = x.detach().float().requires_grad_()
    lo = cross_entropy_ref(x32, y, **kw)
    (lo[0] * dy).sum().backward()
    for i, name in enumerate(("loss", "z_loss", "lse")):
        assert_close_tolerance(out[i], hi[i], lo[i], name=name)
    assert_close_tolerance(x.grad, x64.grad, x32.grad.to(dtype), name="dlogits")
    assert bool((x.grad[y == -100] == 0).all())


def test_cross_entropy_inplace_and_precomputed_lse():
    n, v = 2048, 128256
    base = randn((n, v), BF16, DEV, 3.0, requires_grad=True)
    y = torch.randint(0, v, (n,), device=DEV)
    lse = torch.logsumexp(base.detach().float(), -1)
    logits = base * 1.0  # a non-leaf, as an lm_head output: its gradient is written in place
    loss, _ = CrossEntropyLoss(inplace_backward=True, return_z_loss=True)(logits, y, precomputed_lse=lse)
    loss.backward()
    x64 = base.detach().double().requires_grad_()
    ref = cross_entropy_ref(x64, y)[0].mean()
    ref.backward()
    assert torch.allclose(loss.double(), ref, atol=1e-4)
    assert_close_tolerance(base.grad, x64.grad, x64.grad.float().to(BF16), name="dlogits")


def test_cross_entropy_memory_vs_torch():
    """The issue's goal: peak extra memory of fwd+bwd at most a quarter of PyTorch's fp32-upcast one."""
    n, v = 8192, 128256
    x = randn((n, v), BF16, DEV, 2.0, requires_grad=True)
    y = torch.randint(0, v, (n,), device=DEV)

    def ours():
        CrossEntropyLoss()(x, y).backward()

    def torch_upcast():
        F.cross_entropy(x.float(), y).backward()

    ours()  # warm-up (compilation, allocator)
    # Gradients are dropped before each measurement so the baseline holds the inputs only.
    x.grad = None
    mine, _ = _peak_extra(ours)
    x.grad = None
    theirs, _ = _peak_extra(torch_upcast)
    assert mine <= theirs / 4, f"culmen {mine / 1e9:.2f} GB vs torch {theirs / 1e9:.2f} GB"


def test_invalid_label_on_gpu():
    """GPU labels are not read by the host unless the value-checking switch is on: a bad label gives a NaN
    row (and a NaN mean), memory-safely; with ``set_check_values(True)`` it raises."""
    from culmen.ops.backend import set_check_values

    x = randn((4, 1000), F32, DEV)
    y = torch.tensor([1, 1000, -100, 5], device=DEV)
    loss = cross_entropy(x, y).loss
    assert torch.isnan(loss[1]) and bool(torch.isfinite(loss[[0, 2, 3]]).all())
    assert torch.isnan(cross_entropy(x, y, reduction="mean").loss)
    set_check_values(True)
    try:
        with pytest.raises(ValueError, match=r"labels must be in \[0, 1000\)"):
            cross_entropy(x, y)
        with pytest.raises(ValueError, match=r"labels must be in \[0, 1000\)"):
            fused_linear_cross_entropy(randn((4, 16), F32, DEV), randn((1000, 16), F32, DEV), y)
    finally:
        set_check_values(False)


FLCE_CASES = [
    # (T, H, V, dtype, bias, reduction, smoothing, zloss, softcap, chunk, accum32)
    (2048, 1024, 32000, BF16, False, "mean", 0.0, 0.0, None, 256, False),
    (2048, 4096, 128256, BF16, False, "mean", 0.0, 1e-4, None, None, False),
    (2048, 4096, 128256, BF16, False, "mean", 0.0, 0.0, None, None, True),
    (1024, 2048, 50257, F16, True, "none", 0.1, 1e-4, 30.0, 200, False),
    (512, 1024, 32003, F32, True, "sum", 0.1, 0.0, None, 128, False),
]


@pytest.mark.parametrize("t,h,v,dtype,bias,reduction,smoothing,zloss,softcap,chunk,accum32", FLCE_CASES)
def test_fused_linear_tolerance(t, h, v, dtype, bias, reduction, smoothing, zloss, softcap, chunk, accum32):
    hid = randn((t, h), dtype, DEV, requires_grad=True)
    w = randn((v, h), dtype, DEV, 2.0 * h ** -0.5, requires_grad=True)
    b = randn((v,), dtype, DEV, 0.5, requires_grad=True) if bias else None
    y = torch.randint(0, v, (t,), device=DEV)
    y[::9] = -100
    kw = dict(label_smoothing=smoothing, lse_square_scale=zloss, softcap=softcap, reduction=reduction)
    loss, zl = fused_linear_cross_entropy(hid, w, y, b, return_z_loss=True, chunk_size=chunk,
                                          accum_dtype=F32 if accum32 else None, **kw)
    g = torch.rand(loss.shape, device=DEV) + 0.5
    (loss * g).sum().backward()
    ins = [t_ for t_ in (hid, w, b) if t_ is not None]
    res = {}
    for name, dt in (("hi", F64), ("lo", dtype)):
        cp = [t_.detach().to(dt).requires_grad_() for t_ in ins]
        rl, rz = fused_linear_cross_entropy_ref(cp[0], cp[1], y, cp[2] if bias else None, **kw)
        (rl * g.to(rl.dtype)).sum().backward()
        res[name] = (rl.detach(), rz, [c.grad for c in cp])
        del cp
    assert_close_tolerance(loss, res["hi"][0], res["lo"][0], name="loss")
    assert_close_tolerance(zl, res["hi"][1], res["lo"][1], name="z_loss")
    for t_, gh, gl, name in zip(ins, res["hi"][2], res["lo"][2], ("dhidden", "dweight", "dbias")):
        assert_close_tolerance(t_.grad, gh, gl, name=name)


def test_fused_linear_memory_goal():
    """The issue's goal: peak extra memory of fwd+bwd at T=8192, H=4096, V=128256 bf16 <= Liger's."""
    t, h, v = 8192, 4096, 128256
    hid = randn((t, h), BF16, DEV, requires_grad=True)
    w = randn((v, h), BF16, DEV, h ** -0.5, requires_grad=True)
    y = torch.randint(0, v, (t,), device=DEV)
    torch.mm(hid[:64].detach(), w[:64].detach().t())  # cuBLAS workspace allocated before measuring

    def run():
        loss = fused_linear_cross_entropy(hid, w, y)
        loss.backward()
        return loss.detach()

    run()
    hid.grad = w.grad = None  # the baseline holds the inputs only; the new gradients count as extra
    peak, loss = _peak_extra(run)
    assert peak <= LIGER_FLCE_PEAK_BYTES, f"peak extra memory {peak / 1e9:.3f} GB"
    with torch.no_grad():
        ref = F.cross_entropy((hid[:1024] @ w.t()).float(), y[:1024])
        mine = fused_linear_cross_entropy(hid[:1024], w, y[:1024])
    assert torch.isfinite(loss) and abs(mine.item() - ref.item()) < 1e-3 * max(1.0, abs(ref.item()))


def test_fused_linear_large_logits_256k_vocab(monkeypatch):
    """Numerically safe at vocab 256k with logits up to ~150 (exp overflows fp32 beyond ~88 without the
    running max). fp32 inputs (TF32 off), so the oracle's logits equal the op's up to fp32 rounding."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    t, h, v = 256, 1024, 256000
    hid = randn((t, h), F32, DEV, 1.0, requires_grad=True)
    w = randn((v, h), F32, DEV, 30.0 * h ** -0.5, requires_grad=True)
    y = torch.randint(0, v, (t,), device=DEV)
    loss = fused_linear_cross_entropy(hid, w, y, chunk_size=64, lse_square_scale=1e-4)
    loss.backward()
    cp = [hid.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    ref, _ = fused_linear_cross_entropy_ref(cp[0], cp[1], y, lse_square_scale=1e-4)
    ref.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 1e-4 * abs(ref.item())
    for got, want in ((hid.grad, cp[0].grad), (w.grad, cp[1].grad)):
        assert bool(torch.isfinite(got).all())
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 1e-3, f"relative gradient error {rel:.3g}"


# ------------------------------------------------------------------------------ call path


@pytest.fixture
def fresh_plans():
    """No cached plans before and after (what an earlier test cached cannot leak into this one)."""
    from culmen.ops.common.plans import clear_plans

    clear_plans()
    yield
    clear_plans()


def _used_launches():
    """Every ``Launch`` of every cached plan of the family that its calls use (each plan of the tests below
    runs forward and backward)."""
    out = []
    for p in ce_launch.PLANS.values():
        if p.use_kernel:
            out += [p.fwd, p.bwd] + [getattr(p, k) for k in ("combine", "red") if hasattr(p, k)]
    for p in FLCE_PLANS.values():
        if not p.use_kernel:
            continue
        if p.reduce:
            out += [p.count_la, p.finish_la] + [la for la, need in zip(p.scale_la, (p.need_h, p.need_w, p.need_b))
                                                if need]
        for sg in p._schedules.values():
            out += list(sg.chunk_la.values()) + [la for *_, la in sg.slices if la is not None]
            if sg.head_stats is not None:
                out += [sg.head_stats.stats, sg.head_stats.combine]
            if sg.head_grad is not None:
                out.append(sg.head_grad)
    return out


def _ce_calls(x, y, inplace_src):
    """Per-row (split-vocab forward: 16 rows of a large vocab), mean with smoothing, in place: values and
    gradients."""
    out = []
    rows = cross_entropy(x[:16], y[:16], lse_square_scale=1e-4, softcap=30.0)
    out += [*rows, *torch.autograd.grad((rows.loss * 0.5).sum(), x)]
    mean = cross_entropy(x, y, label_smoothing=0.1, reduction="mean")
    out += [*mean, *torch.autograd.grad(mean.loss * 3.0, x)]
    logits = inplace_src.detach().clone().requires_grad_()
    z = logits * 1.0
    loss = cross_entropy(z, y, inplace_backward=True, reduction="sum").loss
    out += [loss, *torch.autograd.grad(loss, logits)]
    return out


def _flce_calls(hid, w, y):
    out = []
    for reduction, scale in (("mean", 1.0), ("mean", 2.5), ("none", None)):
        loss = fused_linear_cross_entropy(hid, w, y, reduction=reduction, lse_square_scale=1e-4)
        up = (loss * torch.linspace(0.5, 1.5, loss.numel(), device=DEV)).sum() if scale is None else loss * scale
        out += [loss.detach(), *torch.autograd.grad(up, (hid, w))]
    return out


def test_fast_launch_bitwise(fresh_plans):
    """The direct launch path (second call of a plan) gives exactly what Triton's own launch gives, for every
    kernel of the family (both fused-linear schedules: the slices and the accumulation)."""
    from culmen.ops.common.launch import set_fast_launch

    x = randn((2048, 50304), BF16, DEV, 3.0, requires_grad=True)
    y = torch.randint(0, 50304, (2048,), device=DEV)
    y[::5] = -100
    hid = randn((1024, 256), BF16, DEV, requires_grad=True)
    w = randn((40000, 256), BF16, DEV, 256 ** -0.5 * 2, requires_grad=True)
    yf = torch.randint(0, 40000, (1024,), device=DEV)
    yf[::7] = -100
    results = {}
    try:
        for mode in (False, True):
            set_fast_launch(mode)
            for recompute in (True, False):
                FLCE_TUNING["chunk_bytes"] = 8 << 20  # 104-row chunks: a head of 256 tokens, slices or chunks
                FLCE_TUNING["recompute_dw"] = recompute
                for _ in range(2):  # the second call of each plan takes the direct path
                    got = _ce_calls(x, y, x) + _flce_calls(hid, w, yf)
                results[mode, recompute] = got
                launches = _used_launches()
                assert len(launches) > 10
                for la in launches:
                    assert (la._run is not None) == mode, f"{la.fn.fn.__name__}: {la.error}"
    finally:
        set_fast_launch(True)
        FLCE_TUNING["chunk_bytes"] = 62 << 20
        FLCE_TUNING["recompute_dw"] = "auto"
    for recompute in (True, False):
        for i, (a, c) in enumerate(zip(results[False, recompute], results[True, recompute])):
            assert torch.equal(a, c), i
    # The two schedules agree (same math; grad_weight accumulated in bf16 chunk by chunk on one of them).
    for a, c in zip(results[True, True][-9:], results[True, False][-9:]):
        rel = (a.double() - c.double()).norm() / c.double().norm()
        assert rel < 1e-2, f"schedules differ by {rel:.3g}"


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor(dynamic):
    """Under torch.compile (Inductor) the cross-entropy kernels are traced (triton_op + wrap_triton): losses
    and gradients equal eager's, no graph break, and with dynamic shapes new row counts do not recompile.
    The fused linear loss (an opaque custom op) compiles in the same graph."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    V, H = 32000, 256
    w = randn((V, H), BF16, DEV, H ** -0.5 * 2, requires_grad=True)

    def fn(x, y, h):
        rows = cross_entropy(x, y, label_smoothing=0.1, lse_square_scale=1e-4)
        mean = cross_entropy(x, y, reduction="mean", softcap=20.0).loss
        flce = fused_linear_cross_entropy(h, w, y)
        return rows.loss, rows.lse, mean, flce

    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    for n in (64, 77, 130):
        x = randn((n, V), BF16, DEV, 3.0, requires_grad=True)
        h = randn((n, H), BF16, DEV, requires_grad=True)
        y = torch.randint(0, V, (n,), device=DEV)
        y[::9] = -100
        outs = []
        for f in (fn, compiled):
            rows, lse, mean, flce = f(x, y, h)
            grads = torch.autograd.grad((rows * 0.5).sum() + 2 * mean + flce, (x, h, w))
            outs.append((rows, lse, mean, flce, *grads))
        # Symbolic row counts take no split-vocab forward (another summation order): fp32 losses agree to
        # rounding, bf16 gradients to an ulp or two.
        for i, (e, c) in enumerate(zip(*outs)):
            assert c.dtype == e.dtype and c.shape == e.shape
            tol = dict(rtol=2e-2, atol=1e-4) if c.dtype == BF16 else dict(rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(c.float(), e.float(), msg=lambda m, i=i: f"output {i}: {m}", **tol)
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1


@pytest.mark.parametrize("t,h,v", [(4096, 512, 32000), (8192, 768, 50304), (8192, 2048, 50304)])
def test_fused_linear_train_step_shapes(t, h, v):
    """The LM-head losses of ``culmen bench train_step`` (d512 / d768 / d2048): tolerance rule for the loss
    and both gradients, and peak extra memory below the unfused bf16 formulation's (logits, their fp32
    copy and gradient)."""
    hid = randn((t, h), BF16, DEV, requires_grad=True)
    w = randn((v, h), BF16, DEV, 2.0 * h ** -0.5, requires_grad=True)
    y = torch.randint(0, v, (t,), device=DEV)
    y[::11] = -100
    torch.mm(hid[:64].detach(), w[:64].detach().t())  # cuBLAS workspace allocated before measuring

    def ours():
        return torch.autograd.grad(fused_linear_cross_entropy(hid, w, y), (hid, w))

    def unfused():
        return torch.autograd.grad(F.cross_entropy((hid @ w.t()).float(), y), (hid, w))

    ours()
    mine, got = _peak_extra(ours)
    theirs, _ = _peak_extra(unfused)
    assert mine < theirs, f"culmen {mine / 1e9:.3f} GB vs unfused {theirs / 1e9:.3f} GB"
    res = {}
    for name, dt in (("hi", F64), ("lo", BF16)):
        cp = [hid.detach().to(dt).requires_grad_(), w.detach().to(dt).requires_grad_()]
        rl, _ = fused_linear_cross_entropy_ref(cp[0], cp[1], y)
        rl.backward()
        res[name] = (rl.detach(), cp[0].grad, cp[1].grad)
        del cp
    loss = fused_linear_cross_entropy(hid.detach(), w.detach(), y)
    assert_close_tolerance(loss, res["hi"][0], res["lo"][0], name="loss")
    for g, gh, gl, name in zip(got, res["hi"][1:], res["lo"][1:], ("dhidden", "dweight")):
        assert_close_tolerance(g, gh, gl, name=name)


def test_fused_linear_upstream_gradient():
    """The gradients of a reduced loss are scaled by the upstream gradient on the device (skipped when it is
    1): ``(c * loss).backward()`` gives ``c`` times the gradients of ``loss.backward()``."""
    hid = randn((512, 128), BF16, DEV, requires_grad=True)
    w = randn((5000, 128), BF16, DEV, 0.2, requires_grad=True)
    b = randn((5000,), BF16, DEV, 0.1, requires_grad=True)
    y = torch.randint(0, 5000, (512,), device=DEV)
    one = torch.autograd.grad(fused_linear_cross_entropy(hid, w, y, b), (hid, w, b))
    three = torch.autograd.grad(fused_linear_cross_entropy(hid, w, y, b) * 3.0, (hid, w, b))
    for a, c in zip(one, three):
        # One rounding of the fp32 product (the same cuBLAS results both times): within a bf16 ulp.
        torch.testing.assert_close(c.float(), a.float() * 3.0, rtol=2.0**-7, atol=0)
