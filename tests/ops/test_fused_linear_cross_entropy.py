"""``fused_linear_cross_entropy`` (and ``FusedLinearCrossEntropyLoss``) against the unfused float64 oracle.

Tolerance rule: the op's error against ``fused_linear_cross_entropy_ref`` on float64 copies must be at
most 2x the error of the same unfused computation done by PyTorch in the inputs' dtype, plus a small
atol, for the loss, the z-loss and the gradients of hidden, weight and bias. Both CPU paths (reference,
Triton interpreter); chunk sizes are small so every case walks several chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from culmen.flash_attn.losses.cross_entropy import FusedLinearCrossEntropyLoss
from culmen.ops.cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_ref
from culmen.ops.cross_entropy import launch as ce_launch
from culmen.ops.cross_entropy.fused_linear import TUNING, default_chunk_rows
from culmen.testing import assert_close_tolerance, make_noncontiguous, poison_, randn

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    request.getfixturevalue(f"{request.param}_backend")
    monkeypatch.setattr(ce_launch, "_alloc", lambda shape, dtype, device: poison_(torch.empty(shape, dtype=dtype,
                                                                                             device=device)))
    return request.param


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
]


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


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tolerance_rule(backend, case):
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
    """The default chunk comes from a byte budget: 512 tokens at V=128256 bf16 (a 131 MB buffer)."""
    assert default_chunk_rows(8192, 128256, BF16) == 512
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
