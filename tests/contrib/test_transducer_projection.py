"""``rnnt_projection_loss`` / ``TransducerProjectionLoss`` (culmen's fused vocabulary projection + RNN-T loss):
loss and gradients of ``h``, ``weight`` and ``bias`` against a float64 oracle (``F.linear`` then the cell-by-cell
textbook loss, differentiated by autograd), dense and packed joint outputs, odd sizes, fp32 / fp16 / bf16,
chunks of one row, of a few rows that split a sequence, and of everything; both backends; frozen weights;
bad arguments; the alias import path; and on a GPU a medium shape's values and peak memory."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from culmen.contrib.transducer import TransducerProjectionLoss
from culmen.ops.backend import use_backend
from culmen.ops.transducer import projection as proj
from culmen.ops.transducer import rnnt_loss, rnnt_loss_ref, rnnt_projection_loss
from culmen.testing import assert_close_tolerance, poisoned_allocations, randn
from tests.contrib.fresh_python import run_python

B, T, U, H, K, BLANK = 3, 6, 5, 7, 11, 3
LG = (0.5, -1.25, 2.0)  # per-batch loss weights of any sign


@pytest.fixture
def chunk_rows():
    """Set the chunk to ``n`` rows of logits (through the tuning table) for the test, then restore it."""
    saved = proj.TUNING["chunk_bytes"]

    def set_rows(n: int, itemsize: int) -> None:
        proj.TUNING["chunk_bytes"] = n * K * itemsize

    yield set_rows
    proj.TUNING["chunk_bytes"] = saved


def _inputs(dtype, device="cpu"):
    h = randn((B, T, U, H), dtype, device, 1.0, requires_grad=True)
    w = randn((K, H), dtype, device, 0.6, requires_grad=True)
    b = randn((K,), dtype, device, 0.5, requires_grad=True)
    label = torch.randint(0, K - 1, (B, U - 1), dtype=torch.int32, device=device)
    label = torch.where(label >= BLANK, label + 1, label)
    f_len = torch.tensor([T, 3, 5], dtype=torch.int32, device=device)
    y_len = torch.tensor([2, U - 1, 0], dtype=torch.int32, device=device)
    return h, w, b, label, f_len, y_len


def _pack(h, f_len, y_len, extra: int = 0):
    """The valid rows of ``h`` in the packed order (plus ``extra`` junk rows no batch owns)."""
    rows = [h[b, :int(f_len[b]), :int(y_len[b]) + 1].reshape(-1, h.shape[-1]) for b in range(h.shape[0])]
    junk = torch.full((extra, h.shape[-1]), 7.0, dtype=h.dtype)
    hp = torch.cat(rows + [junk]).detach().clone().requires_grad_(True)
    return hp, torch.cumsum(f_len.long() * (y_len.long() + 1), 0)


def _unpack(dp, f_len, y_len):
    out = torch.zeros((B, T, U, dp.shape[-1]), dtype=dp.dtype)
    row = 0
    for b in range(B):
        fl, ul = int(f_len[b]), int(y_len[b]) + 1
        out[b, :fl, :ul] = dp[row:row + fl * ul].view(fl, ul, -1)
        row += fl * ul
    return out, row


def _oracle(h, w, b, label, f_len, y_len, dtype, with_bias=True):
    """``F.linear`` then the textbook loss in ``dtype``, differentiated by autograd: ``(loss, dh, dw, db)``."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (h, w, b)]
    logits = F.linear(leaves[0], leaves[1], leaves[2] if with_bias else None)
    loss = rnnt_loss_ref(logits, label, f_len, y_len, BLANK)
    grads = torch.autograd.grad((loss * torch.tensor(LG, dtype=dtype)).sum(), leaves, allow_unused=True)
    return (loss, *grads)


