"""``culmen.contrib.transducer.TransducerLoss`` (Apex's ``apex.contrib.transducer``): the RNN-T loss and
its gradient against a float64 cell-by-cell oracle (``rnnt_loss_ref`` with autograd), dense and packed
logits, blank not 0, odd lengths, fp32/fp16/bf16, both backends (reference, Triton kernels under the
interpreter), ``fuse_softmax_backward=False``, ``debug_list``, torchaudio where importable, bad
arguments."""

from __future__ import annotations

import pytest
import torch

from culmen.contrib.transducer import TransducerLoss
from culmen.ops.backend import use_backend
from culmen.ops.transducer import rnnt_loss_ref
from culmen.testing import assert_close_tolerance, poisoned_allocations, randn

BACKENDS = ["reference", "triton"]


def _inputs(dtype=torch.float32, B=3, T=6, U=5, K=7, blank=3, device="cpu"):
    x = randn((B, T, U, K), dtype, device, 1.5, requires_grad=True)
    label = torch.randint(0, K - 1, (B, U - 1), dtype=torch.int32, device=device)
    label = torch.where(label >= blank, label + 1, label)  # labels are never the blank
    f_len = torch.tensor([T, 3, 5][:B], dtype=torch.int32, device=device)
    y_len = torch.tensor([2, U - 1, 0][:B], dtype=torch.int32, device=device)
    return x, label, f_len, y_len


def _pack(x, f_len, y_len):
    rows = [x[b, :int(f_len[b]), :int(y_len[b]) + 1].reshape(-1, x.shape[-1]) for b in range(x.shape[0])]
    return torch.cat(rows).detach().clone().requires_grad_(True), torch.cumsum(f_len * (y_len + 1), 0)


def _unpack(xp, f_len, y_len, T, U):
    out = torch.zeros((len(f_len), T, U, xp.shape[-1]), dtype=xp.dtype)
    row = 0
    for b in range(len(f_len)):
        n = int(f_len[b]) * (int(y_len[b]) + 1)
        out[b, :int(f_len[b]), :int(y_len[b]) + 1] = xp[row:row + n].view(int(f_len[b]), int(y_len[b]) + 1, -1)
        row += n
    return out, row


def _oracle(x, label, f_len, y_len, blank, lg, dtype):
    xr = x.detach().to(dtype).requires_grad_(True)
    loss = rnnt_loss_ref(xr, label, f_len, y_len, blank)
    (dx,) = torch.autograd.grad((loss * lg.to(dtype)).sum(), xr)
    return loss, dx


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,packed,fuse", [(torch.float32, False, True), (torch.float16, True, True),
                                               (torch.bfloat16, False, False), (torch.float32, True, False)])
def test_loss_and_gradient_match_oracle(backend, dtype, packed, fuse):
    blank = 3
    x, label, f_len, y_len = _inputs(dtype, blank=blank)
    lg = torch.tensor([0.5, -1.25, 2.0])  # any sign: Apex takes log(loss_grad), culmen does not
    crit = TransducerLoss(fuse_softmax_backward=fuse, packed_input=packed)
    with use_backend(backend), poisoned_allocations():
        if packed:
            xp, boff = _pack(x, f_len, y_len)
            loss = crit(xp, label, f_len, y_len, blank, batch_offset=boff, max_f_len=int(f_len.max()))
            (dxp,) = torch.autograd.grad((loss * lg.to(dtype)).sum(), xp)
            dx, n = _unpack(dxp, f_len, y_len, x.shape[1], x.shape[2])
            assert n == dxp.shape[0]
        else:
            loss = crit(x, label, f_len, y_len, blank)
            (dx,) = torch.autograd.grad((loss * lg.to(dtype)).sum(), x)
    assert loss.shape == (3,) and loss.dtype == dtype and dx.dtype == dtype
    hi = _oracle(x, label, f_len, y_len, blank, lg, torch.float64)
    lo = _oracle(x, label, f_len, y_len, blank, lg, dtype)
    assert_close_tolerance(loss, hi[0], lo[0], name="loss")
    assert_close_tolerance(dx, hi[1], lo[1], name="dx")
    # rows outside the lengths get exactly zero gradient (dense: written by the kernel, not left over)
    assert dx[1, 3:].abs().max() == 0 and dx[2, :, 1:].abs().max() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_blank_zero_last_and_debug_list(backend):
    K = 5
    x, label, f_len, y_len = _inputs(torch.float32, B=2, T=4, U=3, K=K, blank=0)
    label, f_len, y_len = label.clamp(1, K - 1).long(), f_len.long(), y_len.long()  # int64 works too
    for blank in (0, K - 1):
        lab = label if blank == 0 else label.clamp(0, K - 2)
        dbg: list = []
        with use_backend(backend):
            loss = TransducerLoss()(x, lab, f_len, y_len, blank, debug_list=dbg)
        ref = rnnt_loss_ref(x.detach().double(), lab, f_len, y_len, blank)
        assert_close_tolerance(loss, ref, None, name=f"loss blank={blank}")
        alpha, beta = dbg
        assert alpha.shape == beta.shape == (2, 4, 3) and alpha.dtype == torch.float32
        for b in range(2):
            fl, yl = int(f_len[b]), int(y_len[b])
            assert alpha[b, 0, 0] == 0
            torch.testing.assert_close(beta[b, 0, 0], -loss[b])
            lp = torch.log_softmax(x.detach()[b, fl - 1, yl], -1)[blank]
            torch.testing.assert_close(alpha[b, fl - 1, yl] + lp, -loss[b])


