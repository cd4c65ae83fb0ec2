"""``culmen.ops.cross_entropy`` and its APIs (flash_attn's losses, Apex's xentropy) against a float64 oracle.

Numerical cases run on the pure-PyTorch reference path and on the Triton kernels under the CPU
interpreter. Tolerance rule (DESIGN.md): the op's error against ``cross_entropy_ref`` on float64 must be
at most 2x the error of PyTorch's usual computation (``cross_entropy_ref`` on the fp32-upcast logits,
gradient rounded to the logits' dtype), plus a small atol, for the losses, the LSE and the gradient.
Kernel outputs are poisoned (NaN) before the kernels write them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from culmen.flash_attn.losses.cross_entropy import CrossEntropyLoss
from culmen.flash_attn.ops.triton.cross_entropy import CrossEntropyLoss as CrossEntropyFn
from culmen.flash_attn.ops.triton.cross_entropy import cross_entropy_loss
from culmen.ops.backend import set_backend
from culmen.ops.cross_entropy import cross_entropy, cross_entropy_ref
from culmen.ops.cross_entropy import launch as ce_launch
from culmen.ops.cross_entropy.launch import CEPlan
from culmen.ops.cross_entropy.op import NO_IGNORE, run_backward, run_forward
from culmen.testing import assert_close_tolerance, make_noncontiguous, poisoned_allocations, randn

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    """Each test once per CPU path; every fresh buffer is poisoned (NaN) before a kernel writes it."""
    request.getfixturevalue(f"{request.param}_backend")
    with poisoned_allocations():
        yield request.param


@pytest.fixture
def small_blocks(monkeypatch):
    """Tiny blocks: several vocab chunks per row, the split-vocab forward and several backward tiles."""
    monkeypatch.setitem(ce_launch.TUNING, "fwd_block_v", 64)
    monkeypatch.setitem(ce_launch.TUNING, "fwd_elems", 64)
    monkeypatch.setitem(ce_launch.TUNING, "bwd_block_v", 128)
    monkeypatch.setitem(ce_launch.TUNING, "bwd_elems", 256)


@dataclass(frozen=True)
class Case:
    n: int
    v: int
    dtype: torch.dtype = F32
    smoothing: float = 0.0
    scale: float = 1.0
    zloss: float = 0.0
    softcap: float = 0.0
    ignore: bool = False
    noncontig: bool = False
    small: bool = False
    precomputed: bool = False
    int32: bool = False

    def __str__(self) -> str:
        s = f"{self.n}x{self.v}-{str(self.dtype)[6:]}"
        for k in ("smoothing", "scale", "zloss", "softcap"):
            if getattr(self, k) != Case.__dataclass_fields__[k].default:
                s += f"-{k}={getattr(self, k)}"
        return s + "".join(f"-{k}" for k in ("ignore", "noncontig", "small", "precomputed", "int32")
                           if getattr(self, k))


CASES = [
    Case(7, 1000),
    Case(5, 4099, BF16, smoothing=0.1, zloss=1e-3, ignore=True),
    Case(6, 1000, F16, scale=0.7, softcap=8.0, noncontig=True, int32=True),
    # Few rows, many chunks: the split-vocab forward with its combine kernel, several backward tiles.
    Case(3, 1000, F32, smoothing=0.2, ignore=True, small=True, softcap=30.0),
    # Many short rows per program (rows past the end clamped), non-contiguous rows.
    Case(9, 257, BF16, zloss=1e-2, noncontig=True, ignore=True),
    Case(4, 1000, F32, precomputed=True, ignore=True),
    Case(1, 1),
]


def _inputs(c: Case):
    x = randn((c.n, c.v), c.dtype, scale=3.0)
    if c.noncontig:
        x = make_noncontiguous(x, pad=5)
        assert not x.is_contiguous() or c.n == 1
    x.requires_grad_()
    y = torch.randint(0, c.v, (c.n,), dtype=torch.int32 if c.int32 else torch.int64)
    if c.ignore:
        y[::3] = -100
    return x, y


def _kw(c: Case) -> dict:
    return dict(label_smoothing=c.smoothing, logit_scale=c.scale, lse_square_scale=c.zloss, softcap=c.softcap)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(backend, case, request):
    if case.small:
        request.getfixturevalue("small_blocks")
    x, y = _inputs(case)
    pre = torch.logsumexp(x.detach().double(), -1) if case.precomputed else None
    out = cross_entropy(x, y, precomputed_lse=pre, **_kw(case))
    x64 = x.detach().double().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    # The oracle computes the LSE itself (a precomputed one is the exact LSE, and the true gradient
    # flows through it: the op's backward uses softmax = exp(z - lse) as flash_attn's does).
    hi = cross_entropy_ref(x64, y, **_kw(case))
    lo = cross_entropy_ref(x32, y, **_kw(case))
    for i, name in enumerate(("loss", "z_loss", "lse")):
        assert out[i].dtype == F32 and out[i].shape == (case.n,)
        assert_close_tolerance(out[i], hi[i], lo[i], name=name)
    dy = torch.rand(case.n) + 0.5
    (out.loss * dy).sum().backward()
    (hi[0] * dy.double()).sum().backward()
    (lo[0] * dy).sum().backward()
    assert x.grad.dtype == case.dtype
    assert_close_tolerance(x.grad, x64.grad, x32.grad.to(case.dtype), name="dlogits")
    ignored = y == -100
    assert bool((out.loss[ignored] == 0).all()) and bool((x.grad[ignored] == 0).all())


def test_inplace_backward(backend):
    x, y = _inputs(Case(5, 300, BF16, smoothing=0.1))
    buf = x.detach()
    out = cross_entropy(x, y, label_smoothing=0.1, inplace_backward=True)
    before = buf.clone()
    out.loss.sum().backward()
    x64 = before.double().requires_grad_()
    cross_entropy_ref(x64, y, label_smoothing=0.1)[0].sum().backward()
    # The gradient was written into the logits' own storage (autograd may still copy it into a leaf's
    # .grad; for the usual non-leaf logits it flows on without a second buffer).
    assert torch.equal(buf, x.grad)
    assert not torch.equal(buf, before)
    assert_close_tolerance(x.grad, x64.grad, x64.grad.float().to(BF16), name="dlogits")


def test_precomputed_lse_only_without_smoothing(backend):
    """flash_attn uses a given LSE only when smoothing is 0 and the scale is 1; a wrong one shows."""
    x, y = _inputs(Case(4, 100))
    wrong = torch.zeros(4)
    used = cross_entropy(x, y, precomputed_lse=wrong).loss
    assert torch.allclose(used, -x.detach().gather(1, y[:, None]).squeeze(1), atol=1e-6)
    ignored = cross_entropy(x, y, precomputed_lse=wrong, label_smoothing=0.1).loss
    ref = cross_entropy_ref(x.detach().double(), y, label_smoothing=0.1)[0]
    assert torch.allclose(ignored.double(), ref, atol=1e-5)


def test_invalid_label_gives_nan_rows(backend):
    """Past the host check (GPU labels), an invalid label poisons its own row only (and a mean)."""
    x = randn((4, 50))
    y = torch.tensor([3, 50, -100, 7])
    plan = CEPlan(x, y, None, 0.1, 1.0, 1e-3, -100, None, "none", False, None)
    loss, zl, lse, _ = run_forward(plan, x, y, None)
    assert torch.isnan(loss[1]) and bool(torch.isfinite(loss[[0, 2, 3]]).all())
    g = run_backward(plan, torch.ones(4), x, lse, y, None)
    assert bool(torch.isnan(g[1]).all()) and bool(torch.isfinite(g[[0, 2, 3]]).all())
    assert bool((g[2] == 0).all())
    mean = CEPlan(x, y, None, 0.1, 1.0, 1e-3, -100, None, "mean", False, None)
    loss, _, lse, rows = run_forward(mean, x, y, None)
    assert loss.shape == () and torch.isnan(loss)
    g = run_backward(mean, torch.ones(()), x, lse, y, rows)
    assert bool(torch.isnan(g[1]).all()) and bool((g[2] == 0).all()) and bool(torch.isfinite(g[[0, 3]]).all())


def test_bad_inputs_raise():
    x, y = _inputs(Case(4, 10))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\).*got 10"):
        cross_entropy(x, torch.tensor([1, 2, 10, 3]))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\).*got -1"):
        cross_entropy(x, torch.tensor([1, -1, 2, 3]))
    with pytest.raises(ValueError, match=r"labels must have shape \(4,\), got \(3,\)"):
        cross_entropy(x, y[:3])
    with pytest.raises(TypeError, match="labels must be an integer tensor.*float32"):
        cross_entropy(x, y.float())
    with pytest.raises(TypeError, match="logits must be a floating-point tensor.*int64"):
        cross_entropy(y[:, None].expand(4, 3), y)
    with pytest.raises(ValueError, match=r"logits must be 2-D \(N, V\), got shape \(2, 2, 10\)"):
        cross_entropy(x.reshape(2, 2, 10), y)
    with pytest.raises(ValueError, match="at least one class"):
        cross_entropy(torch.empty(4, 0), y)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got 1.5"):
        cross_entropy(x, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="lse_square_scale must be finite and >= 0, got -1"):
        cross_entropy(x, y, lse_square_scale=-1.0)
    with pytest.raises(ValueError, match="softcap must be None or a finite value >= 0"):
        cross_entropy(x, y, softcap=-2.0)
    with pytest.raises(ValueError, match=r"precomputed_lse must be a tensor of shape \(4,\)"):
        cross_entropy(x, y, precomputed_lse=torch.zeros(3))
    with pytest.raises(NotImplementedError, match="reduction"):
        CrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match=r"target must have shape \(4,\)"):
        CrossEntropyLoss()(x, y[:2])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_flash_attn_module(backend, reduction):
    """flash_attn's ``CrossEntropyLoss``: reduction over non-ignored rows, ``return_z_loss``, 3-D input."""
    x = randn((2, 5, 300), BF16, scale=2.0, requires_grad=True)
    y = torch.randint(0, 300, (2, 5))
    y[0, ::2] = -100
    mod = CrossEntropyLoss(reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-3, return_z_loss=True)
    loss, zl = mod(x, y)
    x64 = x.detach().double().requires_grad_()
    rl, rz, _ = cross_entropy_ref(x64.reshape(-1, 300), y.reshape(-1), label_smoothing=0.1, lse_square_scale=1e-3)
    n = (y != -100).sum()
    red = {"mean": lambda t: t.sum() / n, "sum": lambda t: t.sum(), "none": lambda t: t.reshape(2, 5)}[reduction]
    rl, rz = red(rl), red(rz)
    assert loss.shape == rl.shape and zl.shape == rz.shape
    assert torch.allclose(loss.double(), rl, rtol=1e-5, atol=1e-5)
    assert torch.allclose(zl.double(), rz, rtol=1e-5, atol=1e-6)
    g = torch.rand(loss.shape) + 0.5
    (loss * g).sum().backward()
    (rl * g.double()).sum().backward()
    assert_close_tolerance(x.grad, x64.grad, x64.grad.float().to(BF16), name="dlogits")