def _run(h, w, b, label, f_len, y_len, packed, with_bias=True, module=False):
    """The fused op on dense or packed ``h``: ``(loss, dh (dense layout), dw, db)``."""
    bias = b if with_bias else None
    if packed:
        hp, boff = _pack(h, f_len, y_len, extra=2)
        if module:
            loss = TransducerProjectionLoss(packed_input=True)(hp, w, bias, label, f_len, y_len, BLANK, boff, T)
        else:
            loss = rnnt_projection_loss(hp, w, bias, label, f_len, y_len, BLANK, boff, T, packed_input=True)
        leaves = (hp, w, b) if with_bias else (hp, w)
    else:
        if module:
            loss = TransducerProjectionLoss()(h, w, bias, label, f_len, y_len, BLANK)
        else:
            loss = rnnt_projection_loss(h, w, bias, label, f_len, y_len, BLANK)
        leaves = (h, w, b) if with_bias else (h, w)
    grads = torch.autograd.grad((loss * torch.tensor(LG, dtype=loss.dtype)).sum(), leaves)
    dh = grads[0]
    if packed:
        dh, n = _unpack(grads[0], f_len, y_len)
        assert n + 2 == grads[0].shape[0]
        assert grads[0][n:].abs().max() == 0  # rows no batch owns get zero gradient
    return (loss, dh, *grads[1:])


@pytest.mark.parametrize("dtype,packed,rows,with_bias", [
    (torch.float32, False, 7, True),     # chunks of 7 rows split the (t, u) rows of a time step and a batch
    (torch.float32, True, 1, False),     # one row per chunk
    (torch.float16, False, 10_000, True),  # one chunk holds everything
    (torch.float16, True, 5, True),
    (torch.bfloat16, True, 16, True),
])
def test_matches_float64_oracle(triton_backend, chunk_rows, dtype, packed, rows, with_bias):
    chunk_rows(rows, dtype.itemsize)
    h, w, b, label, f_len, y_len = _inputs(dtype)
    with poisoned_allocations():
        out = _run(h, w, b, label, f_len, y_len, packed, with_bias)
    loss = out[0]
    n_rows = int((f_len * (y_len + 1)).sum()) + 2 if packed else B * T * U
    assert [p.chunk for p in proj.PLANS.values()] == [min(rows, n_rows)]  # the chunking the test asked for
    assert loss.shape == (B,) and loss.dtype == dtype and all(g.dtype == dtype for g in out[1:])
    hi = _oracle(h, w, b, label, f_len, y_len, torch.float64, with_bias)
    lo = _oracle(h, w, b, label, f_len, y_len, dtype, with_bias)
    for name, got, ref_hi, ref_lo in zip(("loss", "dh", "dweight", "dbias"), out, hi, lo):
        assert_close_tolerance(got, ref_hi, ref_lo, name=name)
    dh = out[1]
    # rows outside the lengths (dense: the joint's -1 filler rows) get exactly zero gradient
    assert dh[1, 3:].abs().max() == 0 and dh[2, :, 1:].abs().max() == 0


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("packed", [False, True])
def test_equals_unfused_projection_then_loss(chunk_rows, backend, packed):
    """Same numbers as ``rnnt_loss(F.linear(h, W, b))`` (fp32), and through the module."""
    chunk_rows(4, 4)
    h, w, b, label, f_len, y_len = _inputs(torch.float32)
    with use_backend(backend):
        fused = _run(h, w, b, label, f_len, y_len, packed, module=True)
        loss = rnnt_loss(F.linear(h, w, b), label, f_len, y_len, BLANK)
    unfused = (loss, *torch.autograd.grad((loss * torch.tensor(LG)).sum(), (h, w, b)))
    for name, got, want in zip(("loss", "dh", "dweight", "dbias"), fused, unfused):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=name)


def test_float64_takes_the_reference_path(triton_backend):
    """fp64 runs the reference path even on the Triton backend, equal to the oracle."""
    h, w, b, label, f_len, y_len = _inputs(torch.float64)
    out = _run(h, w, b, label, f_len, y_len, packed=True)
    hi = _oracle(h, w, b, label, f_len, y_len, torch.float64)
    for name, got, want in zip(("loss", "dh", "dweight", "dbias"), out, hi):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)


