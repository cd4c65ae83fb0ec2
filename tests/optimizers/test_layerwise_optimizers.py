"""FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad and FusedLARS against the float64 references of
``culmen.optimizers.reference`` in lockstep (reference path and Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from culmen.optimizers import FusedLAMB, FusedLARS, FusedMixedPrecisionLamb, FusedNovoGrad
from culmen.optimizers.reference import RefLAMB, RefLARS, RefMixedPrecisionLamb, RefNovoGrad

F64 = torch.float64
SMALL = ((1,), (5, 123), (2049,))


def _state(opt, params, key):
    return [opt.state[p][key] for p in params]


@pytest.mark.parametrize("cfg", [
    dict(weight_decay=0.01, adam_w_mode=True, max_grad_norm=1.0),
    dict(weight_decay=0.1, adam_w_mode=False, grad_averaging=False, max_grad_norm=50.0, bias_correction=False),
    dict(weight_decay=0.0, use_nvlamb=True, max_grad_norm=None),
])
def test_lamb(backend, lockstep, cfg):
    a = lockstep.params(lockstep.shapes if cfg.get("max_grad_norm") == 1.0 else SMALL)
    b = lockstep.copies(a, F64)
    k = len(a) - 2  # the first group holds a frozen param (index 0), the second has no weight decay
    ours = FusedLAMB([{"params": a[:k]}, {"params": a[k:], "weight_decay": 0.0, "lr": 5e-3}], lr=2e-2, **cfg)
    ref = RefLAMB([{"params": b[:k]}, {"params": b[k:], "weight_decay": 0.0, "lr": 5e-3}], lr=2e-2, **cfg)
    lockstep.run(ours, ref, a, b, steps=7, frozen=(0,))
    lockstep.assert_close(a, b, rtol=2e-5, atol=2e-5, what="param")
    live = list(range(1, len(a)))
    lockstep.assert_close(_state(ours, [a[i] for i in live], "exp_avg_sq"),
                          _state(ref, [b[i] for i in live], "exp_avg_sq"), rtol=2e-5, atol=1e-6, what="v")


def test_lamb_grad_scaler(backend, lockstep):
    """In-kernel unscale (the global norm is of the unscaled grads) and a skipped overflow step."""
    a = lockstep.params(SMALL)
    b = lockstep.copies(a, F64)
    ours = FusedLAMB(a, lr=1e-2, max_grad_norm=30.0)
    ref = RefMixedPrecisionLamb(b, lr=1e-2, max_grad_norm=30.0)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for it in range(4):
        gs = lockstep.grads(a)
        for p in a:
            p.grad = None
        sc.scale(sum((p * g).sum() for p, g in zip(a, gs))).backward()
        if it == 1:
            a[0].grad.fill_(float("inf"))
        sc.step(ours)
        sc.update()
        if it != 1:
            lockstep.set_grads(b, gs)
            ref.step()
    lockstep.assert_close(a, b, rtol=2e-5, atol=2e-5, what="param")
    assert int(ours.param_groups[0]["step"]) == 3


def test_mixed_precision_lamb(backend, lockstep):
    """bf16 params with fp32 masters (reduced_precision_dtype) next to fp32 params, vs a float64 oracle
    whose masters are float64 and whose updates are rounded to bf16 like the kernel's (stored over the
    bf16 gradient)."""
    dts = [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    a = lockstep.params(SMALL, dtypes=dts)
    b = lockstep.copies(a)
    init = [p.detach().clone() for p in a]
    ours = FusedMixedPrecisionLamb(a, lr=1e-2, weight_decay=0.05, reduced_precision_dtype=torch.bfloat16)
    ref = RefMixedPrecisionLamb(b, lr=1e-2, weight_decay=0.05, reduced_precision_dtype=torch.bfloat16,
                                master_dtype=F64)
    assert isinstance(ours.param_groups[0]["lr"], torch.Tensor) and ours.param_groups[0]["step"].dtype == torch.int32
    lockstep.run(ours, ref, a, b, steps=7)
    masters = [ours.state[p].get("master_param", p) for p in a]
    rmasters = [ref.state[q].get("master_param", q) for q in b]
    for i, (m, r) in enumerate(zip(masters, rmasters)):
        # bf16 updates: where the kernel's rounding of an update differs from the oracle's by one ulp
        # (2^-8 relative; Triton's CPU interpreter truncates, 2^-7), so may the step: bound the error by
        # that fraction of the total displacement
        moved = float((r.detach().double() - init[i].double()).abs().max())
        atol = 2.0 ** -6 * moved if a[i].dtype == torch.bfloat16 else 2e-5
        torch.testing.assert_close(m.double(), r.double(), rtol=1e-5, atol=atol, msg=f"master[{i}]")
        assert m.dtype == torch.float32
        assert ours.state[a[i]]["exp_avg"].dtype == torch.float32
    assert int(ours.param_groups[0]["step"]) == 7


def test_mixed_precision_lamb_grad_scaler(backend, lockstep):
    a = lockstep.params(SMALL)
    b = lockstep.copies(a, F64)
    ours = FusedMixedPrecisionLamb(a, lr=1e-2, step=3)
    ref = RefMixedPrecisionLamb(b, lr=1e-2, step=3)
    sc_o = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    sc_r = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for it in range(4):
        gs = lockstep.grads(a)
        for opt, ps, sc in ((ours, a, sc_o), (ref, b, sc_r)):
            for p in ps:
                p.grad = None
            sc.scale(sum((p * g.to(p.dtype)).sum() for p, g in zip(ps, gs))).backward()
            if it == 2:
                ps[2].grad.view(-1)[0] = float("nan")
            sc.step(opt)
            sc.update()
    lockstep.assert_close(a, b, rtol=2e-5, atol=2e-5, what="param")
    assert int(ours.param_groups[0]["step"]) == 3 + 3


@pytest.mark.parametrize("cfg", [
    dict(weight_decay=0.01),
    dict(weight_decay=0.1, reg_inside_moment=True, norm_type=0, grad_averaging=False),
    dict(init_zero=True, bias_correction=False, betas=(0.95, 0.98)),
])
def test_novograd(backend, lockstep, cfg):
    a = lockstep.params(SMALL)
    b = lockstep.copies(a, F64)
    ours = FusedNovoGrad(a, lr=1e-2, **cfg)
    ref = RefNovoGrad(b, lr=1e-2, **cfg)

    def grads(s):  # the last param gets its first gradient at step 3 (its own norm initialisation)
        gs = lockstep.grads(a)
        if s < 3:
            gs[-1] = None
        return gs

    lockstep.run(ours, ref, a, b, steps=7, grad_fn=grads)
    lockstep.assert_close(a, b, rtol=2e-5, atol=2e-5, what="param")
    lockstep.assert_close(_state(ours, a, "exp_avg_sq"), _state(ref, b, "exp_avg_sq"), rtol=2e-5, what="norm")


@pytest.mark.parametrize("cfg", [
    dict(momentum=0.9, weight_decay=0.01),
    dict(momentum=0.9, nesterov=True, weight_decay=0.05, eps=1e-6, trust_coefficient=0.02),
    dict(momentum=0.0, weight_decay=0.01),
])
def test_lars(backend, lockstep, cfg):
    a = lockstep.params(SMALL)
    b = lockstep.copies(a, F64)
    ours = FusedLARS([{"params": a[:2]}, {"params": a[2:], "is_skipped": True, "lr": 0.01}], lr=0.5, **cfg)
    ref = RefLARS([{"params": b[:2]}, {"params": b[2:], "is_skipped": True, "lr": 0.01}], lr=0.5, **cfg)
    lockstep.run(ours, ref, a, b, steps=7)
    lockstep.assert_close(a, b, rtol=2e-5, atol=2e-5, what="param")
    if cfg["momentum"]:
        lockstep.assert_close(_state(ours, a, "momentum_buffer"), _state(ref, b, "momentum_buffer"), rtol=2e-5,
                              atol=1e-6, what="buf")


def test_lars_wd_after_momentum_and_scaler(backend, lockstep):
    a = lockstep.params(SMALL)
    b = lockstep.copies(a, F64)
    ours = FusedLARS(a, lr=0.3, momentum=0.9, weight_decay=0.02, wd_after_momentum=True)
    ref = RefLARS(b, lr=0.3, momentum=0.9, weight_decay=0.02, wd_after_momentum=True)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 9)
    for it in range(4):
        gs = lockstep.grads(a)
        for p in a:
            p.grad = None
        sc.scale(sum((p * g).sum() for p, g in zip(a, gs))).backward()
        if it == 0:  # overflow on the first step: the buffers must still start "first"
            a[1].grad.view(-1)[0] = float("inf")
        sc.step(ours)
        sc.update()
        if it != 0:
            lockstep.set_grads(b, gs)
            ref.step()
    lockstep.assert_close(a, b, rtol=2e-5, atol=2e-5, what="param")


@pytest.mark.parametrize("make, exc, msg", [
    (lambda ps: FusedLAMB(ps, lr=-1.0), ValueError, "Invalid learning rate"),
    (lambda ps: FusedLAMB(ps, betas=(0.9, 1.0)), ValueError, "Invalid beta parameter at index 1"),
    (lambda ps: FusedLAMB(ps, amsgrad=True), RuntimeError, "AMSGrad"),
    (lambda ps: FusedMixedPrecisionLamb(ps, eps=-1.0), ValueError, "Invalid epsilon value"),
    (lambda ps: FusedMixedPrecisionLamb(ps, reduced_precision_dtype=torch.float64), ValueError, "reduced_precision"),
    (lambda ps: FusedNovoGrad(ps, weight_decay=-1.0), ValueError, "Invalid weight_decay value"),
    (lambda ps: FusedNovoGrad(ps, norm_type=1), ValueError, "norm_type"),
    (lambda ps: FusedNovoGrad(ps, amsgrad=True), RuntimeError, "AMSGrad"),
    (lambda ps: FusedLARS(ps, lr=0.1, momentum=-1.0), ValueError, "Invalid momentum value"),
    (lambda ps: FusedLARS(ps, lr=0.1, nesterov=True), ValueError, "nesterov=True requires"),
])
def test_bad_arguments(lockstep, make, exc, msg):
    with pytest.raises(exc, match=msg):
        make(lockstep.params())


def test_sparse_grads_rejected():
    p = torch.randn(4, 4, requires_grad=True)
    p.grad = torch.randn(4, 4).to_sparse()
    for opt in (FusedLAMB([p]), FusedMixedPrecisionLamb([p]), FusedNovoGrad([p]), FusedLARS([p], lr=0.1)):
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