def test_flash_attn_functional_signatures(backend):
    """``cross_entropy_loss`` and ``CrossEntropyLoss.apply`` take flash_attn's positional order."""
    x, y = _inputs(Case(6, 200, F32, ignore=True))
    pre = torch.logsumexp(x.detach(), -1)
    a_loss, a_z = cross_entropy_loss(x, y, None, 0.1, 0.5, 1e-3, -100)
    b_loss, b_z = CrossEntropyFn.apply(x, y, None, 0.1, 0.5, 1e-3, -100, False, None)
    r = cross_entropy_ref(x.detach().double(), y, label_smoothing=0.1, logit_scale=0.5, lse_square_scale=1e-3)
    for got in (a_loss, b_loss):
        assert torch.allclose(got.double(), r[0], atol=1e-5)
    for got in (a_z, b_z):
        assert torch.allclose(got.double(), r[1], atol=1e-6)
    assert not a_z.requires_grad and a_loss.requires_grad
    c_loss, _ = cross_entropy_loss(x, y, pre)  # precomputed LSE, used (no smoothing, scale 1)
    assert torch.allclose(c_loss.double(), cross_entropy_ref(x.detach().double(), y)[0], atol=1e-5)


@pytest.mark.parametrize("dtype,half_to_float", [(F16, False), (F16, True), (F32, False)])
def test_apex_xentropy(backend, dtype, half_to_float):
    """Apex's ``SoftmaxCrossEntropyLoss.apply``: per-token losses, padding rows 0 (loss and grad)."""
    from culmen.contrib.xentropy import SoftmaxCrossEntropyLoss

    x = randn((7, 129), dtype, scale=2.0, requires_grad=True)
    y = torch.randint(1, 129, (7,))
    y[[1, 4]] = 0  # padding_idx=0 rows
    loss = SoftmaxCrossEntropyLoss.apply(x, y, 0.1, 0, half_to_float)
    assert loss.dtype == (F32 if half_to_float else dtype) and loss.shape == (7,)
    x64 = x.detach().double().requires_grad_()
    ref = cross_entropy_ref(x64, y, label_smoothing=0.1, ignore_index=0)[0]
    lo = cross_entropy_ref(x.detach().float(), y, label_smoothing=0.1, ignore_index=0)[0]
    assert_close_tolerance(loss, ref, lo if half_to_float else lo.to(dtype), name="losses")
    assert bool((loss[[1, 4]] == 0).all())
    g = torch.rand(7) + 0.5
    (loss.float() * g).sum().backward()
    (ref * g.double()).sum().backward()
    assert x.grad.dtype == dtype and bool((x.grad[[1, 4]] == 0).all())
    assert_close_tolerance(x.grad, x64.grad, x64.grad.float().to(dtype), name="dlogits")