def test_frozen_weight_and_no_grad(triton_backend, chunk_rows):
    """With a frozen weight and no bias only ``dh`` is formed; without autograd the same loss comes back."""
    chunk_rows(6, 4)
    h, w, _, label, f_len, y_len = _inputs(torch.float32)
    w = w.detach()
    loss = rnnt_projection_loss(h, w, None, label, f_len, y_len, BLANK)
    (dh,) = torch.autograd.grad(loss.sum(), h)
    hd = h.detach().double().requires_grad_(True)
    want = rnnt_loss_ref(F.linear(hd, w.double()), label, f_len, y_len, BLANK)
    (dh_hi,) = torch.autograd.grad(want.sum(), hd)
    hl = h.detach().requires_grad_(True)
    want_lo = rnnt_loss_ref(F.linear(hl, w), label, f_len, y_len, BLANK)
    (dh_lo,) = torch.autograd.grad(want_lo.sum(), hl)
    assert_close_tolerance(loss, want, want_lo, name="loss")
    assert_close_tolerance(dh, dh_hi, dh_lo, name="dh")
    with torch.no_grad():
        again = rnnt_projection_loss(h, w, None, label, f_len, y_len, BLANK)
    assert again.grad_fn is None
    torch.testing.assert_close(again, loss.detach(), rtol=0, atol=0)


def test_bad_arguments():
    h, w, b, label, f_len, y_len = (t.detach() for t in _inputs(torch.float32))
    cases = [
        (TypeError, "h must be", dict(h=h.long())),
        (ValueError, "h must be 4-D", dict(h=h[0])),
        (ValueError, "weight must have shape", dict(w=w[:, :-1])),
        (TypeError, "weight must have h's dtype", dict(w=w.double())),
        (ValueError, "bias must have shape", dict(b=b[:-1])),
        (TypeError, "bias must have h's dtype", dict(b=b.half())),
        (TypeError, "label must be an integer", dict(label=label.float())),
        (ValueError, "blank_idx must be", dict(blank=K)),
        (ValueError, "f_len must have shape", dict(f_len=f_len[:2])),
        (ValueError, "f_len must be in", dict(f_len=torch.tensor([T + 1, 3, 5]))),
        (ValueError, "y_len must be in", dict(y_len=torch.tensor([2, U, 0]))),
        (ValueError, "label values must be in", dict(label=torch.full_like(label, K))),
    ]
    for exc, msg, kw in cases:
        args = dict(h=h, w=w, b=b, label=label, f_len=f_len, y_len=y_len, blank=BLANK) | kw
        with pytest.raises(exc, match=msg):
            rnnt_projection_loss(args["h"], args["w"], args["b"], args["label"], args["f_len"], args["y_len"],
                                 args["blank"])
    hp, boff = _pack(h, f_len, y_len)
    with pytest.raises(ValueError, match="max_f_len"):
        rnnt_projection_loss(hp, w, b, label, f_len, y_len, BLANK, boff, None, packed_input=True)
    with pytest.raises(ValueError, match="batch_offset must be cumsum"):
        rnnt_projection_loss(hp, w, b, label, f_len, y_len, BLANK, boff + 1, T, packed_input=True)
    with pytest.raises(ValueError, match="rows but the lengths need"):
        rnnt_projection_loss(hp[:-1], w, b, label, f_len, y_len, BLANK, boff, T, packed_input=True)
    with pytest.raises(ValueError, match="batch_offset and max_f_len"):
        TransducerProjectionLoss(packed_input=True)(hp, w, b, label, f_len, y_len, BLANK)


