"""FusedSGD and FusedAdagrad against torch.optim.SGD / Adagrad in lockstep (reference path and interpreter)."""

from __future__ import annotations

import pytest
import torch

from culmen.ops.backend import use_backend
from culmen.optimizers import FusedAdagrad, FusedSGD


@pytest.mark.parametrize("cfg", [
    dict(momentum=0.9, dampening=0.0, weight_decay=0.05, nesterov=True),
    dict(momentum=0.8, dampening=0.3, weight_decay=0.0, nesterov=False),
    dict(momentum=0.0, weight_decay=0.1),
])
def test_sgd_matches_torch(backend, lockstep, cfg):
    a = lockstep.params()
    b = lockstep.copies(a)
    ours = FusedSGD(a, lr=0.05, **cfg)
    ref = torch.optim.SGD(b, lr=0.05, **cfg)
    lockstep.run(ours, ref, a, b, steps=7)
    lockstep.assert_close(a, b, what="param")
    if cfg["momentum"]:
        lockstep.assert_close([ours.state[p]["momentum_buffer"] for p in a],
                              [ref.state[p]["momentum_buffer"] for p in b], what="buf")
    else:
        assert all(len(ours.state[p]) == 0 for p in a)


def test_sgd_late_grads_groups_dtypes(backend, lockstep):
    """A param whose gradient first appears at step 3 (its own first-run update), two groups, fp16/bf16."""
    a = lockstep.params(dtypes=[torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float32])
    b = lockstep.copies(a, torch.float32)
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.02, "momentum": 0.5, "dampening": 0.5}]
    ours = FusedSGD(groups(a), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref = torch.optim.SGD(groups(b), lr=0.1, momentum=0.9, weight_decay=0.01)
    for s in range(6):
        gs = lockstep.grads(a)
        if s < 3:
            gs[4] = None
        lockstep.set_grads(a, gs)
        lockstep.set_grads(b, gs)
        ours.step()
        ref.step()
        with torch.no_grad():  # the fp32 reference follows the 16-bit params' rounding
            for p, q in zip(a, b):
                q.copy_(p)
    for p, q in zip(a, b):
        buf, rbuf = ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"]
        assert buf.dtype == p.dtype  # torch.optim.SGD's layout: the buffer has the param's dtype
        # a 16-bit buffer is rounded at every step: a few ulps of its largest value over 6 steps
        ulp = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[p.dtype]
        torch.testing.assert_close(buf.float(), rbuf, rtol=0, atol=8 * ulp * float(rbuf.abs().max()))


def test_sgd_wd_after_momentum(backend, lockstep):
    """wd_after_momentum: buf accumulates the raw gradient, the decay is added to the step (fp64 oracle)."""
    a = lockstep.params()
    ref = [p.detach().double() for p in a]
    bufs = [None] * len(a)
    opt = FusedSGD(a, lr=0.1, momentum=0.9, weight_decay=0.2, wd_after_momentum=True)
    for _ in range(4):
        gs = lockstep.grads(a)
        lockstep.set_grads(a, gs)
        opt.step()
        for i, g in enumerate(gs):
            g = g.double()
            bufs[i] = g.clone() if bufs[i] is None else 0.9 * bufs[i] + g
            ref[i] = ref[i] - 0.1 * (bufs[i] + 0.2 * ref[i])
    lockstep.assert_close(a, ref, what="param")


def test_sgd_grad_scaler(backend, lockstep):
    """Overflow on the very first step (momentum buffers must stay "first"), then normal steps."""
    for dampening in (0.0, 0.25):
        a = lockstep.params()
        b = lockstep.copies(a)
        ours = FusedSGD(a, lr=0.05, momentum=0.9, dampening=dampening)
        ref = torch.optim.SGD(b, lr=0.05, momentum=0.9, dampening=dampening)
        sc_o = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
        sc_r = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
        for it in range(4):
            gs = lockstep.grads(a)
            for opt, ps, sc in ((ours, a, sc_o), (ref, b, sc_r)):
                for p in ps:
                    p.grad = None
                sc.scale(sum((p * g).sum() for p, g in zip(ps, gs))).backward()
                if it in (0, 2):
                    ps[2].grad.view(-1)[3] = float("inf")
                sc.step(opt)
                sc.update()
        lockstep.assert_close(a, b, what="param")
        lockstep.assert_close([ours.state[p]["momentum_buffer"] for p in a],
                              [ref.state[p]["momentum_buffer"] for p in b], what="buf")


def test_adagrad_matches_torch(backend, lockstep):
    a = lockstep.params()
    b = lockstep.copies(a)
    ours = FusedAdagrad([{"params": a[:2]}, {"params": a[2:], "lr": 0.03, "weight_decay": 0.0}], lr=0.1,
                        weight_decay=0.05, eps=1e-8)
    ref = torch.optim.Adagrad([{"params": b[:2]}, {"params": b[2:], "lr": 0.03, "weight_decay": 0.0}], lr=0.1,
                              weight_decay=0.05, eps=1e-8)
    lockstep.run(ours, ref, a, b, steps=7, frozen=(1,))
    lockstep.assert_close(a, b, what="param")
    lockstep.assert_close([ours.state[p]["sum"] for p in a if p is not a[1]],
                          [ref.state[p]["sum"] for p in b if p is not b[1]], what="sum")


def test_adagrad_decoupled_and_16bit(backend, lockstep):
    """adagrad_w_mode against an fp64 oracle; bf16 params keep an fp32 accumulator."""
    a = lockstep.params(dtypes=[torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32])
    ref = [p.detach().double() for p in a]
    sums = [torch.zeros_like(r) for r in ref]
    opt = FusedAdagrad(a, lr=0.05, weight_decay=0.1, adagrad_w_mode=True)
    for _ in range(3):
        with torch.no_grad():
            ref = [p.detach().double() for p in a]  # restart from the (rounded) params
        gs = lockstep.grads(a)
        lockstep.set_grads(a, gs)
        opt.step()
        for i, g in enumerate(gs):
            g = g.double()
            sums[i] += g * g
            ref[i] = ref[i] - 0.05 * (g / (sums[i].sqrt() + 1e-10) + 0.1 * ref[i])
    for p, r in zip(a, ref):
        tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[p.dtype]
        torch.testing.assert_close(p.detach().double(), r, rtol=tol, atol=tol)
        assert opt.state[p]["sum"].dtype == torch.float32


@pytest.mark.parametrize("make, msg", [
    (lambda ps: FusedSGD(ps, lr=-0.1), "Invalid learning rate"),
    (lambda ps: FusedSGD(ps, lr=0.1, momentum=-0.5), "Invalid momentum value"),
    (lambda ps: FusedSGD(ps, lr=0.1, weight_decay=-1), "Invalid weight_decay value"),
    (lambda ps: FusedSGD(ps, lr=0.1, nesterov=True), "nesterov=True requires momentum > 0"),
    (lambda ps: FusedAdagrad(ps, lr=-1.0), "Invalid learning rate"),
    (lambda ps: FusedAdagrad(ps, eps=-1.0), "Invalid epsilon value"),
    (lambda ps: FusedAdagrad(ps, weight_decay=-1.0), "Invalid weight_decay value"),
])
def test_bad_arguments(lockstep, make, msg):
    with pytest.raises(ValueError, match=msg):
        make(lockstep.params())


def test_required_lr_and_sparse(lockstep):
    p = torch.randn(3, 3, requires_grad=True)
    p.grad = torch.randn(3, 3)
    with pytest.raises(ValueError, match="required optimization parameter lr"):  # torch.optim's check
        FusedSGD([p])
    p.grad = p.grad.to_sparse()
    for opt in (FusedSGD([p], lr=0.1), FusedAdagrad([p])):
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
    p.grad = torch.randn(3, 3)
    opt = FusedSGD([p], lr=0.1)
    opt.zero_grad()  # set_grad_none=False: zeroed, not dropped (Apex's default for FusedSGD)
    assert p.grad is not None and not p.grad.any()


def test_sgd_momentum_switched_on_later(backend, lockstep):
    """A cached step plan without momentum buffers must not survive ``momentum`` being set on the group."""
    a = lockstep.params()
    b = lockstep.copies(a)
    ours = FusedSGD(a, lr=0.05)
    ref = torch.optim.SGD(b, lr=0.05)
    lockstep.run(ours, ref, a, b, steps=3)
    for opt in (ours, ref):
        opt.param_groups[0]["momentum"] = 0.9
    lockstep.run(ours, ref, a, b, steps=3)
    lockstep.assert_close(a, b, what="param")


@pytest.mark.parametrize("backend_name, dtype", [("reference", torch.float16), ("triton", torch.float16),
                                                 ("reference", torch.bfloat16)])
def test_sgd_16bit_params_round_like_apex(backend_name, dtype):
    """16-bit params: the step ``-lr * g`` is rounded to the param dtype before the add, as Apex's kernel
    does (``weight += -lr * g`` on a Half weight). With Apex's test settings (power-of-two lr and momentum)
    this is torch.optim.SGD's fp16/bf16 result exactly; adding the fp32 step instead drifts by ~3 ulps in
    7 steps (Apex's test allows 1e-3). (Triton's CPU interpreter rounds fp32 -> bf16 toward zero, unlike a
    GPU: bf16 runs on the reference here, and on the kernel in test_optimizers_gpu.py.)"""
    with use_backend(backend_name):
        _sgd_16bit_round_like_apex(dtype)


def _sgd_16bit_round_like_apex(dtype):
    n = 20011
    gen = torch.Generator().manual_seed(9876)
    init = torch.rand(n, generator=gen).to(dtype)
    grads = [torch.rand(n, generator=gen).to(dtype) for _ in range(7)]
    p = torch.nn.Parameter(init.clone())
    q = torch.nn.Parameter(init.clone())
    ours = FusedSGD([p], lr=0.25, momentum=0.125)
    ref = torch.optim.SGD([q], lr=0.25, momentum=0.125)
    for g in grads:
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert torch.equal(p, q)
    assert torch.equal(ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])

    # Any lr / dampening / weight decay / nesterov: Apex's formula, written out in fp32 torch ops.
    cfg = dict(lr=0.3, momentum=0.9, dampening=0.1, weight_decay=0.01)
    p = torch.nn.Parameter(init.clone())
    opt = FusedSGD([p], **cfg)
    w, buf = init.clone(), None
    for g in grads[:4]:
        p.grad = g.clone()
        opt.step()
        gf = g.float() + cfg["weight_decay"] * w.float()
        m = gf if buf is None else buf.float() * cfg["momentum"] + (1 - cfg["dampening"]) * gf
        w = (w.float() + (-cfg["lr"] * m).to(dtype).float()).to(dtype)
        buf = m.to(dtype)
        assert torch.equal(p.detach(), w)
        assert torch.equal(opt.state[p]["momentum_buffer"], buf)