def test_apex_xentropy_cuda_module(backend):
    """The ``xentropy_cuda`` extension functions: Apex's signatures; no padding mask in ``forward``."""
    from culmen.contrib.xentropy import xentropy_cuda

    x = randn((5, 64), F16, scale=2.0)
    y = torch.tensor([0, 3, 63, 9, 0])
    losses, lse = xentropy_cuda.forward(x, y, 0.1, False)
    assert losses.dtype == F16 and lse.dtype == F32
    ref, _, ref_lse = cross_entropy_ref(x.double(), y, label_smoothing=0.1, ignore_index=NO_IGNORE)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    assert torch.allclose(losses.double(), ref, rtol=2e-3, atol=2e-3) and bool((losses[[0, 4]] != 0).all())
    g = torch.rand(5)
    grad = xentropy_cuda.backward(g, x, lse, y, 0.1)
    x64 = x.double().requires_grad_()
    (cross_entropy_ref(x64, y, label_smoothing=0.1, ignore_index=NO_IGNORE)[0] * g.double()).sum().backward()
    assert grad.dtype == F16
    assert_close_tolerance(grad, x64.grad, x64.grad.float().to(F16), name="grad_logits")
    with pytest.raises(ValueError, match=r"labels must be in \[0, 64\)"):
        xentropy_cuda.forward(x, torch.tensor([0, 1, 64, 2, 3]), 0.0, False)