def test_import_through_the_apex_alias():
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        from apex.contrib.transducer import TransducerProjectionLoss, TransducerLoss
        import culmen.contrib.transducer as ct
        assert TransducerProjectionLoss is ct.TransducerProjectionLoss and TransducerLoss is ct.TransducerLoss
        print("OK")
    """)
    assert run_python(code) == "OK"


@pytest.mark.gpu
@pytest.mark.parametrize("packed,chunk_mib", [(False, None), (True, 8)])  # None: the default chunk
def test_gpu_values_and_peak_memory(packed, chunk_mib):
    saved = proj.TUNING["chunk_bytes"]
    if chunk_mib is not None:
        proj.TUNING["chunk_bytes"] = chunk_mib << 20
    try:
        _values_and_peak_memory(torch.device("cuda"), packed, (8, 300, 60, 256, 1024))
    finally:
        proj.TUNING["chunk_bytes"] = saved


def _values_and_peak_memory(dev: torch.device, packed: bool, shape: tuple[int, ...]) -> None:
    """fp16 fwd+bwd at ``shape = (B, T, U, H, K)``: values against the float64 reference (the whole logits,
    the vectorized reference loss, autograd through ``F.linear``) and, on CUDA, the peak memory. Beyond the
    inputs the op may hold ``dh`` (``h``'s size), one chunk of logits (``TUNING["chunk_bytes"]``), the five
    ``(B, T, U)`` fp32 statistics and three ``(K, H)`` fp32 weight-gradient buffers, plus 4 MiB for small
    tensors and allocator rounding; and at most half of what the unfused logits and their gradient take."""
    Bg, Tg, Ug, Hg, Kg = shape
    blank = 0
    gen = torch.Generator().manual_seed(1)
    f_len = torch.randint(Tg // 2, Tg + 1, (Bg,), generator=gen, dtype=torch.int32)
    y_len = torch.randint((Ug - 1) // 2, Ug, (Bg,), generator=gen, dtype=torch.int32)
    f_len[0], y_len[-1] = Tg, Ug - 1
    label = torch.randint(1, Kg, (Bg, Ug - 1), generator=gen, dtype=torch.int32)
    f_len, y_len, label = f_len.to(dev), y_len.to(dev), label.to(dev)
    boff = torch.cumsum(f_len.long() * (y_len.long() + 1), 0)
    rows = int(boff[-1])
    dense = randn((Bg, Tg, Ug, Hg), torch.float16, dev, 1.0)
    t = torch.arange(Tg, device=dev).view(1, Tg, 1)
    u = torch.arange(Ug, device=dev).view(1, 1, Ug)
    inside = (t < f_len.view(-1, 1, 1)) & (u <= y_len.view(-1, 1, 1))
    h = (dense[inside] if packed else torch.where(inside.unsqueeze(-1), dense, -1.0)).requires_grad_(True)
    w = randn((Kg, Hg), torch.float16, dev, Hg ** -0.5, requires_grad=True)
    b = randn((Kg,), torch.float16, dev, 0.1, requires_grad=True)
    lg = torch.rand((Bg,), device=dev) + 0.5
    extra = dict(batch_offset=boff, max_f_len=Tg) if packed else {}
    crit = TransducerProjectionLoss(packed_input=packed)

    def step():
        loss = crit(h, w, b, label, f_len, y_len, blank, **extra)
        return (loss, *torch.autograd.grad((loss.float() * lg).sum(), (h, w, b)))

    step()  # warm-up: compiles, cuBLAS workspaces
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        n = rows if packed else Bg * Tg * Ug
        chunk = min(proj.TUNING["chunk_bytes"], n * Kg * 2)
        # The criterion against the unfused pipeline (logits, their gradient and dh beyond the inputs):
        # at most half of it. (The H200 run measured 234 MiB dense / 89 MiB packed here, against 632 / ~450.)
        unfused = 2 * n * Kg * 2 + h.numel() * 2
        assert peak <= unfused // 2, (f"peak {peak / 2**20:.1f} MiB > half the unfused {unfused / 2**20:.1f} MiB "
                                      f"(chunk {chunk / 2**20:.1f} MiB)")

    # float64 reference: whole logits, the vectorized reference loss, autograd through F.linear
    def reference(dtype):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (h, w, b)]
        logits = F.linear(*leaves)
        with use_backend("reference"):
            if packed:
                loss = rnnt_loss(logits, label, f_len, y_len, blank, boff, Tg, packed_input=True)
            else:
                loss = rnnt_loss(logits, label, f_len, y_len, blank)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        return (loss, *torch.autograd.grad((loss.to(acc) * lg.to(acc)).sum(), leaves))

    hi, lo = reference(torch.float64), reference(torch.float16)
    for name, got, ref_hi, ref_lo in zip(("loss", "dh", "dweight", "dbias"), out, hi, lo):
        assert_close_tolerance(got, ref_hi, ref_lo, name=name)