def test_no_grad_call_and_non_contiguous_logits(triton_backend):
    x, label, f_len, y_len = _inputs(torch.float32)
    wide = randn((3, 6, 5, 9))
    wide[..., :7] = x.detach()
    with torch.no_grad():
        loss = TransducerLoss()(wide[..., :7], label, f_len, y_len, 3)
    ref = rnnt_loss_ref(x.detach().double(), label, f_len, y_len, 3)
    assert_close_tolerance(loss, ref, None, name="loss")


def test_plain_pytorch_benchmark_peer_is_a_correct_loss():
    from culmen.bench.transducer import rnnt_loss_torch

    x, label, f_len, y_len = _inputs(torch.float32, blank=0)
    label = label.clamp(min=1)
    loss = rnnt_loss_torch(x, label, f_len, y_len, 0)
    (dx,) = torch.autograd.grad(loss.sum(), x)
    hi = _oracle(x, label, f_len, y_len, 0, torch.ones(3), torch.float64)
    torch.testing.assert_close(loss.double(), hi[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), hi[1], rtol=1e-4, atol=1e-5)


def test_matches_torchaudio_when_installed():
    ta = pytest.importorskip("torchaudio.functional")
    x, label, f_len, y_len = _inputs(torch.float32, blank=6)
    loss = TransducerLoss()(x, label, f_len, y_len, 6)
    (dx,) = torch.autograd.grad(loss.sum(), x)
    xr = x.detach().clone().requires_grad_(True)
    ref = ta.rnnt_loss(xr, label, f_len, y_len, blank=6, reduction="none")
    (dref,) = torch.autograd.grad(ref.sum(), xr)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dref, rtol=1e-4, atol=1e-5)