def test_compat_names():
    """``import xentropy_cuda`` / ``apex.contrib.xentropy`` / ``flash_attn.losses.cross_entropy`` via the alias."""
    code = textwrap.dedent("""
        import torch, culmen.compat as compat
        compat.install()
        import xentropy_cuda
        from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
        from flash_attn.losses.cross_entropy import CrossEntropyLoss
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
        import culmen.contrib.xentropy.xentropy_cuda as mine
        assert xentropy_cuda is mine and callable(xentropy_cuda.forward) and callable(xentropy_cuda.backward)
        x = torch.randn(3, 11); y = torch.tensor([0, 4, 10])
        a = SoftmaxCrossEntropyLoss.apply(x, y, 0.0, 0, False)
        b = CrossEntropyLoss(reduction="none", ignore_index=0)(x, y)
        assert torch.allclose(a, b) and a[0] == 0
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr


@pytest.mark.parametrize("compile_backend", ["reference", "triton"])
def test_torch_compile_fullgraph(compile_backend):
    """Both op families trace without graph breaks and match eager (forward and gradients): the triton_op
    of ``cross_entropy`` per row and reduced, and the custom op of the fused linear loss."""
    from culmen.ops.cross_entropy import fused_linear_cross_entropy

    set_backend(compile_backend)
    torch._dynamo.reset()
    x = randn((6, 50), requires_grad=True)
    y = torch.tensor([1, 2, -100, 49, 0, 7])
    h = randn((6, 8), requires_grad=True)
    w = randn((50, 8), scale=0.5, requires_grad=True)

    def fn(x, y, h, w):
        o = cross_entropy(x, y, label_smoothing=0.1, lse_square_scale=1e-3)
        mean = cross_entropy(x, y, softcap=5.0, reduction="mean").loss
        half = cross_entropy(x, y, reduction="sum", out_dtype=torch.float16).loss
        flce = fused_linear_cross_entropy(h, w, y, label_smoothing=0.1, chunk_size=4)
        none = fused_linear_cross_entropy(h, w, y, reduction="none", chunk_size=4)
        return o.loss.sum() + 2 * mean + half.float() + flce + (none * torch.arange(6.0)).sum()

    def run(f):
        total = f(x, y, h, w)
        return (total, *torch.autograd.grad(total, (x, h, w)))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for e, c, name in zip(run(fn), run(compiled), ("loss", "dx", "dh", "dw")):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6, msg=name)
    explained = torch._dynamo.explain(fn)(x, y, h, w)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_torch_compile_dynamic_rows():
    """With dynamic shapes a new row count reuses the compiled graph (the plan takes no part in the guards:
    block sizes and grids are symbolic in the rows), forward and backward equal eager's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def fn(x, y):
        return cross_entropy(x, y, label_smoothing=0.1, reduction="mean").loss

    compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend="aot_eager")
    for n in (5, 9, 13):
        x = randn((n, 40), requires_grad=True)
        y = torch.randint(0, 40, (n,))
        y[0] = -100
        got = compiled(x, y)
        (gc,) = torch.autograd.grad(got, x)
        want = fn(x, y)
        (ge,) = torch.autograd.grad(want, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_op_reductions(backend, reduction, request):
    """``reduction="mean"/"sum"`` in the op (one-program kernel; the backward reads the row scale from the
    device): values and gradients against the float64 oracle, loss in ``out_dtype``, ignored rows not
    counted; also with the split-vocab forward (few rows, small blocks)."""
    request.getfixturevalue("small_blocks")
    x, y = _inputs(Case(7, 1000, BF16, ignore=True))
    kw = dict(label_smoothing=0.1, lse_square_scale=1e-3)
    out = cross_entropy(x, y, reduction=reduction, **kw)
    assert out.loss.shape == () and out.z_loss.shape == () and out.loss.dtype == F32 and out.lse.shape == (7,)
    x64 = x.detach().double().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    n = (y != -100).sum()

    def red(t):
        return t.sum() / n if reduction == "mean" else t.sum()

    hi, lo = cross_entropy_ref(x64, y, **kw), cross_entropy_ref(x32, y, **kw)
    assert_close_tolerance(out.loss, red(hi[0]), red(lo[0]), name="loss")
    assert_close_tolerance(out.z_loss, red(hi[1]), red(lo[1]), name="z_loss")
    (2.5 * out.loss).backward()
    (2.5 * red(hi[0])).backward()
    (2.5 * red(lo[0])).backward()
    assert_close_tolerance(x.grad, x64.grad, x32.grad.to(BF16), name="dlogits")
    half = cross_entropy(x.detach(), y, reduction=reduction, out_dtype=torch.float16, **kw).loss
    assert half.dtype == torch.float16 and torch.allclose(half.float(), out.loss.detach(), rtol=1e-3)


def test_mean_of_all_ignored_rows(backend):
    """Every row ignored: the mean is 0 / 0 = NaN (PyTorch's), the gradient 0 (not NaN)."""
    x = randn((5, 30), requires_grad=True)
    y = torch.full((5,), -100)
    loss = cross_entropy(x, y, reduction="mean").loss
    assert torch.isnan(loss)
    loss.backward()
    assert bool((x.grad == 0).all())
    assert cross_entropy(x.detach(), y, reduction="sum").loss == 0


def test_strided_labels_and_precomputed_lse(backend):
    """Labels with a stride (a view of every other label) and a precomputed LSE with a stride, in bf16 (read
    as it is) and fp32; an in-place backward on logits whose rows are padded."""
    x = make_noncontiguous(randn((6, 300), scale=2.0), pad=4).requires_grad_()
    y = torch.randint(0, 300, (12,))[::2]
    y[1] = -100
    exact = torch.logsumexp(x.detach().double(), -1)
    lse16 = exact.to(BF16).repeat_interleave(2)[::2]
    assert y.stride(0) == 2 and lse16.stride(0) == 2
    out = cross_entropy(x.detach(), y, precomputed_lse=lse16)
    want = cross_entropy_ref(x.detach().double(), y, precomputed_lse=lse16.double())[0]
    assert torch.allclose(out.loss.double(), want, atol=1e-5)
    assert torch.equal(out.lse, lse16.float())
    lse32 = exact.float().repeat_interleave(2)[::2]
    out = cross_entropy(x * 1.0, y, precomputed_lse=lse32, inplace_backward=True)
    out.loss.sum().backward()
    # The oracle computes the LSE (the exact one was given): the gradient flows through it as the op's does.
    x64 = x.detach().double().requires_grad_()
    cross_entropy_ref(x64, y)[0].sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-5)


