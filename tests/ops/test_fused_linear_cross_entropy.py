"""``fused_linear_cross_entropy`` (and ``FusedLinearCrossEntropyLoss``) against the unfused float64 oracle.

Tolerance rule: the op's error against ``fused_linear_cross_entropy_ref`` on float64 copies must be at
most 2x the error of the same unfused computation done by PyTorch in the inputs' dtype, plus a small
atol, for the loss, the z-loss and the gradients of hidden, weight and bias. Both CPU paths (reference,
Triton interpreter); chunk sizes are small so every case walks several chunks, and every plan of the
op (vocab-major head in grad_weight's storage, grad_weight by vocab slices or by accumulation) runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from culmen.flash_attn.losses.cross_entropy import FusedLinearCrossEntropyLoss
from culmen.ops.cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_ref
from culmen.ops.cross_entropy.fused_linear import TUNING, default_chunk_rows
from culmen.ops.cross_entropy.fused_linear_plan import FLCEPlan
from culmen.testing import assert_close_tolerance, make_noncontiguous, poisoned_allocations, randn

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    """Each test once per CPU path; every fresh buffer is poisoned (NaN) before a kernel writes it."""
    request.getfixturevalue(f"{request.param}_backend")
    with poisoned_allocations():
        yield request.param


@dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]
    h: int
    v: int
    dtype: torch.dtype = F32
    bias: bool = False
    reduction: str = "mean"
    smoothing: float = 0.0
    zloss: float = 0.0
    softcap: float | None = None
    chunk: int = 8
    accum32: bool = False
    grads: str = "hwb"  # which of hidden / weight / bias require grad
    noncontig: bool = False

    def __str__(self) -> str:
        s = f"{'x'.join(map(str, self.lead))}-H{self.h}-V{self.v}-{str(self.dtype)[6:]}-{self.reduction}-c{self.chunk}"
        for k in ("bias", "accum32", "noncontig"):
            if getattr(self, k):
                s += f"-{k}"
        for k in ("smoothing", "zloss", "softcap"):
            if getattr(self, k):
                s += f"-{k}={getattr(self, k)}"
        return s + (f"-grads={self.grads}" if self.grads != "hwb" else "")


CASES = [
    Case((37,), 16, 300, F32, bias=True, smoothing=0.05, zloss=1e-3, softcap=20.0),
    Case((3, 9), 24, 1000, BF16, reduction="sum", chunk=16, noncontig=True),
    Case((20,), 16, 257, F16, bias=True, reduction="none", chunk=6, zloss=1e-2),
    Case((33,), 16, 300, BF16, accum32=True, grads="w", smoothing=0.1),
    Case((13,), 8, 4099, F32, reduction="none", chunk=5, softcap=5.0, grads="h"),
    # N <= H: the vocab-major head holds every token (n0 < H: the slices must run top-down).
    Case((21,), 32, 333, F16, bias=True, smoothing=0.1, chunk=8),
    # Tokens beyond a head of H = 32, more than H of them: with the slices, two chunks of <= 32 rows in
    # grad_weight's storage before the head.
    Case((71,), 32, 300, BF16, bias=True, smoothing=0.05, chunk=4),
]

# TUNING overrides selecting the stages of fused_linear.py: (vocab_major, recompute_dw).
PLANS = {"head+slices": (True, True), "head+accumulate": (True, False), "slices": (False, True),
         "accumulate": (False, False)}


def _inputs(c: Case):
    hid = randn((*c.lead, c.h), c.dtype)
    if c.noncontig:
        hid = make_noncontiguous(hid, pad=3)
    w = randn((c.v, c.h), c.dtype, scale=c.h ** -0.5 * 3)
    b = randn((c.v,), c.dtype, scale=0.5) if c.bias else None
    for t, k in ((hid, "h"), (w, "w"), (b, "b")):
        if t is not None and k in c.grads:
            t.requires_grad_()
    y = torch.randint(0, c.v, c.lead)
    y.view(-1)[::4] = -100
    return hid, w, b, y


def _ref(c: Case, hid, w, b, y, dtype):
    ts = [None if t is None else t.detach().to(dtype).requires_grad_(t.requires_grad) for t in (hid, w, b)]
    loss, zl = fused_linear_cross_entropy_ref(ts[0], ts[1], y, ts[2], label_smoothing=c.smoothing,
                                              lse_square_scale=c.zloss, softcap=c.softcap, reduction=c.reduction)
    return ts, loss, zl


def check_case(case: Case) -> None:
    hid, w, b, y = _inputs(case)
    loss, zl = fused_linear_cross_entropy(hid, w, y, b, label_smoothing=case.smoothing, lse_square_scale=case.zloss,
                                          softcap=case.softcap, reduction=case.reduction, return_z_loss=True,
                                          chunk_size=case.chunk, accum_dtype=F32 if case.accum32 else None)
    hi_in, hi_loss, hi_z = _ref(case, hid, w, b, y, torch.float64)
    lo_in, lo_loss, lo_z = _ref(case, hid, w, b, y, case.dtype)
    assert loss.dtype == F32 and loss.shape == hi_loss.shape and zl.shape == hi_loss.shape
    assert_close_tolerance(loss, hi_loss, lo_loss, name="loss")
    assert_close_tolerance(zl, hi_z, lo_z, name="z_loss")
    g = torch.rand(loss.shape) + 0.5
    (loss * g).sum().backward()
    (hi_loss * g.double()).sum().backward()
    (lo_loss * g.to(lo_loss.dtype)).sum().backward()
    for t, th, tl_, name in zip((hid, w, b), hi_in, lo_in, ("dhidden", "dweight", "dbias")):
        if t is None or not t.requires_grad:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        assert_close_tolerance(t.grad, th.grad, tl_.grad, name=name)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(backend, case):
    check_case(case)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[6]], ids=str)
def test_plans(backend, plan, case, monkeypatch):
    """Each plan gives the same (tolerance-checked) results; the stages it names are the ones that run,
    and the token chunks run in grad_weight's storage exactly when the slices write it at the end."""
    head, slices = PLANS[plan]
    monkeypatch.setitem(TUNING, "vocab_major", head)
    monkeypatch.setitem(TUNING, "recompute_dw", slices)
    monkeypatch.setitem(TUNING, "min_slice_rows", 1)
    ran = []
    for name in ("_head", "_head_dw", "_slices_dw", "_chunk_dw", "_chunks"):
        fn = getattr(FLCEPlan, name)
        monkeypatch.setattr(FLCEPlan, name, lambda *a, _f=fn, _n=name, **k: (ran.append((_n, a)), _f(*a, **k))[1])
    check_case(case)
    names = [n for n, _ in ran]
    assert ("_head" in names) == head and ("_slices_dw" in names) == slices
    # Without the slices, grad_weight comes from the head's own slices and / or per-chunk accumulation.
    assert slices != ("_chunk_dw" in names or "_head_dw" in names)
    for n, a in ran:
        if n == "_chunks":
            _, sg, call, buf = a[:4]
            in_gw = call.gw is not None and buf.data_ptr() == call.gw.data_ptr()
            assert in_gw == (slices and call.gw is not None) and sg.step == (case.h if in_gw else case.chunk)
            assert sg.in_gw == in_gw


