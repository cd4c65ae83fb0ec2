"""Cross-entropy and fused linear + cross-entropy on a real GPU at real sizes (run by ``scripts/gpu-check``).

Same tolerance rule as the CPU tests (float64 oracle computed on the GPU; baseline: PyTorch's fp32-upcast
cross-entropy, and for the fused linear loss the unfused computation in the inputs' dtype), plus the
issue's memory goals: cross-entropy fwd+bwd at 8192 x 128256 bf16 within a quarter of PyTorch's
fp32-upcast peak, fused linear + cross-entropy at T=8192, H=4096, V=128256 within Liger's 1.38 GB.
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


def test_invalid_label_on_gpu(monkeypatch):
    x = randn((4, 1000), F32, DEV)
    y = torch.tensor([1, 1000, -100, 5], device=DEV)
    loss = cross_entropy(x, y).loss
    assert torch.isnan(loss[1]) and bool(torch.isfinite(loss[[0, 2, 3]]).all())
    monkeypatch.setenv("CULMEN_CHECK_LABELS", "1")
    with pytest.raises(ValueError, match=r"labels must be in \[0, 1000\)"):
        cross_entropy(x, y)


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