def test_plans_are_cached_and_dropped_by_switches(triton_backend, monkeypatch):
    """One plan per signature; every switch and tuning change drops the cached plans. Label values are
    always checked for CPU labels (whatever ``set_check_values`` says)."""
    from culmen.ops.backend import set_check_values

    x, y = _inputs(Case(4, 100))
    ce_launch.PLANS.clear()
    for _ in range(3):
        cross_entropy(x, y)
    assert len(ce_launch.PLANS) == 1
    plan = next(iter(ce_launch.PLANS.values()))
    assert plan.use_kernel and plan.check_values
    cross_entropy(x, y, reduction="mean")
    assert len(ce_launch.PLANS) == 2
    monkeypatch.setitem(ce_launch.TUNING, "fwd_block_v", 64)
    assert len(ce_launch.PLANS) == 0
    cross_entropy(x, y)
    set_check_values(True)
    try:
        assert len(ce_launch.PLANS) == 0
        cross_entropy(x, y)
    finally:
        set_check_values(False)
    assert len(ce_launch.PLANS) == 0
    with pytest.raises(ValueError, match=r"labels must be in \[0, 100\)"):
        cross_entropy(x, torch.tensor([0, 1, 100, 2]))
    set_backend("reference")
    assert len(ce_launch.PLANS) == 0
    cross_entropy(x, y)
    assert not next(iter(ce_launch.PLANS.values())).use_kernel