def test_no_grad_and_frozen_inputs(backend):
    """Without a needed gradient only the loss is computed; it equals the training-mode loss."""
    c = Case((17,), 8, 100)
    hid, w, b, y = _inputs(c)
    train = fused_linear_cross_entropy(hid, w, y, chunk_size=4)
    with torch.no_grad():
        ev = fused_linear_cross_entropy(hid, w, y, chunk_size=4)
    assert not ev.requires_grad and torch.allclose(ev, train.detach(), atol=1e-6)
    frozen = fused_linear_cross_entropy(hid.detach(), w.detach(), y, chunk_size=4)
    assert not frozen.requires_grad and torch.allclose(frozen, ev, atol=1e-6)


def test_all_ignored_mean_is_nan_with_zero_grads(backend):
    hid, w, _, _ = _inputs(Case((6,), 8, 50))
    y = torch.full((6,), -100)
    loss = fused_linear_cross_entropy(hid, w, y, chunk_size=4)
    assert torch.isnan(loss)  # 0 / 0, as F.cross_entropy
    loss.backward()
    assert bool((hid.grad == 0).all()) and bool((w.grad == 0).all())


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_empty_input(backend, reduction):
    hid = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    loss = fused_linear_cross_entropy(hid, w, torch.zeros(0, dtype=torch.long), reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    loss.sum().backward()
    assert hid.grad.shape == (0, 8) and bool((w.grad == 0).all())


def test_module_matches_functional_and_backward_once(backend):
    hid, w, b, y = _inputs(Case((11,), 8, 64, bias=True))
    mod = FusedLinearCrossEntropyLoss(label_smoothing=0.1, lse_square_scale=1e-3, softcap=10.0, return_z_loss=True,
                                      chunk_size=4)
    loss, zl = mod(hid, w, y, b)
    ref, rz = fused_linear_cross_entropy(hid, w, y, b, label_smoothing=0.1, lse_square_scale=1e-3, softcap=10.0,
                                         return_z_loss=True, chunk_size=4)
    assert torch.equal(loss, ref) and torch.equal(zl, rz) and not zl.requires_grad
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same forward twice"):
        loss.backward()


def test_default_chunk_budget(monkeypatch):
    """The default chunk comes from a byte budget: 248 tokens at V=128256 bf16 (a 63.6 MB buffer, below
    the 256 rows of Liger-Kernel's chunk)."""
    assert default_chunk_rows(8192, 128256, BF16) == 248
    assert default_chunk_rows(100, 128256, BF16) == 100
    monkeypatch.setitem(TUNING, "chunk_bytes", 1000 * 4 * 3)
    assert default_chunk_rows(50, 1000, F32) == 3


def test_bad_inputs_raise():
    hid, w, b, y = _inputs(Case((5,), 8, 20, bias=True))
    with pytest.raises(TypeError, match="share one dtype.*hidden torch.float32, weight torch.float16"):
        fused_linear_cross_entropy(hid, w.half(), y)
    with pytest.raises(ValueError, match=r"weight must be \(V, H\) with H = hidden.shape\[-1\]"):
        fused_linear_cross_entropy(hid, w[:, :4], y)
    with pytest.raises(ValueError, match=r"bias must have shape \(20,\), got \(19,\)"):
        fused_linear_cross_entropy(hid, w, y, b[:19])
    with pytest.raises(ValueError, match=r"labels must have shape \(5,\), got \(4,\)"):
        fused_linear_cross_entropy(hid, w, y[:4])
    with pytest.raises(ValueError, match=r"labels must be in \[0, 20\).*got 20"):
        fused_linear_cross_entropy(hid, w, torch.tensor([0, 1, 20, 2, 3]))
    with pytest.raises(ValueError, match="reduction must be one of .* got 'avg'"):
        fused_linear_cross_entropy(hid, w, y, reduction="avg")
    with pytest.raises(ValueError, match="chunk_size must be None or a positive int, got 0"):
        fused_linear_cross_entropy(hid, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="accum_dtype must be None, torch.float32 or the weight's dtype"):
        fused_linear_cross_entropy(hid, w, y, accum_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"softcap must be None or a finite value >= 0 .*got -1"):
        fused_linear_cross_entropy(hid, w, y, softcap=-1.0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        FusedLinearCrossEntropyLoss(reduction="max")


@pytest.mark.parametrize("smoothing, zloss, softcap", [(0.0, 0.0, 0.0), (0.1, 1e-3, 8.0)])
def test_vocab_major_kernels(triton_backend, monkeypatch, smoothing, zloss, softcap):
    """The strided kernels of ``vocab_major.py`` on a ``(V, N)`` token-contiguous buffer (viewed ``(N, V)``)
    match the reference launcher semantics: loss / z-loss / LSE over several vocab splits, the gradient of a
    vocab slice ``[v0, v1)`` written in place, ignored rows zero and a bad label NaN."""
    from culmen.ops.cross_entropy.reference import cross_entropy_bwd_ref, cross_entropy_fwd_ref
    from culmen.ops.cross_entropy.vocab_major import TUNING as VM
    from culmen.ops.cross_entropy.vocab_major import vm_grad, vm_loss_lse

    monkeypatch.setitem(VM, "block_m", 8)
    monkeypatch.setitem(VM, "block_v", 16)
    monkeypatch.setitem(VM, "stats_block_m", 8)
    monkeypatch.setitem(VM, "stats_block_v", 16)
    N, V = 19, 203
    buf = randn((V, N + 5), F32, scale=3.0)  # a row stride larger than N
    lg = buf[:, :N].t()
    y = torch.randint(0, V, (N,))
    y[3] = -100
    y[7] = V + 4  # invalid: NaN loss and gradient
    args = (smoothing, 1.0, zloss, -100, softcap, 0, V)
    # With smoothing, the partials go to a caller's bf16 workspace (the fused path's idle scratch).
    ws = torch.full((4096,), float("nan"), dtype=BF16) if smoothing else None
    got = vm_loss_lse(lg, y, *args, workspace=ws)
    want = cross_entropy_fwd_ref(lg, y, None, *args, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    lse = want[2]
    dloss = torch.rand(N)
    v0, v1 = 37, 150
    expect = cross_entropy_bwd_ref(dloss, lg, lse, y, *args)[:, v0:v1]
    part = lg[:, v0:v1]
    vm_grad(dloss, part, lse, y, smoothing, 1.0, zloss, -100, softcap, v0, V)
    torch.testing.assert_close(part, expect, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert bool((part[3] == 0).all()) and bool(torch.isnan(part[7]).all())


@pytest.mark.parametrize("n,h,v,recompute", [
    (8192, 4096, 128256, True),  # Llama-3 head: 248-row chunks; the measured faster plan (the notes' table)
    (16384, 4096, 128256, True),
    (4096, 512, 32000, False),  # train_step's LM heads: 640-1008-row chunks, accumulating is cheaper
    (8192, 768, 50304, False),
    (8192, 2048, 50304, False),
])
def test_auto_schedule(n, h, v, recompute):
    """``recompute_dw="auto"`` picks stage 3 where a chunk is a few hundred rows (large vocabularies) and
    the accumulation at 32k-50k classes; the scratch (peak memory) is the same either way, and with stage
    3 the token chunks run in grad_weight's storage."""
    assert TUNING["recompute_dw"] == "auto"
    hid = torch.empty((n, h), dtype=BF16, device="meta")
    w = torch.empty((v, h), dtype=BF16, device="meta")
    y = torch.empty((n,), dtype=torch.long, device="meta")
    plan = FLCEPlan(hid, w, None, y, -100, 0.0, 0.0, None, "mean", (True, True, False), None, None)
    sg = plan.schedule("fwd_grad")
    assert sg.recompute == recompute and sg.accumulate != recompute
    assert sg.in_gw == (recompute and h > plan.C)
    assert plan.C == default_chunk_rows(n, v, BF16)
    # Every token is in the head or in exactly one chunk.
    assert sg.n0 + sum(r1 - r0 for r0, r1 in sg.chunks) == n


def test_strided_labels_and_3d_none(backend):
    """Labels as a strided view (their stride goes to the kernels) and 3-D hidden with ``reduction="none"``
    (losses in the labels' shape), forward and the recompute backward."""
    c = Case((2, 7), 16, 120, F32, reduction="none", chunk=4)
    hid, w, b, _ = _inputs(c)
    y = torch.randint(0, 120, (2, 14))[:, ::2]
    y[0, 1] = -100
    assert not y.is_contiguous()
    loss = fused_linear_cross_entropy(hid, w, y, reduction="none", chunk_size=4)
    assert loss.shape == (2, 7)
    cp = [t.detach().double().requires_grad_() for t in (hid, w)]
    ref, _ = fused_linear_cross_entropy_ref(cp[0], cp[1], y, reduction="none")
    assert torch.allclose(loss.double(), ref, atol=1e-5)
    g = torch.rand(2, 7)
    (loss * g).sum().backward()
    (ref * g.double()).sum().backward()
    for t, want in zip((hid, w), cp):
        assert torch.allclose(t.grad.double(), want.grad, atol=1e-5)
    # 1-D labels with stride 2 reach the kernels as they are (mean: gradients in the forward).
    h2 = hid.detach()[0].clone().requires_grad_()
    y1 = torch.randint(0, 120, (14,))[::2]
    assert y1.stride(0) == 2
    loss = fused_linear_cross_entropy(h2, w.detach(), y1, chunk_size=4, label_smoothing=0.1)
    h64 = h2.detach().double().requires_grad_()
    ref, _ = fused_linear_cross_entropy_ref(h64, w.detach().double(), y1, label_smoothing=0.1)
    assert torch.allclose(loss.double(), ref, atol=1e-5)
    loss.backward()
    ref.backward()
    assert torch.allclose(h2.grad.double(), h64.grad, atol=1e-5)