def test_bad_arguments():
    x, label, f_len, y_len = _inputs(torch.float32)
    crit = TransducerLoss()
    with pytest.raises(ValueError, match="f_len must be in"):
        crit(x, label, torch.tensor([7, 3, 5]), y_len, 3)
    with pytest.raises(ValueError, match="f_len must be in"):
        crit(x, label, torch.tensor([0, 3, 5]), y_len, 3)
    with pytest.raises(ValueError, match="y_len must be in"):
        crit(x, label, f_len, torch.tensor([2, 5, 0]), 3)
    with pytest.raises(ValueError, match="blank_idx must be an int in"):
        crit(x, label, f_len, y_len, 7)
    with pytest.raises(ValueError, match="blank_idx must be an int in"):
        crit(x, label, f_len, y_len, -1)
    with pytest.raises(ValueError, match="label values must be in"):
        crit(x, label.clone().fill_(9), f_len, y_len, 3)
    with pytest.raises(ValueError, match="label must have at least"):
        crit(x, label[:, :2], f_len, y_len, 3)
    with pytest.raises(TypeError, match="label must be an integer tensor"):
        crit(x, label.float(), f_len, y_len, 3)
    with pytest.raises(ValueError, match="y_len must have shape"):
        crit(x, label, f_len, y_len[:2], 3)
    with pytest.raises(ValueError, match="x must be 4-D"):
        crit(x[0], label, f_len, y_len, 3)
    packed = TransducerLoss(packed_input=True)
    xp, boff = _pack(x, f_len, y_len)
    with pytest.raises(ValueError, match="batch_offset and max_f_len"):
        packed(xp, label, f_len, y_len, 3)
    with pytest.raises(ValueError, match="batch_offset must be cumsum"):
        packed(xp, label, f_len, y_len, 3, batch_offset=boff - 1, max_f_len=6)
    with pytest.raises(ValueError, match="f_len must be in"):
        packed(xp, label, f_len, y_len, 3, batch_offset=boff, max_f_len=5)
    with pytest.raises(ValueError, match="x has 30 rows but the lengths need"):
        packed(xp[:30], label, f_len, y_len, 3, batch_offset=boff, max_f_len=6)
    with pytest.raises(ValueError, match="opt must be"):
        TransducerLoss(opt=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_loss_gpu(dtype, packed):
    dev = "cuda"
    B, T, U, K, blank = 5, 51, 25, 16, 15
    x = randn((B, T, U, K), dtype, dev, 2.0, requires_grad=True)
    label = torch.randint(0, blank, (B, U - 1), dtype=torch.int32, device=dev)
    f_len = torch.tensor([T, 23, 40, 31, 50], dtype=torch.int32, device=dev)
    y_len = torch.tensor([11, U - 1, 17, 12, 0], dtype=torch.int32, device=dev)
    lg = torch.full((B,), 1.0 / B, device=dev)
    crit = TransducerLoss(packed_input=packed)
    if packed:
        xp, boff = _pack(x, f_len, y_len)
        loss = crit(xp, label, f_len, y_len, blank, batch_offset=boff, max_f_len=T)
        (dxp,) = torch.autograd.grad((loss * lg.to(dtype)).sum(), xp)
        dx, _ = _unpack(dxp.cpu(), f_len.cpu(), y_len.cpu(), T, U)
    else:
        loss = crit(x, label, f_len, y_len, blank)
        (dx,) = torch.autograd.grad((loss * lg.to(dtype)).sum(), x)
    cpu = [t.cpu() for t in (x, label, f_len, y_len)]
    # the float64 oracle is the reference path (itself checked against the cell-by-cell oracle above)
    from culmen.ops.transducer.reference import rnnt_loss_bwd_ref, rnnt_loss_fwd_ref

    xd = cpu[0].detach().double()
    saved = rnnt_loss_fwd_ref(xd, cpu[1], cpu[2], cpu[3], blank, None, T, False)
    loss_hi = saved.pop("loss")
    dx_hi = rnnt_loss_bwd_ref(lg.cpu().double(), xd, cpu[1], cpu[2], cpu[3], blank, None, T, False, saved)
    xf = cpu[0].detach().float()
    saved_lo = rnnt_loss_fwd_ref(xf, cpu[1], cpu[2], cpu[3], blank, None, T, False)
    loss_lo = saved_lo.pop("loss")
    # fp32 log-space recursions over T + U steps: the budget is what the same fp32 computation in PyTorch makes
    dx_lo = rnnt_loss_bwd_ref(lg.cpu().float(), xf, cpu[1], cpu[2], cpu[3], blank, None, T, False, saved_lo)
    assert_close_tolerance(loss.cpu(), loss_hi, loss_lo.to(dtype), name="loss")
    assert_close_tolerance(dx.cpu(), dx_hi, dx_lo.to(dtype), name="dx")


def test_apex_loss_reference():
    """``_transducer_ref.transducer_loss_reference`` (Apex's test oracle) against the textbook float64 loss:
    the loss, ``loss_grad``-weighted gradient, ``beta[:, 0, 0] = -loss``, ``alpha[:, 0, 0] = 0``, and both
    lattices zero outside ``t < f_len``, ``u <= y_len``."""
    from culmen.contrib.transducer._transducer_ref import transducer_loss_reference

    x, label, f_len, y_len = _inputs(torch.float64)
    B, T, U, _ = x.shape
    lg = torch.rand(B, dtype=torch.float64) + 0.5
    alpha, beta, dx, loss = transducer_loss_reference(x, label, f_len, y_len, 3, lg)
    want_loss, want_dx = _oracle(x, label, f_len, y_len, 3, lg, torch.float64)
    assert x.grad is None and loss.dtype == dx.dtype == torch.float64 and alpha.shape == beta.shape == (B, T, U)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dx, want_dx, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(beta[:, 0, 0], -want_loss, rtol=1e-10, atol=1e-10)
    assert bool((alpha[:, 0, 0] == 0).all())
    for b in range(B):
        fl, yl = int(f_len[b]), int(y_len[b])
        assert bool((alpha[b, fl:] == 0).all() and (alpha[b, :, yl + 1:] == 0).all())
        assert bool((beta[b, fl:] == 0).all() and (beta[b, :, yl + 1:] == 0).all())
        # The last node emits the final blank: beta there is that blank's log-probability.
        want_end = torch.log_softmax(x.detach()[b, fl - 1, yl], -1)[3]
        torch.testing.assert_close(beta[b, fl - 1, yl], want_end, rtol=1e-12, atol=1e-12)
    assert transducer_loss_reference(x.float(), label, f_len, y_len, 3, lg.float())[0].dtype == torch.float32
